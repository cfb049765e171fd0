"""The progress line of long commands (`edgeinfer.progress`): drawn only on a terminal, at most every
REDRAW_S and on the last item, wiped by `clear` (before a result, an error or "interrupted"); and
`eval`'s counts, which reach the last window or token exactly."""

from __future__ import annotations

import io

from conftest import STORIES_FIX
from edgeinfer import progress
from edgeinfer.evaluate import perplexity, stream_perplexity
from edgeinfer.model import default_model_path


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_drawn_on_a_terminal_only_throttled_and_cleared(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    clock = iter([0.0, 0.05, 0.1, 0.5])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = Tty()
    p = progress.Progress("edgeinfer eval", out)
    for i in (1, 2):  # the second within REDRAW_S of the first: not drawn
        p(i, 4, "windows")
    p(4, 4, "windows")  # the last: always drawn
    assert out.getvalue() == "\r\033[Kedgeinfer eval: 1/4 windows ...\r\033[Kedgeinfer eval: 4/4 windows ..."
    progress.clear()
    assert out.getvalue().endswith("\r\033[K")
    size = len(out.getvalue())
    progress.clear()  # nothing on the terminal now: nothing to wipe
    assert len(out.getvalue()) == size
    pipe = io.StringIO()
    progress.Progress("edgeinfer eval", pipe)(1, 1, "windows")
    assert pipe.getvalue() == ""


def test_nothing_drawn_on_a_dumb_terminal(monkeypatch):
    """A hostile round: Emacs' shell (TERM=dumb) showed the line's cursor codes as text, ten `^[[K` in
    one `eval`."""
    monkeypatch.setenv("TERM", "dumb")
    out = Tty()
    progress.Progress("edgeinfer eval", out)(1, 1, "windows")
    progress.clear()
    assert out.getvalue() == "" and progress.on_terminal("edgeinfer eval") is None


def test_eval_counts_every_window_and_token():
    seen = []
    r = perplexity(default_model_path(), STORIES_FIX / "eval.txt", window=128,
                   progress=lambda d, n, unit: seen.append((d, n, unit)))
    assert [d for d, _, _ in seen] == list(range(1, r.n_windows + 1)) and {n for _, n, _ in seen} == {r.n_windows}
    seen.clear()
    r = stream_perplexity(default_model_path(), STORIES_FIX / "eval.txt", capacity=64,
                          progress=lambda d, n, unit: seen.append((d, n, unit)))
    assert seen[-1] == (r.scored_tokens, r.scored_tokens, "tokens")
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))

"""A one-line count on stderr while a long command runs (`edgeinfer eval`, `edgeinfer bench`), shown
only when stderr is a terminal (not TERM=dumb), so that logs and pipes get nothing but the result.

`Progress(label)` (or `on_terminal(label)`: None where nothing would be drawn) is called with
(done, total, unit) as work completes; it redraws at most every `REDRAW_S` seconds and on the last
item. `clear()` wipes the line of whichever Progress last drew one: the command does it before
printing its result, and the CLI's error and Ctrl-C handlers before their message, which otherwise
ran on after "run 1/2 ..." on the same line.
"""

from __future__ import annotations

import os
import sys
import time

REDRAW_S = 0.2
_shown: "Progress | None" = None  # the Progress whose line is on the terminal now


class Progress:
    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        # (a dumb terminal, Emacs' shell, shows the line's cursor codes as text: nothing drawn there)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"
        self._last = float("-inf")

    def __call__(self, done: int, total: int, unit: str) -> None:
        global _shown
        now = time.monotonic()
        if not self.tty or (now - self._last < REDRAW_S and done < total):
            return
        self._last = now
        print(f"\r\033[K{self.label}: {done}/{total} {unit} ...", end="", file=self.stream, flush=True)
        _shown = self


def on_terminal(label: str) -> Progress | None:
    """A Progress when stderr is a terminal, else None (a caller then skips what counting costs)."""
    p = Progress(label)
    return p if p.tty else None


def clear() -> None:
    """Wipe the progress line, if one is on the terminal."""
    global _shown
    if _shown is not None:
        print("\r\033[K", end="", file=_shown.stream, flush=True)
        _shown = None

"""`edgeinfer eval --path prefill|decode`: the same perplexity definition on the runtime's two forward
paths. Reference: at fp32 the two paths compute the same function (agreeing to float rounding); the
decode path's NLL equals a hand-written loop of single-token calls."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from conftest import STORIES_FIX, STORIES_SRC
from edgeinfer.engine import Engine
from edgeinfer.errors import EdgeInferError
from edgeinfer.evaluate import perplexity, window_nll
from edgeinfer.session import DecoderSession

EVAL = STORIES_FIX / "eval.txt"


def test_fp32_paths_agree(converted):
    folder = converted(STORIES_SRC, "fp32")
    a, b = perplexity(folder, EVAL), perplexity(folder, EVAL, path="decode")
    assert (a.path, b.path) == ("prefill", "decode") and a.scored_tokens == b.scored_tokens
    assert abs(a.perplexity / b.perplexity - 1) < 1e-5


def test_decode_path_is_single_token_calls(converted):
    folder = converted(STORIES_SRC, "int8")
    eng = Engine(DecoderSession(folder))
    cache = eng.new_cache(64, 0)
    ids = [1, 403, 407, 261, 378, 426, 263, 42, 295, 262]
    got, n = window_nll(eng, cache, ids, "decode")
    cache.reset()
    want = 0.0
    for t in range(len(ids) - 1):
        row = eng.forward(cache, ids[t:t + 1])[0].astype(np.float64)
        want += float(np.logaddexp.reduce(row) - row[ids[t + 1]])
    assert n == len(ids) - 1 and math.isclose(got, want, rel_tol=1e-5)


def test_a_long_window_is_scored_in_calls_of_at_most_prefill_chunk(converted, monkeypatch):
    """A window longer than PREFILL_CHUNK goes through calls of that many rows with the cache kept
    (a window of 8192 in one call held 13 GB on SmolLM2), scoring what one call over it scores
    (fp32: to float rounding)."""
    import edgeinfer.evaluate as ev
    folder = converted(STORIES_SRC, "fp32")
    monkeypatch.setattr(ev, "PREFILL_CHUNK", 512)
    whole = perplexity(folder, EVAL, window=300)  # one call per window
    rows = []
    forward = Engine.forward
    monkeypatch.setattr(Engine, "forward", lambda self, cache, ids, *a, **k: rows.append(len(ids)) or
                        forward(self, cache, ids, *a, **k))
    monkeypatch.setattr(ev, "PREFILL_CHUNK", 64)
    chunked = perplexity(folder, EVAL, window=300)
    assert max(rows) == 64 and rows.count(64) > rows.count(300 % 64)  # full calls, and each window's rest
    assert chunked.scored_tokens == whole.scored_tokens and chunked.n_windows == whole.n_windows
    assert abs(chunked.perplexity / whole.perplexity - 1) < 1e-5


def test_cli_path_flag_and_its_refusals():
    base = [sys.executable, "-m", "edgeinfer", "eval", "-m", str(STORIES_SRC.parent / "stories260K-int8"),
            "--text", str(EVAL)]
    r = subprocess.run(base + ["--path", "decode", "--json", "--window", "64"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "decode"
    r = subprocess.run(base + ["--path", "decode", "--stream", "--capacity", "64"], capture_output=True, text=True)
    assert r.returncode == 1 and "--path applies to window scoring" in r.stderr
    with pytest.raises(EdgeInferError, match="unknown --path"):
        perplexity(STORIES_SRC.parent / "stories260K-int8", EVAL, path="sideways")


def test_a_line_too_long_to_encode_at_once_is_refused_by_number(tmp_path):
    """A story is encoded in one call: an 8 MB line took the tokenizer 1.1 GB and 11 s that Ctrl-C
    waited for. Refused before the model loads, naming the line."""
    import edgeinfer.evaluate as ev
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time.\n" + "a " * (ev.MAX_STORY_CHARS // 2) + "b\n", encoding="utf-8")
    with pytest.raises(EdgeInferError, match=f"line 2 is {ev.MAX_STORY_CHARS + 1:,} characters: .* at most "
                                             f"{ev.MAX_STORY_CHARS:,}.*split it into lines"):
        perplexity(tmp_path / "no-model-needed", text)


def test_a_byte_order_mark_and_line_ends_are_not_text(tmp_path):
    """A UTF-8 BOM is not scored (it was: +4.8 % and 3 more tokens), CRLF ends a line as LF does,
    and only "\\n" separates stories: U+2028, a form feed or a lone CR inside a line are its text
    (splitlines() cut a story there into two that each started again from BOS)."""
    model = STORIES_SRC.parent / "stories260K-int8"
    plain = perplexity(model, EVAL)
    lines = EVAL.read_text(encoding="utf-8").split("\n")
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())
    got = perplexity(model, bom)
    assert (got.scored_tokens, got.n_stories, got.perplexity) == (plain.scored_tokens, plain.n_stories, plain.perplexity)
    story = next(line for line in lines if line.strip())
    words = story.split(" ")
    odd = tmp_path / "odd.txt"
    odd.write_text(" ".join(words[:20]) + "\u2028" + " ".join(words[20:40]) + "\x0c" + " ".join(words[40:60])
                   + "\r" + " ".join(words[60:80]) + "\n", encoding="utf-8", newline="")
    r = perplexity(model, odd)
    assert (r.n_stories, r.n_windows) == (1, 1)


def test_a_perplexity_past_floats_range_is_infinite_and_null_in_json(monkeypatch, capsys):
    """A broken model's mean NLL over ~709.8 nats (finite logits, a norm scaled x2000 in the hostile
    round) ended eval in an OverflowError traceback: the perplexity is infinite, the JSON says null
    beside the finite mean, the text says inf."""
    import edgeinfer.evaluate as ev
    from edgeinfer.cli import main

    monkeypatch.setattr(ev, "window_nll", lambda engine, cache, ids, path="prefill": (800.0 * (len(ids) - 1),
                                                                                     len(ids) - 1))
    model = STORIES_SRC.parent / "stories260K-int8"
    r = perplexity(model, EVAL)
    assert r.perplexity == math.inf and r.mean_nll == pytest.approx(800.0)
    assert main(["eval", "-m", str(model), "--text", str(EVAL), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["perplexity"] is None and out["mean_nll_nats_per_token"] == pytest.approx(800.0)
    assert main(["eval", "-m", str(model), "--text", str(EVAL)]) == 0
    assert capsys.readouterr().out.startswith("perplexity inf over 7898 tokens")


def test_stream_scoring_refuses_a_window(capsys):
    from edgeinfer.cli import main

    model = STORIES_SRC.parent / "stories260K-int8"
    assert main(["eval", "-m", str(model), "--text", str(EVAL), "--stream", "--capacity", "64", "--window", "8"]) == 1
    assert "--stream runs each story through the ring whole" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [dict(window="64"), dict(window=float("nan")), dict(window=2.5),
                                    dict(text_path=None), dict(model_dir=None)])
def test_bad_api_arguments_are_edgeinfer_errors(kwargs):
    from edgeinfer.errors import InvalidArgumentTypeError

    args = dict(model_dir=STORIES_SRC.parent / "stories260K-int8", text_path=EVAL) | kwargs
    with pytest.raises(InvalidArgumentTypeError):
        perplexity(**args)


@pytest.mark.parametrize("kwargs,error", [(dict(capacity=None), "capacity must be an integer"),
                                          (dict(capacity="64"), "capacity must be an integer"),
                                          (dict(capacity=64, chunk=-3), "chunk must be at least 1"),
                                          (dict(capacity=64, sinks=1.5), "sinks must be an integer")])
def test_bad_stream_arguments_are_edgeinfer_errors(kwargs, error):
    from edgeinfer.evaluate import stream_perplexity

    with pytest.raises(EdgeInferError, match=error):
        stream_perplexity(STORIES_SRC.parent / "stories260K-int8", EVAL, **kwargs)


def test_numpy_integers_are_taken_and_threads_reach_every_session(monkeypatch):
    """np.int64 arguments are the integers they are (window=np.int64(64) was refused, naming
    capacity_tokens); the engine gets the threads given (a portable folder's prefill session ran on
    every core under eval --threads 1)."""
    import edgeinfer.evaluate as ev

    seen = []
    real = ev.open_engine
    monkeypatch.setattr(ev, "open_engine", lambda session, max_chunk, threads=None, **k: (
        seen.append(threads), real(session, max_chunk, threads, **k))[1])
    model = STORIES_SRC.parent / "stories260K-int8"
    r = perplexity(model, EVAL, window=np.int64(64), threads=1)
    assert r.scored_tokens == 7919 - r.n_windows and seen == [1]
    ev.stream_perplexity(model, EVAL, capacity=np.int64(64), sinks=np.int64(4), chunk=np.int64(16), threads=1)
    assert seen == [1, 1]


def test_the_result_says_its_window(capsys):
    """A portable folder's small ring scores shorter windows (6.7453 on eval.txt at 64 tokens against
    5.6836 at 512) without saying so (hostile round): the result and both outputs name the window."""
    from edgeinfer.cli import main

    model = STORIES_SRC.parent / "stories260K-int8"
    assert perplexity(model, EVAL, window=64).window == 64 and perplexity(model, EVAL).window == 512
    assert main(["eval", "-m", str(model), "--text", str(EVAL), "--window", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["window"] == 64
    assert main(["eval", "-m", str(model), "--text", str(EVAL), "--window", "64"]) == 0
    assert "windows of at most 64 tokens" in capsys.readouterr().out


def test_a_symlink_loop_is_named_as_such(tmp_path):
    loop = tmp_path / "loop.txt"
    loop.symlink_to(loop)
    with pytest.raises(EdgeInferError, match="symbolic link that leads nowhere"):
        perplexity(STORIES_SRC.parent / "stories260K-int8", loop)


def test_stream_scoring_is_not_said_to_have_windows(capsys):
    """It printed "16 stories, 16 windows": stream scoring has none."""
    from edgeinfer.cli import main
    assert main(["eval", "-m", str(STORIES_SRC.parent / "stories260K-int8"), "--text", str(EVAL), "--stream",
                 "--capacity", "64"]) == 0
    out = capsys.readouterr().out
    assert "(16 stories, each a stream through the ring, " in out and "window" not in out, out


def test_without_a_model_eval_scores_the_bundled_one(capsys):
    """As generate, chat and bench do (README; the docs' `edgeinfer eval --text ...` had exited 2: -m was
    required, a docs round)."""
    import os

    from edgeinfer.cli import main
    from edgeinfer.model import default_model_path

    assert main(["eval", "--text", str(EVAL), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == os.path.abspath(default_model_path())
    assert out["perplexity"] == pytest.approx(perplexity(default_model_path(), EVAL).perplexity, rel=1e-12)

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

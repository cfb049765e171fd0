"""Architecture parity: every family converts at fp32 to logits within 1e-4 of transformers.

References were made once by scripts/make_parity_fixtures.py (transformers 5.24, torch 2.13, CPU)
and committed, so this runs without torch. Also checks the KV interface: prefill then one token
at a time with `past` must give the same logits as one full pass, and greedy decoding through
the cache must reproduce transformers' 32-token continuation.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY, TINY_MODELS
from edgeinfer.engine import Engine
from edgeinfer.session import DecoderSession

TOL = 1e-4


def _engine(folder, chunk: int = 64):
    """The runtime's forward path over an empty cache that holds every token (no ring wrap)."""
    eng = Engine(DecoderSession(folder), max_chunk=chunk)
    return eng, eng.new_cache(256, 0)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_full_pass_logits_match_transformers(name, converted):
    ref = np.load(TINY / name / "reference.npz")
    eng, cache = _engine(converted(TINY / name, "fp32"))
    logits = eng.forward(cache, ref["input_ids"][0].tolist(), all_logits=True)
    assert np.abs(logits - ref["logits"]).max() < TOL


@pytest.mark.parametrize("name", TINY_MODELS)
def test_incremental_decode_matches_full_pass(name, converted):
    ref = np.load(TINY / name / "reference.npz")
    ids = ref["input_ids"][0].tolist()
    eng, cache = _engine(converted(TINY / name, "fp32"))
    rows = [eng.forward(cache, ids[:10], all_logits=True)]
    for t in range(10, len(ids), 3):  # chunks of 3, then the tail
        rows.append(eng.forward(cache, ids[t:t + 3], all_logits=True).copy())
    assert np.abs(np.concatenate(rows) - ref["logits"]).max() < TOL


@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_32_tokens_match_transformers(name, converted):
    ref = np.load(TINY / name / "reference.npz")
    eng, cache = _engine(converted(TINY / name, "fp32"))
    out = [int(eng.prefill(cache, ref["prompt_ids"].tolist()).argmax())]
    while len(out) < 32:
        out.append(int(eng.decode_one(cache, out[-1]).argmax()))
    assert out == ref["greedy_ids"].tolist()

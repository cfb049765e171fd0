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
from edgeinfer.session import DecoderSession

TOL = 1e-4


def _run(sess: DecoderSession, ids: list[int], past, start: int, logits_for: str = "all"):
    s = len(ids)
    x = np.asarray([ids], np.int64)
    pos = np.arange(start, start + s, dtype=np.int64)[None]
    idx = np.arange(s, dtype=np.int64) if logits_for == "all" else np.array([s - 1], np.int64)
    logits, new = sess.forward(x, pos, past, idx)
    past = [(np.concatenate([k, nk], 1), np.concatenate([v, nv], 1)) for (k, v), (nk, nv) in zip(past, new)]
    return logits[0], past


@pytest.mark.parametrize("name", TINY_MODELS)
def test_full_pass_logits_match_transformers(name, converted):
    ref = np.load(TINY / name / "reference.npz")
    sess = DecoderSession(converted(TINY / name, "fp32"))
    logits, _ = _run(sess, ref["input_ids"][0].tolist(), sess.empty_past(), 0)
    assert np.abs(logits - ref["logits"]).max() < TOL


@pytest.mark.parametrize("name", TINY_MODELS)
def test_incremental_decode_matches_full_pass(name, converted):
    ref = np.load(TINY / name / "reference.npz")
    ids = ref["input_ids"][0].tolist()
    sess = DecoderSession(converted(TINY / name, "fp32"))
    got, past = _run(sess, ids[:10], sess.empty_past(), 0)
    rows = [got]
    for t in range(10, len(ids), 3):  # chunks of 3, then the tail
        chunk = ids[t:t + 3]
        lg, past = _run(sess, chunk, past, t)
        rows.append(lg)
    assert np.abs(np.concatenate(rows) - ref["logits"]).max() < TOL


@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_32_tokens_match_transformers(name, converted):
    ref = np.load(TINY / name / "reference.npz")
    sess = DecoderSession(converted(TINY / name, "fp32"))
    prompt = ref["prompt_ids"].tolist()
    lg, past = _run(sess, prompt, sess.empty_past(), 0, logits_for="last")
    out = [int(lg[-1].argmax())]
    while len(out) < 32:
        lg, past = _run(sess, [out[-1]], past, len(prompt) + len(out) - 1, logits_for="last")
        out.append(int(lg[-1].argmax()))
    assert out == ref["greedy_ids"].tolist()

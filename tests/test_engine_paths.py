"""Both KV modes through the Engine (IO binding straight into the ring): GroupQueryAttention over
the shared buffer and standard-op attention over the valid block must reproduce transformers'
greedy continuations, with any prefill chunking, and forget exactly what the ring drops."""

from __future__ import annotations

import numpy as np
import pytest

import edgeinfer
from conftest import TINY, TINY_MODELS, one_layer_model
from edgeinfer.converters import convert
from edgeinfer.session import DecoderSession


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = {}

    def get(name: str, attention: str):
        if (name, attention) not in cache:
            dst = tmp_path_factory.mktemp("paths") / f"{name}-{attention}"
            convert(TINY / name, dst, quant="fp32", attention=attention)
            cache[name, attention] = dst
        return cache[name, attention]

    return get


@pytest.mark.parametrize("attention", ["auto", "standard"])
@pytest.mark.parametrize("chunk", [256, 3])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_engine_greedy_matches_transformers(folders, name, attention, chunk):
    ref = np.load(TINY / name / "reference.npz")
    m = edgeinfer.load(folders(name, attention), prefill_chunk=chunk)
    assert m.engine.shared == (attention == "auto")  # every tiny model has a head size GQA takes
    c = m.generate(ref["prompt_ids"].tolist(), max_new_tokens=32, temperature=0, ignore_eos=True)
    assert list(c.token_ids) == ref["greedy_ids"].tolist()


def test_gqa_ring_matches_explicit_sliding_window(tmp_path):
    folder = one_layer_model(TINY / "llama2_gqa_tied", tmp_path)
    m = edgeinfer.load(folder, capacity_tokens=24, n_sink=2, prefill_chunk=5)
    assert m.engine.shared
    sess = DecoderSession(folder)
    ids = np.random.default_rng(0).integers(3, 512, 70).tolist()
    cache = m.new_cache()
    rows, pos = {}, 0
    while pos < len(ids):
        s = min(5, len(ids) - pos)  # chunks keep going past the capacity: overflow rows move into the ring
        lg = m.engine.forward(cache, ids[pos:pos + s], all_logits=True)
        rows.update({pos + j: lg[j].copy() for j in range(s)})
        pos += s
    assert cache.n_valid == 24 and cache.dropped == 70 - 24
    for t in (10, 23, 24, 25, 40, 69):
        if t < 24:
            sel = list(range(t + 1))
        else:  # the call that holds t started with the ring as it was after the previous chunk
            start = t - (t % 5)
            held = list(range(2)) + list(range(max(2, start - 22), start))
            sel = held + list(range(start, t + 1))
        ref, _ = sess.forward(np.array([[ids[i] for i in sel]]), np.array([sel]), sess.empty_past(),
                              np.array([len(sel) - 1]))
        assert np.abs(ref[0, -1] - rows[t]).max() < 1e-4, t

"""Both KV modes through the Engine (IO binding straight into the ring): GroupQueryAttention over
the shared buffer and standard-op attention over the valid block must reproduce transformers'
greedy continuations, with any prefill chunking, and forget exactly what the ring drops."""

from __future__ import annotations

import re

import numpy as np
import pytest

import edgeinfer
from conftest import TINY, TINY_MODELS, one_layer_model, ring_reference, run_ring
from edgeinfer.converters import convert
from edgeinfer.kv_mode import GQA, STANDARD


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
    assert m.engine.mode is (GQA if attention == "auto" else STANDARD)  # GQA takes every tiny model's head size
    c = m.generate(ref["prompt_ids"].tolist(), max_new_tokens=32, temperature=0, ignore_eos=True)
    assert list(c.token_ids) == ref["greedy_ids"].tolist()


def test_gqa_ring_matches_explicit_sliding_window(tmp_path):
    folder = one_layer_model(TINY / "llama2_gqa_tied", tmp_path)
    m = edgeinfer.load(folder, capacity_tokens=24, n_sink=2, prefill_chunk=5)
    assert m.engine.mode is GQA
    ids = np.random.default_rng(0).integers(3, 512, 90).tolist()
    cache = m.new_cache()
    # chunks keep going past the capacity: overflow rows move into the ring, and the ring re-bases
    rows = run_ring(m.engine, cache, ids, 5, shrink_when_full=False)
    assert cache.n_valid == 24 and cache.dropped == 90 - 24
    assert cache.rebased_tokens > 0 and cache.next_position < 90  # positions were moved back
    for t in (10, 23, 24, 25, 40, 64, 69, 89):
        lg, start, p0 = rows[t]
        assert np.abs(ring_reference(m.engine, ids, t, start, p0, 24, 2) - lg).max() < 1e-4, t


def test_prefill_never_ends_on_a_one_token_call_so_chunking_does_not_change_logits():
    """MatMulNBits' single-row path (int8 activations, accuracy_level 4) gives other logits than the
    same row inside a larger call; prefill never ends on a one-token call, so where the chunks fall
    does not matter: bit-identical logits (the bundled int8 model)."""
    from edgeinfer.engine import prefill_chunks

    m = edgeinfer.load(prefill_chunk=16)
    ids = [1] + np.random.default_rng(0).integers(3, 512, 32).tolist()  # 33 tokens: 16 + 16 + 1 naively
    assert prefill_chunks(33, 16) == [(0, 16), (16, 31), (31, 33)]
    whole = m.engine.prefill(m.new_cache(), ids, chunk=64).copy()
    assert np.array_equal(m.engine.prefill(m.new_cache(), ids, chunk=16), whole)
    # what the old chunking did, for the record: a last one-token call moves the logits
    c = m.new_cache()
    m.engine.prefill(c, ids[:32], chunk=16)
    assert not np.array_equal(m.engine.decode_one(c, ids[32]), whole)


def test_calls_of_mixed_shapes_on_interleaved_rings_match_each_ring_alone(folders):
    """The in-place mode keeps one IO binding per call shape, each pointing at the ring it last ran;
    calls of 1, 3 and 5 rows on two rings, interleaved (and a ring freed and replaced, which may
    land at the same address), give the logits of each ring run alone on a fresh model."""
    folder = folders("llama2_gqa_tied", "auto")
    ids = np.random.default_rng(1).integers(3, 512, 60).tolist()
    shapes = [1, 3, 1, 5, 1, 1, 3, 2, 1, 5]

    def alone(start):
        m = edgeinfer.load(folder)
        cache, out, at = m.new_cache(), [], start
        for s in shapes:
            out.append(m.engine.forward(cache, ids[at:at + s], all_logits=True).copy())
            at += s
        return out

    ref_a, ref_b = alone(0), alone(30)
    m = edgeinfer.load(folder)
    assert m.engine.mode is GQA
    buf = np.full((1, 8, m.engine.spec.vocab_size), np.nan, np.float32)
    for round_ in range(2):
        a, b, at_a, at_b = m.new_cache(), m.new_cache(), 0, 30
        for i, s in enumerate(shapes):
            got_a = m.engine.forward(a, ids[at_a:at_a + s], all_logits=True, out=buf if i % 2 else None).copy()
            got_b = m.engine.forward(b, ids[at_b:at_b + s], all_logits=True, out=buf).copy()
            at_a, at_b = at_a + s, at_b + s
            assert got_a.shape == ref_a[i].shape and np.abs(got_a - ref_a[i]).max() < 1e-5, (round_, i)
            assert np.abs(got_b - ref_b[i]).max() < 1e-5, (round_, i)
        del a, b  # the next round's rings may reuse these addresses: every binding must rebind


def test_forward_refuses_an_out_buffer_it_cannot_fill(folders):
    m = edgeinfer.load(folders("llama2_gqa_tied", "auto"))
    v, cache = m.engine.spec.vocab_size, m.new_cache()
    read_only = np.zeros((1, 4, v), np.float32)
    read_only.flags.writeable = False
    frozen = np.frombuffer(bytes(4 * 4 * v), np.float32).reshape(1, 4, v)  # a view of an immutable bytes object
    for bad, why in ((np.empty((1, 2, v), np.float32), r"\(1, 2, "), (np.empty((1, 4, v + 1), np.float32), "float32"),
                     (np.empty((1, 4, v), np.float64), "float64"), (np.empty((4, v), np.float32), "float32"),
                     (np.empty((1, 8, v), np.float32)[:, ::2], "not C-contiguous"), (read_only, "read-only"),
                     (frozen, "read-only"), ([[0.0] * v] * 4, "got list")):
        with pytest.raises(ValueError, match="out must be a writeable") as e:
            m.engine.forward(cache, [5, 6, 7], all_logits=True, out=bad)
        assert re.search(why, str(e.value)), (why, str(e.value))
    assert cache.n_valid == 0 and not read_only.any()  # nothing ran, nothing written
    # a buffer checked once is not checked again while it comes back, unless it was made read-only since
    reused = np.zeros((1, 4, v), np.float32)
    m.engine.forward(cache, [5, 6, 7], all_logits=True, commit=False, out=reused)
    assert reused.any()
    reused[:] = 0
    reused.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        m.engine.forward(cache, [5, 6, 7], all_logits=True, commit=False, out=reused)
    assert not reused.any()

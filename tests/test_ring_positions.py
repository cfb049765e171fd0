"""Positions that do not drift: the ring's output stays as good on its 8th pass over a text as on its
first, on both KV paths, because the ring re-bases its tokens' positions (StreamingLLM's rule)."""

from __future__ import annotations


import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC, TINY, one_layer_model
from edgeinfer.converters import convert
from edgeinfer.evaluate import stream_perplexity
from edgeinfer.kv_cache import rebase_interval
from edgeinfer.kv_mode import GQA, STANDARD

STORY = next(line for line in (STORIES_FIX / "eval.txt").read_text().splitlines() if line.strip())


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """stories260K at fp32 on each KV path: standard ops (head 8) and GroupQueryAttention (the same
    network with its heads widened to 16 by the converter, converters/widen.py)."""
    tmp = tmp_path_factory.mktemp("ring-positions")
    convert(STORIES_SRC, tmp / "standard", quant="fp32", attention="standard")
    convert(STORIES_SRC, tmp / "gqa", quant="fp32", attention="gqa")
    return {"standard": tmp / "standard", "gqa": tmp / "gqa"}


def test_widened_model_is_the_same_network(paths):
    a = edgeinfer.load(paths["standard"])
    b = edgeinfer.load(paths["gqa"])
    assert a.engine.mode is STANDARD and b.engine.mode is GQA
    ids = a.tokenizer.encode(STORY)[:100]
    la = a.engine.forward(a.new_cache(), ids, all_logits=True).copy()
    lb = b.engine.forward(b.new_cache(), ids, all_logits=True)
    assert np.abs(la - lb).max() < 1e-4


@pytest.mark.parametrize("path", ["standard", "gqa"])
def test_eighth_pass_over_a_text_scores_like_the_first(paths, path, tmp_path):
    """One story (478 scored tokens) vs the same story 8 times as one stream (3,824 tokens) through a
    64-slot ring with 4 sinks. With absolute positions the 8-copy stream scored 21.6 against 6.5."""
    one, eight = tmp_path / "one.txt", tmp_path / "eight.txt"
    one.write_text(STORY + "\n")
    eight.write_text(" ".join([STORY] * 8) + "\n")
    p1 = stream_perplexity(paths[path], one, capacity=64, sinks=4).perplexity
    p8 = stream_perplexity(paths[path], eight, capacity=64, sinks=4).perplexity
    assert abs(p8 / p1 - 1) < 0.03, (p1, p8)


@pytest.mark.parametrize("attention", ["standard", "auto"])
def test_positions_stay_bounded_and_sinks_keep_theirs(tmp_path, attention):
    folder = tmp_path / "m"
    convert(TINY / "llama2_gqa_tied", folder, quant="fp32", attention=attention)
    m = edgeinfer.load(folder, capacity_tokens=16, n_sink=3, prefill_chunk=4)
    cache = m.new_cache()
    rng = np.random.default_rng(0)
    m.engine.prefill(cache, rng.integers(3, 512, 10).tolist())
    seen = []
    for t in rng.integers(3, 512, 3000).tolist():
        m.engine.decode_one(cache, t)
        seen.append(cache.next_position)
    assert max(seen) <= cache.position_limit and cache.rebased_tokens > 2900
    assert cache.positions[:3].tolist() == [0, 1, 2]
    ring = np.sort(cache.positions[3:])
    assert np.array_equal(ring, np.arange(ring[0], ring[0] + 13))  # consecutive
    assert ring[-1] == cache.next_position - 1 and cache.next_position - 1 - 3 - 12 <= cache.rebase_every_tokens


@pytest.mark.parametrize("attention", ["standard", "auto"])
def test_rebase_equals_a_fresh_forward_at_the_new_positions(tmp_path, attention):
    """After a re-base the ring holds the sinks at 0..n_sink-1 and its tokens at consecutive positions
    from n_sink: exactly what feeding those same tokens into an empty cache computes. Rotating cached
    keys by -d must equal computing them at the lower position (one layer: a key depends only on its
    token and position), values untouched."""
    m = edgeinfer.load(one_layer_model(TINY / "qwen2_bias_tied", tmp_path, attention), capacity_tokens=20, n_sink=2,
                       prefill_chunk=8)
    assert m.engine.mode is (GQA if attention == "auto" else STANDARD)
    ids = np.random.default_rng(1).integers(3, 512, 47).tolist()
    cache = m.new_cache()
    for t in ids:
        m.engine.decode_one(cache, t)
    cache.rebase_if_due(cache.capacity + cache.rebase_every_tokens)  # force one now
    order = np.argsort(cache.positions)
    assert cache.positions[order].tolist() == list(range(20))
    ref = m.new_cache()
    m.engine.prefill(ref, ids[:2] + ids[-18:])  # the held tokens, in position order, from empty
    for a, b in ((cache.ks, ref.ks), (cache.vs, ref.vs)):  # slot-major views [rows, Hkv, Dh] in either mode
        for x, y in zip(a, b):
            assert np.abs(x[:20][order] - y[:20]).max() < 1e-4


@pytest.mark.parametrize("capacity,chunk,max_pos,expected", [
    (128, 64, 512, 32),  # a quarter of the capacity
    (512, 256, 512, 32),  # no headroom left in the trained length: a sixteenth
    (4096, 256, 8192, 1024),
    (2, 1, 2, 1),
])
def test_rebase_interval(capacity, chunk, max_pos, expected):
    assert rebase_interval(capacity, chunk, max_pos) == expected

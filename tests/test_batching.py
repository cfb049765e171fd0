"""Continuous batching: several conversations' decode steps as one graph call, bit-identical to each
decoding alone (a real model on the GroupQueryAttention path: stories260K, its heads widened to 16 by the converter)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_SRC
from edgeinfer.batching import DecodeBatcher
from edgeinfer.converters import convert
from edgeinfer.generation import Generation
from edgeinfer.kv_cache import BatchedKV


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batching")
    convert(STORIES_SRC, tmp / "gqa", quant="fp32", attention="gqa")
    return edgeinfer.load(tmp / "gqa", capacity_tokens=48, n_sink=4)


def test_decode_batch_equals_single_steps_through_wrap_and_rebase(gqa_model):
    m = gqa_model
    eng, spec = m.engine, m.manifest.arch
    kv = BatchedKV(spec, 3, 48, 4, eng.max_chunk, eng.mode)
    singles = [m.new_cache() for _ in range(3)]
    rng = np.random.default_rng(0)
    nxt = []
    for c, s, n in zip(kv.caches, singles, (5, 17, 40)):
        p = [1] + rng.integers(3, 512, n).tolist()
        eng.prefill(c, p)
        nxt.append(int(eng.prefill(s, p).argmax()))
    for step in range(150):
        active = {b: t for b, t in enumerate(nxt) if not (step % 7 == 3 and b == 1)}  # row 1 sits some out
        eng.decode_batch(kv, active)
        for b, t in active.items():
            ref = eng.decode_one(singles[b], t)
            assert np.array_equal(kv.caches[b].logits[0, 0], ref), (step, b)
            nxt[b] = int(ref.argmax())
    assert all(c.dropped and c.rebased_tokens for c in kv.caches)  # the rings wrapped and re-based


def test_threads_through_the_batcher_equal_each_alone(gqa_model):
    m = gqa_model
    eng = m.engine
    prompts = ["Once upon a time", "Lily and Ben were", "The little dog", "One day, a bird"]
    opts = edgeinfer.GenerationOptions.from_kwargs(max_new_tokens=60, temperature=0, ignore_eos=True)
    alone = {p: m.generate(p, opts).token_ids for p in prompts}
    kv = BatchedKV(m.manifest.arch, 4, 48, 4, eng.max_chunk, eng.mode)
    gathered = threading.Barrier(4, timeout=120)

    class GatheredBatcher(DecodeBatcher):
        """Every conversation joins before any steps, so the sharing asserted below does not hang on
        how the OS schedules four threads on a loaded box (alone, the first could finish first)."""

        def join(self, cache):
            super().join(cache)
            gathered.wait()

    batcher = GatheredBatcher(eng, kv)
    got, errors = {}, []

    def run(i):
        try:
            ids = m.encode_prompt(prompts[i])
            cache = kv.caches[i]
            gen = Generation(eng, m.tokenizer, cache, opts, "shift", begin=lambda req: (cache.reset(), ids)[1],
                             stepper=batcher)
            for _ in gen:
                pass
            got[prompts[i]] = gen.completion.token_ids
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    calls_before = eng.calls
    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors and got == alone
    decode_calls = eng.calls - calls_before - 4  # minus the four prefills
    assert batcher.steps == decode_calls == 59  # every step was shared: one graph call for four tokens


def test_a_leaving_conversation_does_not_stall_the_others(gqa_model):
    """One stream is dropped half-way: the others go on (leave() completes their set)."""
    m = gqa_model
    eng = m.engine
    kv = BatchedKV(m.manifest.arch, 2, 48, 4, eng.max_chunk, eng.mode)
    batcher = DecodeBatcher(eng, kv)
    opts = edgeinfer.GenerationOptions.from_kwargs(max_new_tokens=40, temperature=0, ignore_eos=True)
    ids = m.encode_prompt("Once upon a time")
    a = Generation(eng, m.tokenizer, kv.caches[0], opts, "shift", begin=lambda req: ids, stepper=batcher)
    b = Generation(eng, m.tokenizer, kv.caches[1], opts, "shift", begin=lambda req: ids, stepper=batcher)
    next(a)  # a has joined and waits with its first token in hand
    done = threading.Event()

    def run_b():
        for _ in b:
            pass
        done.set()

    t = threading.Thread(target=run_b)
    t.start()
    a.close()  # a leaves without stepping again
    t.join(timeout=60)
    assert done.is_set() and b.completion.token_ids == m.generate(ids, opts).token_ids

"""Fuzz the C entry points (hypothesis): any shape, values with NaN/inf, any parameters. Either
both back ends raise ValueError, or they agree; the interpreter never crashes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgeinfer.sampling import BACKEND, Sampler, SamplingParams, filter_probs, reference

pytestmark = pytest.mark.skipif(BACKEND != "c", reason="C extension not built")

floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]), top_k=st.integers(0, 50),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 1e-6]), min_p=st.sampled_from([0.0, 0.05, 1.0]),
    typical_p=st.sampled_from([1.0, 0.7, 1e-6]), repetition_penalty=st.sampled_from([1.0, 1.3]),
    frequency_penalty=st.sampled_from([0.0, 0.7]), presence_penalty=st.sampled_from([0.0, -0.5]),
    penalty_last_n=st.sampled_from([0, 3, 64]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=hnp.arrays(np.float32, st.integers(0, 400), elements=floats), p=params,
       history=st.lists(st.integers(-2, 500), max_size=20), seed=st.integers(0, 2**64 - 1))
def test_fuzz_c_against_twin(logits, p, history, seed):
    try:
        ref = reference.filter_probs(logits, p, history)
    except ValueError:
        with pytest.raises(ValueError):
            filter_probs(logits, p, history)
        with pytest.raises(ValueError):
            Sampler(p, seed, history).sample(logits)
        return
    got = filter_probs(logits, p, history)
    assert np.array_equal(got > 0, ref > 0) and np.abs(got - ref).max() < 1e-6
    token = Sampler(p, seed, history).sample(logits)
    assert ref[token] > 0


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_raw_entry_point_rejects_bad_buffers(data):
    """The extension's own argument checks: wrong dtypes, ranks and sizes raise, never crash."""
    from edgeinfer.sampling import _csampler

    s = _csampler.Sampler(seed=0)
    dtype = data.draw(st.sampled_from([np.float32, np.float64, np.int64, np.int32, np.uint8]))
    shape = data.draw(st.sampled_from([(0,), (5,), (2, 3)]))
    logits = np.zeros(shape, dtype)
    hist = np.zeros(data.draw(st.integers(0, 3)), data.draw(st.sampled_from([np.int64, np.int32, np.float64])))
    out = data.draw(st.sampled_from([None, np.zeros(5), np.zeros(4), np.zeros(5, np.float32)]))
    try:
        s.reset(hist)
        s.run(logits, probs_out=out)
    except (ValueError, TypeError, BufferError):
        pass


ids = st.one_of(st.integers(0, 40), st.integers(-2**70, 2**70), st.floats(), st.booleans(), st.none(),
                st.text(max_size=2))


@settings(max_examples=200, deadline=None)
@given(given_ids=st.lists(ids, max_size=300), n=st.sampled_from([0, 1, 3, 64]), reset_at=st.integers(0, 300),
       vocab=st.sampled_from([1, 41, 1000]))
def test_fuzz_raw_accept_and_reset(given_ids, n, reset_at, vocab):
    """Any object given to accept/reset raises or is taken; the window then penalises exactly as the
    twin does given every id taken (since the last reset), and the interpreter never crashes."""
    from edgeinfer.sampling import _csampler

    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.2, presence_penalty=0.1, penalty_last_n=n)
    s = _csampler.Sampler(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, penalty_last_n=n)
    taken: list[int] = []
    for i, t in enumerate(given_ids):
        if i == reset_at:
            s.reset(history=np.array(taken[-5:], np.int64))
            taken = taken[-5:]
        try:
            s.accept(t)
        except (ValueError, TypeError):
            assert not (isinstance(t, int) and 0 <= t < 2**31)
            continue
        taken.append(int(t))
    logits = np.linspace(-3, 3, vocab, dtype=np.float32)
    out = np.empty(vocab)
    try:
        ref = reference.filter_probs(logits, p, taken)
    except ValueError:
        with pytest.raises(ValueError, match="history"):
            s.run(logits, probs_out=out, draw=False)
        return
    s.run(logits, probs_out=out, draw=False)
    assert np.abs(out - ref).max() < 1e-12


def _outcome(f):
    try:
        return f()
    except ValueError as e:
        return ("ValueError", str(e))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=hnp.arrays(np.float32, st.integers(0, 400),
                         elements=st.one_of(floats, st.sampled_from([0.0, -0.0, 1.0, -np.inf]))),
       history=st.lists(st.integers(0, 500), max_size=5))
def test_fuzz_greedy_fast_path_is_the_chain(logits, history):
    """Sampler.sample at temperature 0 with no penalty or bias takes `greedy` (float32, one read):
    the same token as the full chain (`run`, via double), lowest id on ties (-0.0 == 0.0), and the
    same error, in the same order, for NaN, +inf, all -inf, empty, or a history id past the vocabulary."""
    from edgeinfer.sampling import _csampler

    fast, full = _csampler.Sampler(temperature=0.0, seed=0), _csampler.Sampler(temperature=0.0, seed=0)
    for s in (fast, full):
        s.reset(np.array(history, np.int64))
    assert _outcome(lambda: fast.greedy(logits)) == _outcome(lambda: full.run(logits))
    sampler = Sampler(SamplingParams(temperature=0.0), 0, history)
    assert sampler._greedy is not None
    assert _outcome(lambda: sampler.sample(logits)) == _outcome(lambda: full.run(logits))


@pytest.mark.parametrize("vocab", [49_152, 151_936, 40_001])
def test_greedy_fast_path_on_real_vocabularies(vocab):
    """Ties far apart, the maximum in the scalar tail, a NaN or +inf last: the lanes' bookkeeping."""
    from edgeinfer.sampling import _csampler

    rng = np.random.default_rng(vocab)
    s = _csampler.Sampler(temperature=0.0, seed=0)
    for where in ([vocab - 1], [3, vocab - 2], [vocab // 2, vocab // 2 + 33], [31, 32, 33], [0]):
        x = rng.standard_normal(vocab).astype(np.float32)
        x[where] = 9.0
        assert s.greedy(x) == s.run(x) == where[0]
    for bad, msg in ((np.nan, "NaN"), (np.inf, r"\+inf")):
        x[-1] = bad
        with pytest.raises(ValueError, match=msg):
            s.greedy(x)
    x = np.full(vocab, -np.inf, np.float32)
    with pytest.raises(ValueError, match="all logits are -inf"):
        s.greedy(x)


def test_logprobs_after_a_greedy_draw_are_the_chains():
    """sample_with_logprobs does not take the fast path (it keeps no logits for logprobs)."""
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    r = Sampler(SamplingParams(temperature=0.0), 0).sample_with_logprobs(x, top_n=3)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert r.token == int(np.argmax(x)) and abs(r.logprob - ref.max()) < 1e-9
    assert [t for t, _ in r.top] == list(np.argsort(-x)[:3])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=0),
                                    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                                    SamplingParams(temperature=0.8, repetition_penalty=1.1)])
@pytest.mark.parametrize("vocab", [1, 31, 33, 49_152])
def test_all_minus_inf_is_refused_without_the_argmax_pass(params, vocab):
    """At a temperature above 0 with nothing adjusted the chain no longer takes the argmax (two reads
    of the vocabulary); the count of -inf logits refuses an all -inf row with the same error."""
    x = np.full(vocab, -np.inf, np.float32)
    with pytest.raises(ValueError, match="all logits are -inf"):
        Sampler(params, 0, [0]).sample(x)
    x[vocab // 2] = 1.0  # one finite logit: it is drawn
    assert Sampler(params, 0, [0]).sample(x) == vocab // 2


@pytest.mark.parametrize("vocab", [40, 49_152, 151_936])
def test_top_k_block_skipping_keeps_the_same_candidates(vocab):
    """top_k_scan skips blocks of 32 with nothing above the heap's floor: the kept set (ties by the
    lower id) is the twin's, for rising, falling, tied and random logits."""
    rng = np.random.default_rng(vocab)
    ramp = np.arange(vocab, dtype=np.float64) * (20.0 / vocab)  # (a spread under exp's underflow, where the C
    rows = [rng.standard_normal(vocab), ramp, -ramp,  # chain's 0 and numpy's denormals differ)
            np.repeat(rng.standard_normal(vocab // 40 + 1), 40)[:vocab], np.zeros(vocab)]
    for row in rows:
        x = row.astype(np.float32)
        for k in (1, 40, 1000):
            p = SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0)
            got, ref = filter_probs(x, p), reference.filter_probs(x, p)
            assert np.array_equal(got > 0, ref > 0) and np.abs(got - ref).max() < 1e-9


@pytest.mark.parametrize("vocab", [2, 41, 512, 4_099, 16_384, 16_385])
def test_top_k_by_buckets_keeps_the_same_candidates(vocab):
    """Vocabularies up to TOP_K_BUCKETS_MAX_V (16,384) take top-k by buckets of distance below the max,
    and fall back to the heap where fewer than k logits lie within the buckets' span or the threshold
    bucket holds many equal logits: the kept set is the twin's on either side of every limit (ties by
    the lower id; -inf never kept), with penalties, a bias and top-p after it."""
    rng = np.random.default_rng(vocab)
    ramp = np.arange(vocab, dtype=np.float64) * (20.0 / vocab)
    rows = [rng.standard_normal(vocab) * 3, ramp, -ramp, np.round(rng.standard_normal(vocab) * 2),  # ties
            np.zeros(vocab), np.arange(vocab) * (40.0 / vocab),  # past the 32-nat span: few ids within it
            np.where(rng.random(vocab) < 0.5, -np.inf, rng.standard_normal(vocab)),
            np.concatenate([[5.0], np.full(vocab - 1, -40.0)]),  # one id within the span, the rest far below
            np.floor(rng.standard_normal(vocab) * 32) / 8]  # values on the buckets' edges (1/8 nat apart)
    for row in rows:
        x = row.astype(np.float32)
        if not np.isfinite(x).any():
            continue
        for k in (1, 2, 40, 600, vocab - 1):
            if k < 1:
                continue
            for p in (SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0),
                      SamplingParams(temperature=0.8, top_k=k, top_p=0.9, min_p=0.0, repetition_penalty=1.3,
                                     logit_bias={0: 3.0, vocab - 1: -2.0})):
                history = [0, 1, vocab - 1] if p.repetition_penalty != 1.0 else None
                got, ref = filter_probs(x, p, history), reference.filter_probs(x, p, history)
                assert np.array_equal(got > 0, ref > 0), (vocab, k, p)
                assert np.abs(got - ref).max() < 1e-9

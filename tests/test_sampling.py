"""The sampler: hand-computed cases per filter (as llama.cpp's test-sampling does), the C extension
held equal to its numpy twin on thousands of random cases, reproducible seeds, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

import edgeinfer.sampling as sampling
from edgeinfer.sampling import BACKEND, Sampler, SamplingParams, filter_probs, logprobs, reference
from edgeinfer.sampling.rng import Rng

OFF = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)


def P(**kw) -> SamplingParams:
    return SamplingParams(**{**OFF, **kw})


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


BOTH = [pytest.param(filter_probs, id="default-backend"), pytest.param(reference.filter_probs, id="numpy")]


@pytest.mark.parametrize("fp", BOTH)
@pytest.mark.parametrize("kw,expected", [
    (dict(top_k=1), [0, 0, 0, 1]),
    (dict(top_k=3), [0, 2 / 9, 3 / 9, 4 / 9]),
    (dict(top_k=4), [0.1, 0.2, 0.3, 0.4]),
    (dict(top_k=0), [0.1, 0.2, 0.3, 0.4]),
    (dict(top_p=0.65), [0, 0, 3 / 7, 4 / 7]),
    (dict(top_p=0.75), [0, 2 / 9, 3 / 9, 4 / 9]),
    (dict(top_p=0.3), [0, 0, 0, 1]),
    (dict(min_p=0.6), [0, 0, 3 / 7, 4 / 7]),
    (dict(min_p=0.76), [0, 0, 0, 1]),
    (dict(min_p=0.2), [0.1, 0.2, 0.3, 0.4]),
])
def test_hand_computed_filters(fp, kw, expected):
    np.testing.assert_allclose(fp(logits_of([0.1, 0.2, 0.3, 0.4]), P(**kw)), expected, atol=1e-7)


@pytest.mark.parametrize("fp", BOTH)
def test_typical_hand_computed(fp):
    # H = -(0.4 ln 0.4 + 3 * 0.2 ln 0.2) = 1.3322; |-ln p - H|: 0.416 for p = 0.4, 0.277 for p = 0.2,
    # so the three 0.2 tokens come first and reach 0.5 at the third
    np.testing.assert_allclose(fp(logits_of([0.4, 0.2, 0.2, 0.2]), P(typical_p=0.5)), [0, 1 / 3, 1 / 3, 1 / 3],
                               atol=1e-7)
    np.testing.assert_allclose(fp(logits_of([0.97, 0.01, 0.01, 0.01]), P(typical_p=0.5)), [1, 0, 0, 0], atol=1e-7)


@pytest.mark.parametrize("fp", BOTH)
def test_temperature_hand_computed(fp):
    # softmax([0, ln 4] / 2) = [1/3, 2/3]; at 0.5: softmax([0, 2 ln 4]) = [1/17, 16/17]
    lg = np.array([0.0, math.log(4.0)], np.float32)
    np.testing.assert_allclose(fp(lg, P(temperature=2.0)), [1 / 3, 2 / 3], atol=1e-7)
    np.testing.assert_allclose(fp(lg, P(temperature=0.5)), [1 / 17, 16 / 17], atol=1e-7)


@pytest.mark.parametrize("fp", BOTH)
def test_filters_see_probabilities_at_temperature_one(fp):
    # top-p 0.65 keeps {0.3, 0.4} whatever the temperature; the temperature reshapes only the kept pair
    got = fp(logits_of([0.1, 0.2, 0.3, 0.4]), P(top_p=0.65, temperature=0.5))
    np.testing.assert_allclose(got, [0, 0, 9 / 25, 16 / 25], atol=1e-7)


def test_penalties_hand_computed():
    lg = np.array([1.0, 2.0, -1.0, 0.5], np.float32)
    out = reference.adjust_logits(lg, P(repetition_penalty=2.0), [0, 2, 0])
    np.testing.assert_allclose(out, [0.5, 2.0, -2.0, 0.5])
    out = reference.adjust_logits(lg, P(frequency_penalty=0.5, presence_penalty=1.0), [1, 1, 3])
    np.testing.assert_allclose(out, [1.0, 2.0 - 1.0 - 1.0, -1.0, 0.5 - 0.5 - 1.0])
    # only the last penalty_last_n ids count
    out = reference.adjust_logits(lg, P(presence_penalty=1.0, penalty_last_n=1), [0, 1])
    np.testing.assert_allclose(out, [1.0, 1.0, -1.0, 0.5])
    out = reference.adjust_logits(lg, P(presence_penalty=1.0, penalty_last_n=0), [0, 1])
    np.testing.assert_allclose(out, lg)


@pytest.mark.parametrize("fp", BOTH)
def test_penalties_then_greedy(fp):
    lg = np.array([1.0, 2.0, -1.0, 0.5], np.float32)
    assert np.argmax(fp(lg, P(temperature=0))) == 1
    # token 1 penalised below token 0: 2 / 2.5 = 0.8 < 1
    assert np.argmax(fp(lg, P(temperature=0, repetition_penalty=2.5), [1])) == 0


def test_greedy_ties_pick_lowest_id_and_use_no_rng():
    lg = np.array([0.5, 3.0, 3.0, 1.0], np.float32)
    s = Sampler(P(temperature=0), seed=1)
    assert [s.sample(lg) for _ in range(3)] == [1, 1, 1]
    assert reference.sample(lg, P(temperature=0), None, None) == 1


@pytest.mark.parametrize("fp", BOTH)
def test_logit_bias(fp):
    lg = np.array([0.0, 5.0, 1.0], np.float32)
    assert np.argmax(fp(lg, P(temperature=0, logit_bias={0: 10.0}))) == 0
    probs = fp(lg, P(logit_bias={1: -math.inf}))
    assert probs[1] == 0 and probs.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("fp", BOTH)
def test_top_k_ties_keep_lower_ids(fp):
    lg = np.array([1.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    np.testing.assert_allclose(fp(lg, P(top_k=2)), [0, 0.5, 0.5, 0, 0], atol=1e-7)


@pytest.mark.parametrize("fp", BOTH)
def test_each_filter_keeps_at_least_one(fp):
    lg = logits_of([0.1, 0.2, 0.3, 0.4])
    for kw in (dict(top_p=1e-9), dict(min_p=1.0), dict(typical_p=1e-9), dict(top_k=1, top_p=1e-9, min_p=1.0)):
        assert (fp(lg, P(**kw)) > 0).sum() >= 1


def test_draws_follow_the_distribution():
    s = Sampler(P(), seed=123)
    lg = logits_of([0.1, 0.2, 0.3, 0.4])
    counts = np.bincount([s.sample(lg) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, [0.1, 0.2, 0.3, 0.4], atol=0.015)


def test_seed_reproducible_and_matches_numpy_twin():
    rng = np.random.default_rng(0)
    lg = rng.standard_normal(1000).astype(np.float32)
    params = SamplingParams()
    a, b = Sampler(params, seed=42), Sampler(params, seed=42)
    hist: list[int] = []
    seq_a = []
    for _ in range(50):
        t = a.sample(lg)
        seq_a.append(t)
        hist.append(t)
        a.accept(t)

    def replay(s: Sampler) -> list[int]:
        out = []
        for i in range(50):
            s.reset(hist[:i])
            out.append(s.sample(lg))
        return out

    assert replay(b) == seq_a
    r = Rng(42)
    assert [reference.sample(lg, params, hist[:i], r) for i in range(50)] == seq_a
    c = Sampler(params, seed=43)
    assert replay(c) != seq_a


def _random_case(rng: np.random.Generator, big: bool = False):
    v = int(rng.integers(300, 60000)) if big else (int(rng.integers(1, 3000)) if rng.random() < 0.7 else
                                                     int(rng.integers(1, 12)))
    lg = (rng.standard_normal(v) * rng.uniform(0.1, 8)).astype(np.float32)
    if rng.random() < 0.3:
        lg[rng.random(v) < 0.2] = -np.inf
    if rng.random() < 0.2:
        lg = np.round(lg)  # many exact ties
    params = SamplingParams(
        temperature=float(rng.choice([0, 0.5, 1.0, 1.5])), top_k=int(rng.choice([0, 0, 1, 5, 40, v + 3])),
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.1, 0.999])), min_p=float(rng.choice([0, 0.05, 0.3])),
        typical_p=float(rng.choice([1.0, 0.9, 0.5])), repetition_penalty=float(rng.choice([1, 1.1, 0.8])),
        frequency_penalty=float(rng.choice([0, 0.5])), presence_penalty=float(rng.choice([0, 0.3, -0.2])),
        penalty_last_n=int(rng.choice([0, 8, 64])),
        logit_bias={int(rng.integers(v)): float(rng.choice([rng.normal(), -np.inf]))} if rng.random() < 0.3 else None)
    return lg, params, rng.integers(0, v, int(rng.integers(0, 100)))


@pytest.mark.skipif(BACKEND != "c", reason="C extension not built")
@pytest.mark.parametrize("seed,n,big", [(1, 2500, False), (2, 2500, False), (3, 60, True)])
def test_c_equals_numpy_twin_on_random_cases(seed, n, big):
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(n):
        lg, params, hist = _random_case(rng, big)
        try:
            ref = reference.filter_probs(lg, params, hist)
        except ValueError as e:
            with pytest.raises(ValueError, match=str(e).split(" [")[0].split(":")[0]):
                filter_probs(lg, params, hist)
            continue
        got = filter_probs(lg, params, hist)
        assert np.array_equal(got > 0, ref > 0)
        assert np.abs(got - ref).max() < 1e-6
        s_seed = int(rng.integers(1 << 62))
        s, r = Sampler(params, s_seed, hist), Rng(s_seed)
        assert [s.sample(lg) for _ in range(4)] == [reference.sample(lg, params, hist, r) for _ in range(4)]
        checked += 1
    assert checked > n * 0.8


@pytest.mark.parametrize("fp", BOTH)
@pytest.mark.parametrize("logits,needle", [
    (np.array([0.0, np.nan], np.float32), "NaN"),
    (np.array([0.0, np.inf], np.float32), r"\+inf"),
    (np.array([-np.inf, -np.inf], np.float32), "all logits are -inf"),
    (np.array([], np.float32), "empty"),
    (np.zeros((2, 3), np.float32), "1-D"),
    (np.array([1, 2, 3]), "floating point"),
])
def test_bad_logits(fp, logits, needle):
    with pytest.raises(ValueError, match=needle):
        fp(logits, P())


def test_bad_logits_through_sampler():
    s = Sampler(P(), seed=0)
    for bad in (np.array([np.nan], np.float32), np.array([], np.float32), np.array([-np.inf], np.float32)):
        with pytest.raises(ValueError):
            s.sample(bad)
    assert s.sample(np.array([0.0, 1.0], np.float32)) in (0, 1)  # still usable


@pytest.mark.parametrize("fp", BOTH)
def test_other_dtypes_and_strides_are_converted(fp):
    base = np.random.default_rng(0).standard_normal(64)
    want = fp(base.astype(np.float32), P())
    np.testing.assert_allclose(fp(base, P()), want)  # float64 in
    strided = np.repeat(base.astype(np.float32), 2)[::2]  # non-contiguous view
    assert not strided.flags.c_contiguous
    np.testing.assert_allclose(fp(strided, P()), want)


@pytest.mark.parametrize("fp", BOTH)
def test_history_and_bias_outside_vocabulary(fp):
    lg = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="history"):
        fp(lg, P(repetition_penalty=1.1), [0, 4])
    with pytest.raises(ValueError, match="history"):
        fp(lg, P(), [-1])
    with pytest.raises(ValueError, match="logit_bias"):
        fp(lg, P(logit_bias={9: 1.0}))


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(min_p=-0.1), "min_p"),
    (dict(typical_p=0.0), "typical_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(penalty_last_n=-1), "penalty_last_n"), (dict(temperature=float("nan")), "temperature"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(frequency_penalty=float("inf")), "frequency_penalty"),
])
def test_invalid_params(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_invalid_seed():
    with pytest.raises(ValueError, match="seed"):
        Sampler(P(), seed="abc")


def test_logprobs():
    lg = logits_of([0.1, 0.2, 0.3, 0.4])
    r = Sampler(P(temperature=0), seed=0).sample_with_logprobs(lg, top_n=2)
    assert r.token == 3 and r.logprob == pytest.approx(math.log(0.4), abs=1e-6)
    assert [t for t, _ in r.top] == [3, 2] and r.top[1][1] == pytest.approx(math.log(0.3), abs=1e-6)
    assert logprobs(lg, P(), None, 0).logprob == pytest.approx(math.log(0.1), abs=1e-6)


def test_input_not_mutated():
    lg = np.array([1.0, 2.0, 3.0], np.float32)
    before = lg.copy()
    Sampler(SamplingParams(repetition_penalty=1.5, logit_bias={0: 2.0}), seed=0, history=[2, 2]).sample(lg)
    assert np.array_equal(lg, before)


@pytest.mark.skipif(BACKEND != "c", reason="C extension not built")
def test_c_logprobs_equal_twin():
    rng = np.random.default_rng(5)
    for _ in range(200):
        v = int(rng.integers(2, 5000))
        lg = (rng.standard_normal(v) * 3).astype(np.float32)
        lg[rng.random(v) < 0.1] = -np.inf
        lg[0] = 0.0
        params = SamplingParams(repetition_penalty=1.3, logit_bias={0: 1.0})
        hist = rng.integers(0, v, 20)
        got = Sampler(params, 1, hist).sample_with_logprobs(lg, top_n=5)
        ref = logprobs(lg, params, hist, got.token, 5)
        assert [t for t, _ in got.top] == [t for t, _ in ref.top]
        assert abs(got.logprob - ref.logprob) < 1e-9
        assert max(abs(a[1] - b[1]) for a, b in zip(got.top, ref.top)) < 1e-9


def test_reference_top_logprobs_take_the_lower_id_on_ties_and_leave_bans_out():
    """As the C sampler does; the numpy twin (an install without a compiler) gave ids 568-570 for 0-2
    of equal logits and listed banned tokens at -inf (hostile round)."""
    assert [t for t, _ in logprobs(np.zeros(600, np.float32), P(temperature=0), [], 0, top_n=3).top] == [0, 1, 2]
    top = logprobs(np.array([-np.inf, 1.0, 0.0], np.float32), P(temperature=0), [], 1, top_n=3).top
    assert [t for t, _ in top] == [1, 2] and top[0][1] == pytest.approx(-math.log1p(math.exp(-1)), abs=1e-6)
    assert logprobs(np.array([2.0, 1.0, 2.0, 2.0], np.float32), P(), [], 0, top_n=2).top[1][0] == 2


@pytest.mark.skipif(BACKEND != "c", reason="C extension not built")
def test_c_logprobs_equal_twin_on_ties_and_bans():
    rng = np.random.default_rng(7)
    for _ in range(300):
        v = int(rng.integers(2, 700))
        lg = rng.integers(-2, 3, v).astype(np.float32)  # few values: ties everywhere
        lg[rng.random(v) < rng.random()] = -np.inf
        lg[int(rng.integers(v))] = 1.0
        n = int(rng.integers(1, 12))
        got = Sampler(P(temperature=0), 1).sample_with_logprobs(lg, top_n=n)
        ref = logprobs(lg, P(temperature=0), [], got.token, n)
        assert [t for t, _ in got.top] == [t for t, _ in ref.top]
        assert all(abs(a[1] - b[1]) < 1e-9 for a, b in zip(got.top, ref.top))


@pytest.mark.skipif(BACKEND != "c", reason="C extension not built")
def test_c_logprobs_need_a_run():
    from edgeinfer.sampling import _csampler

    s = _csampler.Sampler(seed=0)  # keywords only; the defaults switch every step off
    with pytest.raises(RuntimeError, match="successful run"):
        s.logprobs(0, 3)
    s.run(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="outside"):
        s.logprobs(9, 3)
    lp, top = s.logprobs(1, 10)
    assert lp == pytest.approx(np.log(0.25)) and len(top) == 4


# ---- the sampler's own penalty history (history at construction, accept, reset)


@pytest.fixture(params=["default", "numpy"])
def make_sampler(request, monkeypatch):
    """Builds Samplers on the default back end, or on the numpy twin with the extension hidden."""
    def make(*args, **kw) -> Sampler:
        with monkeypatch.context() as m:
            if request.param == "numpy":
                m.setattr(sampling, "_csampler", None)
            s = Sampler(*args, **kw)
        assert s._c is None or request.param == "default"
        return s
    return make


@pytest.mark.parametrize("seed", [1, 2])
def test_owned_history_equals_twin_given_the_whole_history(make_sampler, seed):
    """history + accept() draw exactly what the twin draws from the whole history so far, for long
    enough that ids enter and leave the window (tokens drawn, and small ids accepted so they repeat)."""
    rng = np.random.default_rng(seed)
    for _ in range(16):
        v = int(rng.integers(2, 300))
        params = SamplingParams(
            temperature=float(rng.choice([0, 0.7, 1.5])), top_k=int(rng.choice([0, 5, 40])),
            top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0, 0.05])),
            repetition_penalty=float(rng.choice([1, 1.1, 0.8])), frequency_penalty=float(rng.choice([0, 0.5])),
            presence_penalty=float(rng.choice([0, 0.5, -0.3])), penalty_last_n=int(rng.choice([0, 1, 3, 64, 200])))
        prompt = rng.integers(0, v, int(rng.integers(0, 100))).tolist()
        s_seed = int(rng.integers(1 << 62))
        s, r, hist = make_sampler(params, s_seed, prompt), Rng(s_seed), list(prompt)
        for _ in range(100):
            lg = (rng.standard_normal(v) * 2).astype(np.float32)
            t = s.sample(lg)
            assert t == reference.sample(lg, params, hist, r)
            t = t if rng.random() < 0.6 else int(rng.integers(0, min(v, 6)))
            s.accept(t)
            hist.append(t)


def test_reset_restarts_the_history_not_the_rng(make_sampler):
    lg = (np.random.default_rng(3).standard_normal(10) * 2).astype(np.float32)
    params = P(repetition_penalty=1.5, presence_penalty=1.0, penalty_last_n=4)
    s, r = make_sampler(params, 7, [1, 2]), Rng(7)
    assert s.sample(lg) == reference.sample(lg, params, [1, 2], r)
    s.accept(3)
    s.reset([0, 0, 5, 6, 7, 8])
    assert [s.sample(lg) for _ in range(3)] == [reference.sample(lg, params, [0, 0, 5, 6, 7, 8], r) for _ in range(3)]
    s.reset()
    assert s.sample(lg) == reference.sample(lg, params, [], r)


@pytest.mark.parametrize("params", [P(), P(repetition_penalty=1.1, penalty_last_n=2)])
def test_history_ids_are_checked(make_sampler, params):
    lg = np.zeros(4, np.float32)
    for bad in ([-1], [2**31], [0, -5]):
        with pytest.raises(ValueError, match="history"):
            make_sampler(params, 0, bad)
    s = make_sampler(params, 0, [1])
    for bad in (-1, 2**31, 2**70):
        with pytest.raises(ValueError, match="history"):
            s.accept(bad)
    with pytest.raises(ValueError, match="history"):
        s.reset([1, -1])
    s.accept(3)
    assert s.sample(lg) in range(4)
    s.accept(4)  # outside this vocabulary: refused when sampling, as the twin refuses the whole history
    for _ in range(3):
        s.accept(0)  # even once 4 has left the penalty window
        with pytest.raises(ValueError, match="history"):
            s.sample(lg)
    assert s.sample(np.zeros(5, np.float32)) in range(5)
    s.reset([3])
    assert s.sample(lg) in range(4)


def test_sample_takes_no_history_argument():
    s = Sampler(P(), 0)
    with pytest.raises(TypeError):
        s.sample(np.zeros(4, np.float32), [1, 2])
    with pytest.raises(TypeError):
        s.sample_with_logprobs(np.zeros(4, np.float32), [1, 2])


@pytest.mark.skipif(BACKEND != "c", reason="C extension not built")
def test_c_boundary_takes_keywords():
    from edgeinfer.sampling import _csampler

    with pytest.raises(TypeError):
        _csampler.Sampler(0.8, 40)  # no positional parameters
    with pytest.raises(TypeError):
        _csampler.Sampler(temprature=0.8)
    with pytest.raises(ValueError, match="together"):
        _csampler.Sampler(bias_ids=np.array([1], np.int64))
    s = _csampler.Sampler(temperature=0.0, repetition_penalty=2.0, penalty_last_n=2,
                          bias_ids=np.array([0], np.int64), bias_values=np.array([-1.0]), seed=5)
    lg = np.array([3.5, 3.0, 1.0, 2.0], np.float32)
    with pytest.raises(TypeError):
        s.run(lg, None, True)  # probs_out and draw are keywords
    out = np.empty(4)
    assert s.run(lg, probs_out=out, draw=False) == -1 and out.tolist() == [0, 1, 0, 0]
    s.reset(history=np.array([1], np.int64))  # 3.0 / 2 = 1.5 < 2.0 (and 3.5 - 1.0 = 2.5)
    assert s.run(lg) == 0
    s.accept(0)  # 2.5 / 2 = 1.25; 1.5; 2.0 wins
    assert s.run(lg) == 3
    lp, top = s.logprobs(token=3, top_n=1)
    assert top[0][0] == 3 and lp == pytest.approx(top[0][1])

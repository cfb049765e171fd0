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
            Sampler(p, seed).sample(logits, history)
        return
    got = filter_probs(logits, p, history)
    assert np.array_equal(got > 0, ref > 0) and np.abs(got - ref).max() < 1e-6
    token = Sampler(p, seed).sample(logits, history)
    assert ref[token] > 0


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_raw_entry_point_rejects_bad_buffers(data):
    """The extension's own argument checks: wrong dtypes, ranks and sizes raise, never crash."""
    from edgeinfer.sampling import _csampler

    s = _csampler.Sampler(1.0, 0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0, np.zeros(0, np.int64), np.zeros(0), 0)
    dtype = data.draw(st.sampled_from([np.float32, np.float64, np.int64, np.int32, np.uint8]))
    shape = data.draw(st.sampled_from([(0,), (5,), (2, 3)]))
    logits = np.zeros(shape, dtype)
    hist = np.zeros(data.draw(st.integers(0, 3)), data.draw(st.sampled_from([np.int64, np.int32, np.float64])))
    out = data.draw(st.sampled_from([None, np.zeros(5), np.zeros(4), np.zeros(5, np.float32)]))
    try:
        s.run(logits, hist, out, True)
    except (ValueError, TypeError, BufferError):
        pass

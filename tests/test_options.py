"""GenerationOptions: declared once, validated at construction, the flat keyword form for API and CLI."""

from __future__ import annotations

import pytest

import edgeinfer
from edgeinfer.options import GenerationOptions, default, resolve
from edgeinfer.sampling import SamplingParams


def test_flat_keywords_split_between_request_and_sampler():
    o = GenerationOptions.from_kwargs(max_new_tokens=5, temperature=0, stop=".", top_k=3, seed=7)
    assert (o.max_new_tokens, o.stop, o.seed) == (5, (".",), 7)
    assert o.sampling == SamplingParams(temperature=0, top_k=3)


@pytest.mark.parametrize("kw,exc,needle", [
    (dict(temprature=0.5), TypeError, "temprature"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop=3), ValueError, "stop"),
    (dict(seed="1"), ValueError, "seed"),
    (dict(ignore_eos="yes"), ValueError, "ignore_eos"),
    (dict(top_p=2), ValueError, "top_p"),
    (dict(stop=["ok", "\ud800"]), ValueError, "lone surrogate"),  # was taken, and could never match
])
def test_bad_options_are_user_errors_of_the_old_types(kw, exc, needle):
    with pytest.raises(exc, match=needle) as e:
        GenerationOptions.from_kwargs(**kw)
    assert isinstance(e.value, edgeinfer.EdgeInferError)


def test_resolve_applies_overrides_on_top():
    base = GenerationOptions(max_new_tokens=3, sampling=SamplingParams(top_k=5))
    assert resolve(base, {}) is base
    o = resolve(base, {"temperature": 0})
    assert (o.max_new_tokens, o.sampling.top_k, o.sampling.temperature) == (3, 5, 0)
    assert resolve(None, {"top_k": 2}).sampling.top_k == 2
    with pytest.raises(TypeError):
        resolve({"top_k": 2}, {})


def test_defaults_are_declared_once():
    assert default("max_new_tokens") == GenerationOptions().max_new_tokens == 128
    assert default("temperature") == SamplingParams().temperature
    assert default("stop") == ()
    with pytest.raises(KeyError):
        default("nope")


def test_a_checked_logit_bias_cannot_be_changed_afterwards():
    """It was a writable dict: NaN put in after the check made every token <unk>, +inf blamed the
    model's weights (hostile round). The caller's own dict stays theirs."""
    mine = {5: 1.0}
    o = GenerationOptions.from_kwargs(logit_bias=mine, max_new_tokens=3)
    with pytest.raises(TypeError):
        o.sampling.logit_bias[5] = float("nan")
    mine[5] = 2.0
    assert o.sampling.logit_bias == {5: 1.0} and mine == {5: 2.0}
    p = SamplingParams(logit_bias={3: -1.0})
    from dataclasses import replace
    assert replace(p, top_k=2).logit_bias == {3: -1.0}  # a checked one passes the check again
    import copy
    import pickle
    assert pickle.loads(pickle.dumps(o)) == o and copy.deepcopy(o) == o  # options sent to another process

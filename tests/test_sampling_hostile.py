"""Sampling options and streams at their extremes, as a hostile caller gives them (found by a hostile
test of the generation API): each is refused naming the field, or draws what the plain reference
draws; never garbage, never a read outside the sampler's buffers, never a failure that looks like
a finish."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import edgeinfer
from edgeinfer import sampling
from edgeinfer.detokenize import StopFilter
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.sampling import Sampler, SamplingParams
from edgeinfer.sampling.penalties import PenaltyWindow


@pytest.fixture(scope="module")
def model():
    return edgeinfer.load()


@pytest.mark.parametrize("kw,needle", [
    (dict(repetition_penalty=1e-310), "repetition_penalty"),  # logit / 1e-310 = +inf
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(frequency_penalty=-1e308), "frequency_penalty"),
    (dict(presence_penalty=-1e308), "presence_penalty"),
    (dict(logit_bias={403: 1e308}), "logit_bias"),
    (dict(temperature=1e-310), "temperature"),  # 1 / 1e-310 = +inf: the C and numpy samplers drew garbage
    (dict(temperature=1e-9), "temperature"),
])
def test_values_that_could_push_a_logit_to_inf_are_refused(model, kw, needle):
    """Before, each passed the checks: the softmax turned NaN, min_p kept no candidate and the C
    sampler read cand[-1] (ASan: heap-buffer-overflow), giving token 0 on every step."""
    with pytest.raises(InvalidArgumentError, match=needle):
        model.generate("Once upon a time", max_new_tokens=3, seed=1, **kw)


def test_the_bounds_themselves_sample_as_the_reference_does(model):
    """The extreme values still allowed draw finite, sensible tokens, the same on the C sampler and
    its numpy twin (temperature 1e-6 is greedy in all but exact ties)."""
    greedy = model.generate("Once upon a time", max_new_tokens=20, temperature=0).token_ids
    assert model.generate("Once upon a time", max_new_tokens=20, temperature=1e-6, seed=3).token_ids == greedy
    rng = np.random.default_rng(0)
    for kw in (dict(repetition_penalty=1e-6), dict(repetition_penalty=1e6), dict(frequency_penalty=-1e6),
               dict(presence_penalty=1e6, logit_bias={5: 1e6, 7: -1e6, 9: -math.inf}), dict(temperature=1e-6)):
        params = SamplingParams(**kw)
        history = list(rng.integers(0, 512, 40))
        c, twin = Sampler(params, seed=7, history=history), None
        sampling_c = sampling._csampler
        try:
            sampling._csampler = None
            twin = Sampler(params, seed=7, history=history)
        finally:
            sampling._csampler = sampling_c
        for _ in range(20):
            logits = rng.standard_normal(512).astype(np.float32) * 4
            a, b = c.sample(logits), twin.sample(logits)
            assert a == b and 0 <= a < 512, kw
            c.accept(a)
            twin.accept(b)


@pytest.mark.skipif(sampling._csampler is None, reason="the C sampler is not built here")
def test_the_c_sampler_refuses_a_logit_pushed_to_inf_rather_than_read_outside_its_buffer():
    """Defence in depth: were a +inf to get through the bounds, the C sampler says so (its twin too)."""
    params = SamplingParams(repetition_penalty=1e-6)
    object.__setattr__(params, "repetition_penalty", 1e-310)  # past the bounds, as a bug elsewhere could
    logits = np.ones(64, np.float32)
    for make in (lambda: Sampler(params, seed=1, history=[3]),):
        s = make()
        with pytest.raises(ValueError, match=r"push a logit to \+inf"):
            s.sample(logits)


def test_logit_bias_is_copied_when_the_options_are_made(model):
    """The options kept the caller's dict: a NaN or +inf put in after the check was used unchecked."""
    bias = {10: 5.0}
    opts = edgeinfer.GenerationOptions.from_kwargs(logit_bias=bias, max_new_tokens=5, seed=1)
    before = model.generate("Once upon a time", opts).token_ids
    bias[10], bias["x"] = math.nan, 1.0
    assert opts.sampling.logit_bias == {10: 5.0}
    assert model.generate("Once upon a time", opts).token_ids == before


def test_banning_every_token_is_the_callers_error_not_the_model(model):
    """It was a ModelFormatError telling the user to verify intact weights."""
    with pytest.raises(InvalidArgumentError, match="logit_bias bans every token"):
        model.generate("Once", max_new_tokens=3, logit_bias={i: -math.inf for i in range(512)})


def test_a_huge_penalty_window_costs_what_it_holds_on_the_numpy_back_end():
    """2 * penalty_last_n int64s were allocated up front: 2**31 - 1 failed with a 32 GiB MemoryError."""
    w = PenaltyWindow(2**31 - 1, list(range(100)))
    assert w.buf.nbytes < 10_000
    ref = list(range(100))
    for t in range(5000):
        w.push(t)
        ref.append(t)
    assert list(w.view()) == ref
    for n in (1, 3, 64, 100):  # the bounded window still keeps the last n, however it grew
        w, ref = PenaltyWindow(n, [7] * 5), [7] * 5
        for t in range(400):
            w.push(t)
            ref.append(t)
            assert list(w.view()) == ref[-n:]
        assert w.buf.size <= 2 * n


def _old_stop_filter(stops, pieces):
    """The filter as it was (whole text searched each time), kept as the reference."""
    text, emitted, out = "", 0, []
    for new in pieces:
        text += new
        longest = max(map(len, stops))
        start = max(0, emitted - longest)
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        if hits:
            text = text[:min(hits)]
            out.append(text[emitted:])
            return out, text
        hold = 0
        for s in stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        end = max(emitted, len(text) - hold)
        out.append(text[emitted:end])
        emitted = end
    out.append(text[emitted:])
    return out, text


def test_the_stop_filter_keeps_only_a_bounded_tail_and_emits_what_it_did():
    """`self.text += piece` copied the whole reply every token: 44 us a token at 0.5 MB of text,
    385 us at 2 MB. The filter now holds at most the longest stop string; its output is the old one's."""
    rnd = random.Random(0)
    alphabet = "ab c\u00e9"
    for _ in range(400):
        stops = tuple("".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 5))) for _ in range(rnd.randint(1, 3)))
        pieces = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 4))) for _ in range(rnd.randint(1, 40))]
        f, got = StopFilter(stops), []
        for p in pieces:
            got.append(f.feed(p))
            assert len(f._held) < max(map(len, stops))
            if f.stopped:
                break
        if not f.stopped:
            got.append(f.flush())
        want, text = _old_stop_filter(stops, pieces)
        assert "".join(got) == "".join(want) and f.text == text, (stops, pieces)


def test_a_stream_that_failed_says_so_again_rather_than_end_as_if_finished(model):
    """Hostile API test: after a stream was refused (ContextBusyError), iterating it again yielded
    nothing and left `completion` None, as if it had finished without a word."""
    first = model.stream("Once upon a time", max_new_tokens=50, seed=1)
    next(first)
    second = model.stream("Once", max_new_tokens=5, seed=1)
    for _ in range(2):
        with pytest.raises(edgeinfer.ContextBusyError):
            next(second)
    first.close()
    with pytest.raises(edgeinfer.ContextBusyError):
        list(second)
    assert second.completion is None


def test_a_failed_stream_raises_its_error_again_whole(model, monkeypatch):
    """The review: re-raising a rebuilt error without __init__ lost a FileNotFoundError's filename
    and broke numpy's MemoryError; the error is copied as pickle copies it."""
    from edgeinfer import generation

    def failing(self):
        raise FileNotFoundError(2, "No such file or directory", "/nowhere/x")
        yield  # a generator, as steps() is

    monkeypatch.setattr(generation.Request, "steps", failing)
    g = model.stream("Once", max_new_tokens=3)
    for _ in range(2):
        with pytest.raises(FileNotFoundError) as e:
            next(g)
        assert e.value.filename == "/nowhere/x"


def test_numpy_numbers_are_taken_as_the_python_numbers_they_are(model):
    """A hostile round: np.float64 was taken (a float subclass) but np.float32 temperatures and np.int64
    token ids (what an app holding numpy arrays passes) were refused as "not a number". They are numbers:
    the options keep them as Python ints and floats, and give the same tokens as the plain values."""
    np_opts = edgeinfer.GenerationOptions.from_kwargs(
        temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float16(0.5), max_new_tokens=np.int32(8),
        seed=np.uint64(3), penalty_last_n=np.uint8(16), repetition_penalty=np.float32(1.25),
        logit_bias={np.int64(7): np.float32(1.5), np.uint16(9): -np.inf})
    plain = edgeinfer.GenerationOptions.from_kwargs(
        temperature=0.5, top_k=5, top_p=0.5, max_new_tokens=8, seed=3, penalty_last_n=16, repetition_penalty=1.25,
        logit_bias={7: 1.5, 9: -math.inf})
    assert np_opts == plain
    s = np_opts.sampling
    assert [type(v) for v in (s.temperature, s.top_k, s.top_p, np_opts.max_new_tokens, np_opts.seed)] == \
        [float, int, float, int, int]
    assert all(type(k) is int and type(v) is float for k, v in s.logit_bias.items())
    assert model.generate("Once", np_opts).token_ids == model.generate("Once", plain).token_ids
    for bad in (dict(temperature=np.float32("nan")), dict(top_p=np.float64("inf")), dict(top_k=np.True_),
                dict(temperature=True), dict(logit_bias={5: -10**400}), dict(logit_bias={np.float32(5): 1}),
                dict(seed=np.float64(3)), dict(max_new_tokens=np.int64(0))):
        with pytest.raises(InvalidArgumentError):
            edgeinfer.GenerationOptions.from_kwargs(**bad)


@pytest.mark.skipif(sampling._csampler is None, reason="the C sampler is not built here")
def test_two_threads_asking_one_sampler_for_logprobs_are_refused_never_given_the_other_s():
    """A hostile round: `logprobs` released the GIL without marking the sampler in use, so a draw on
    another thread rewrote the buffers it read (the other's token, NaN; a larger vocabulary reallocated
    them: a segfault), and `sample_with_logprobs` was two calls another thread's draw could come
    between. Each result is now its own logits' or the call is refused."""
    import threading
    import time

    vocab = 1 << 18
    rng = np.random.default_rng(0)
    logits = {}
    for want in (7, 9):
        logits[want] = rng.standard_normal(vocab).astype(np.float32)
        logits[want][want] = 50.0  # this thread's logits: its token dominates
    s = Sampler(SamplingParams(temperature=0), seed=0)
    stop, counts = threading.Event(), {"refused": 0, "wrong": 0, "ok": 0}

    def worker(want):
        while not stop.is_set():
            try:
                r = s.sample_with_logprobs(logits[want], top_n=3)
            except RuntimeError:
                counts["refused"] += 1
                continue
            right = r.token == want and r.top[0][0] == want and np.isfinite(r.logprob) and \
                all(np.isfinite(v) for _, v in r.top)
            counts["ok" if right else "wrong"] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in (7, 9)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    assert counts["wrong"] == 0 and counts["ok"] > 0 and counts["refused"] > 0, counts


def test_bad_arguments_are_refused_alike_by_both_back_ends_before_anything_is_drawn():
    """A hostile round: a 0-d float64 array was a one-token vocabulary to the C back end (the twin
    refused it), a history id past int64 raised OverflowError (the contract: ValueError), and a
    negative or huge top_n drew a token before failing in C while the twin returned ()."""
    for backend in ("c", "numpy"):
        if backend == "c" and sampling._csampler is None:
            continue
        saved = sampling._csampler
        if backend == "numpy":
            sampling._csampler = None
        try:
            s = Sampler(SamplingParams(temperature=1.0), seed=3)
            with pytest.raises(ValueError, match="1-D"):
                s.sample(np.float64(2.0))
            with pytest.raises(ValueError, match="1-D"):
                s.sample(np.array(2.0))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                Sampler(SamplingParams(), 1, history=[2 ** 63])
            with pytest.raises(ValueError, match="outside the vocabulary"):
                s.reset([5, 2 ** 64])
            with pytest.raises(ValueError, match="outside the vocabulary"):
                sampling.filter_probs(np.zeros(4, np.float32), SamplingParams(), history=[-2 ** 70])
            logits = np.array([0.0, 1.0, 2.0], np.float32)
            fresh = Sampler(SamplingParams(temperature=1.0), seed=3)
            with pytest.raises(ValueError, match="top_n"):
                s.sample_with_logprobs(logits, top_n=-1)  # refused before the draw: the RNG has not moved
            assert s.sample(logits) == fresh.sample(logits)
            r = s.sample_with_logprobs(logits, top_n=10 ** 30)
            assert [i for i, _ in r.top] == [2, 1, 0], backend
        finally:
            sampling._csampler = saved


def test_a_probability_below_e_to_the_minus_708_is_zero_on_both_back_ends():
    """A hostile round: the C exp gives 0 at or below -708 nats, numpy's a subnormal down to -745, so
    the twin kept (and drew, at temperature 1e6 with min_p 1e-320) a token the C chain dropped. The
    twin's softmax now has the same floor."""
    from edgeinfer.sampling import reference

    logits = np.array([0.0, -720.0, -707.0], np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    ref = reference.filter_probs(logits, params)
    assert ref[1] == 0.0 and ref[2] > 0.0
    if sampling._csampler is not None:
        got = sampling.filter_probs(logits, params)
        assert (got > 0).tolist() == (ref > 0).tolist()
        np.testing.assert_allclose(got, ref, rtol=1e-12)


@pytest.mark.skipif(sampling._csampler is None, reason="the C sampler is not built here")
def test_a_compiled_sampler_built_from_other_sources_is_not_used():
    """A review: a build from before `run` took top_n (a checkout changed since it was built) failed
    every request for logprobs with a TypeError. Its API version is checked: the numpy twin, and a
    warning that says to rebuild."""
    import subprocess
    import sys

    code = ("import sys, warnings\n"
            "import edgeinfer.sampling._csampler as c\n"
            "del c.API_VERSION\n"  # as a build from before the version was declared
            "sys.modules.pop('edgeinfer.sampling')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import edgeinfer.sampling as s\n"
            "print(s.BACKEND, [str(x.message) for x in w])\n"
            "print(s.Sampler(s.SamplingParams(temperature=0), 1).sample_with_logprobs([0.0, 1.0], top_n=1).token)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.startswith("numpy ") and "rebuild it" in first and second == "1"


def test_the_compiled_sampler_is_the_one_this_code_calls():
    """A review: were the two API versions to drift apart, the package would fall back to numpy and every
    test of the C sampler would skip, the suite green. A build that is there must be this code's."""
    import importlib

    try:
        c = importlib.import_module("edgeinfer.sampling._csampler")
    except ImportError:
        pytest.skip("the C sampler is not built here")
    assert getattr(c, "API_VERSION", None) == sampling.C_API_VERSION and sampling.BACKEND == "c"


def test_a_bool_is_not_a_token_or_a_count_of_logprobs():
    """A review: logprobs(token=True) indexed the logits with a boolean mask (a numpy error), and
    top_n=True was taken as 1."""
    logits = np.array([0.0, 1.0, 2.0], np.float32)
    with pytest.raises(TypeError, match="bool"):
        sampling.logprobs(logits, SamplingParams(), None, True)
    with pytest.raises(TypeError, match="bool"):
        sampling.logprobs(logits, SamplingParams(), None, 1, top_n=True)
    with pytest.raises(TypeError, match="bool"):
        Sampler(SamplingParams(temperature=0), 1).sample_with_logprobs(logits, top_n=True)
    assert sampling.logprobs(logits, SamplingParams(), None, 2, top_n=1).top[0][0] == 2

"""A model with a sliding window attends to its last W tokens only, as transformers masks it.

The fixture (tests/fixtures/window/mistral_window16, scripts/make_tiny_models.py) is a tiny Mistral
whose window of 16 binds within its 256 trained positions; its reference (scripts/
make_parity_fixtures.py, transformers 5.24, eager attention) has teacher-forced logits over 24 ids
and 32 greedy tokens after an 8-token prompt: both run past the window. Before the ring kept the
window exactly (a capacity of W - 1, no sinks, no call whose queries see more than W keys), the
default ring held W tokens and 4 sinks, and greedy decoding left transformers' tokens at the
window's edge.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import edgeinfer
from conftest import FIXTURES
from edgeinfer.engine import Engine, prefill_chunks
from edgeinfer.errors import EdgeInferError, InvalidArgumentError
from edgeinfer.evaluate import perplexity
from edgeinfer.session import DecoderSession

WINDOWED = FIXTURES / "window" / "mistral_window16"
WINDOW = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def folder(converted):
    return converted(WINDOWED, "fp32")


@pytest.fixture(scope="module")
def ref():
    return np.load(WINDOWED / "reference.npz")


@pytest.fixture(scope="module")
def model(folder):
    return edgeinfer.load(folder, threads=1)


def test_the_default_ring_holds_one_token_less_than_the_window_and_no_sinks(model):
    assert (model.capacity_tokens, model.n_sink) == (WINDOW - 1, 0)


@pytest.mark.parametrize("chunk", [64, 5, 1])
def test_teacher_forced_logits_past_the_window_match_transformers(folder, ref, chunk):
    eng = Engine(DecoderSession(folder), max_chunk=chunk)
    cache = eng.new_cache(WINDOW - 1, 0)
    ids = ref["input_ids"][0].tolist()
    assert len(ids) > WINDOW
    calls = prefill_chunks(len(ids), chunk, cache)
    rows = [eng.forward(cache, ids[a:b], all_logits=True).copy() for a, b in calls]
    assert np.abs(np.concatenate(rows) - ref["logits"]).max() < TOL
    assert cache.dropped == len(ids) - (WINDOW - 1)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_greedy_tokens_past_the_window_match_transformers(model, ref, speculative):
    prompt = ref["prompt_ids"].tolist()
    c = model.generate(prompt, max_new_tokens=32, temperature=0, ignore_eos=True, speculative=speculative)
    assert list(c.token_ids) == ref["greedy_ids"].tolist()


def test_a_prompt_longer_than_the_window_prefills_to_transformers_logits(model, ref):
    """The 24 ids in one generate: the prefill goes in calls that keep each query within the window,
    and the first sampled token is transformers' argmax after them."""
    ids = ref["input_ids"][0].tolist()
    c = model.generate(ids, max_new_tokens=1, temperature=0, ignore_eos=True)
    assert c.token_ids[0] == int(ref["logits"][-1].argmax())


def test_a_ring_that_would_see_past_the_window_is_refused(folder):
    with pytest.raises(InvalidArgumentError, match="sliding_window.*capacity_tokens=15"):
        edgeinfer.load(folder, capacity_tokens=WINDOW)
    with pytest.raises(InvalidArgumentError, match="n_sink=0"):
        edgeinfer.load(folder, n_sink=4)
    m = edgeinfer.load(folder, capacity_tokens=8, n_sink=0)  # a smaller ring is fine: it forgets sooner
    assert m.capacity_tokens == 8


def test_speculation_can_measure_its_costs_on_a_windowed_model(model):
    """A review found speculation's cost calibration built a ring of 64 slots with 4 sinks, which a
    windowed model refuses: the first draft raised, and `serve --speculative` would not start. (A
    draft needs free slots, so on this model speculation runs only while the ring of 15 fills.)"""
    ratios = model.engine.verify_ratios(4)
    assert len(ratios) >= 5 and ratios[0] == 1.0 and all(b >= a for a, b in zip(ratios, ratios[1:]))


def test_eval_scores_windows_the_model_sees_whole(folder, tmp_path):
    text = tmp_path / "eval.txt"
    line = "Once upon a time there was a little girl named Lily who loved to play in the park."
    text.write_text((line + "\n") * 3)
    r = perplexity(folder, text)
    n = len(edgeinfer.load(folder).tokenizer.encode(line, add_bos=True))
    assert n > WINDOW and r.n_windows == 3 * -(-n // WINDOW)  # each story cut into windows of 16
    with pytest.raises(EdgeInferError, match="sliding window of 16"):
        perplexity(folder, text, window=WINDOW + 1)


def _spec(folder, window, trained=256):
    from edgeinfer.manifest import read_manifest

    return dataclasses.replace(read_manifest(folder).arch, sliding_window=window, max_position_embeddings=trained)


def test_a_window_of_the_trained_length_or_more_never_binds(folder):
    """A query never attends over more than T tokens, window or not (a review: W == T took the sinks
    away and refused a ring of T)."""
    from edgeinfer.kv_cache import RingKVCache, binding_window

    assert binding_window(_spec(folder, 255)) == 255 and binding_window(_spec(folder, 256)) is None
    RingKVCache.check_geometry(_spec(folder, 256), 240, 4, 16)  # as a model without a window


def test_sinks_are_refused_only_in_a_ring_that_holds_the_whole_window(folder):
    from edgeinfer.kv_cache import RingKVCache

    with pytest.raises(InvalidArgumentError, match="n_sink=4"):
        RingKVCache.check_geometry(_spec(folder, 16), 15, 4, 16)
    RingKVCache.check_geometry(_spec(folder, 16), 10, 4, 16)  # a smaller ring forgets anyway: the caller's choice


def test_a_window_too_small_for_a_ring_is_a_bad_manifest(folder, tmp_path):
    import json
    import shutil

    from edgeinfer.errors import ModelFormatError

    bad = tmp_path / "m"
    shutil.copytree(folder, bad)
    m = json.loads((bad / "edgeinfer.json").read_text())
    m["architecture"]["sliding_window"] = 2
    (bad / "edgeinfer.json").write_text(json.dumps(m))
    with pytest.raises(ModelFormatError, match="sliding_window: must be null or at least 3"):
        edgeinfer.load(bad)


def test_bench_defaults_to_the_windowed_models_own_ring(folder):
    from edgeinfer.bench import BenchConfig, run_bench

    r = run_bench(BenchConfig(model=folder, prompt_tokens=8, gen_tokens=8, runs=1, threads=1))
    assert r["capacity_tokens"] == WINDOW - 1


def test_the_ring_span_script_runs_on_small_rings_and_windowed_models(folder, tmp_path):
    """A hostile round: scripts/ring_span_eval.py planned 256-token calls whatever the ring (a ring under
    256 was refused them: "a call takes 1..64 tokens"), took 4 sinks a windowed model refuses, and
    stopped at the first default capacity such a model refuses."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "ring_span_eval.py"
    for args in (["--capacity", "64"], ["-m", str(folder)]):
        out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        scored = [r for r in rows if "skipped" not in r]
        assert scored and all(np.isfinite(r["ppl_1_token_calls"]) and np.isfinite(r["ppl_prefill_calls"]) and
                              r["prefill_call_tokens"] == min(256, r["capacity"]) for r in scored), rows
        assert all("attends to its last 16 tokens" in r["skipped"] for r in rows if "skipped" in r)
    assert any("skipped" in r for r in rows)  # the windowed model's defaults past its window

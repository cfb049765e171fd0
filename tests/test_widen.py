"""Widened attention heads (converters/widen.py): `--attention auto|gqa` runs a head size that ONNX
Runtime's GroupQueryAttention does not take on wider heads that compute the same function, checked
against the same model converted without widening, through prefill, decode and the ring's re-basing."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_SRC, TINY
from edgeinfer.converters import convert
from edgeinfer.converters.families import spec_from_config
from edgeinfer.converters.hf_config import read_config
from edgeinfer.converters.widen import choose_kv_mode, wide_head_dim
from edgeinfer.errors import ConvertError, ModelFormatError
from edgeinfer.inspect import describe, parameter_count
from edgeinfer.kv_mode import GQA, STANDARD


def test_wide_head_dim():
    assert [wide_head_dim(d) for d in (8, 12, 16, 24, 40, 64, 80, 6)] == [16, 48, 16, 48, 80, 64, 80, 48]


def test_choose_kv_mode():
    stories = spec_from_config(read_config(STORIES_SRC))  # head size 8
    tiny = spec_from_config(read_config(TINY / "llama2_gqa_tied"))  # 16
    qk_normed = replace(spec_from_config(read_config(TINY / "qwen3_qknorm_tied")), head_dim=8)
    assert choose_kv_mode(stories, "auto") == (GQA, 16)  # widened: twice the head
    assert choose_kv_mode(stories, "standard") == (STANDARD, 8)
    assert choose_kv_mode(stories, "gqa") == (GQA, 16)
    assert choose_kv_mode(tiny, "auto") == (GQA, 16) and choose_kv_mode(tiny, "standard") == (STANDARD, 16)
    assert choose_kv_mode(replace(stories, head_dim=12), "auto") == (STANDARD, 12)  # 48 would be 4x the KV
    assert choose_kv_mode(replace(stories, head_dim=12), "gqa") == (GQA, 48)  # asked for: as wide as it takes
    assert choose_kv_mode(stories, "auto", widenable=False) == (STANDARD, 8)
    assert choose_kv_mode(qk_normed, "auto") == (STANDARD, 8)
    with pytest.raises(ConvertError, match="multiple of 16, this model has 8, and weights taken as a GGUF file"):
        choose_kv_mode(stories, "gqa", widenable=False)
    with pytest.raises(ConvertError, match="q/k-normed heads cannot be widened"):
        choose_kv_mode(qk_normed, "gqa")
    with pytest.raises(ConvertError, match="unknown attention 'flash'"):
        choose_kv_mode(stories, "flash")


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("widen")
    convert(STORIES_SRC, tmp / "standard", quant="fp32", attention="standard")
    convert(STORIES_SRC, tmp / "auto", quant="fp32")
    return tmp


def test_auto_widens_stories260K_and_the_manifest_says_so(stories):
    m = json.loads((stories / "auto" / "edgeinfer.json").read_text())
    assert m["interface"]["kv_mode"] == "gqa"
    assert m["architecture"]["head_dim"] == 16 and m["architecture"]["source_head_dim"] == 8
    s = json.loads((stories / "standard" / "edgeinfer.json").read_text())
    assert s["architecture"]["head_dim"] == 8 and "source_head_dim" not in s["architecture"]
    wide, narrow = (edgeinfer.load(stories / n).manifest.arch for n in ("auto", "standard"))
    assert parameter_count(wide) == parameter_count(narrow)  # the zeros are not parameters
    assert wide.kv_bytes_per_token == 2 * narrow.kv_bytes_per_token
    assert "4 KV heads x 16 (widened from 8 for GroupQueryAttention)" in describe(stories / "auto")
    assert "4 KV heads x 8, vocab" in describe(stories / "standard")


def test_a_manifest_whose_source_head_dim_does_not_divide_is_refused(stories, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(stories / "auto", bad)
    m = json.loads((bad / "edgeinfer.json").read_text())
    for value in (3, 16, 1, 32):  # odd, not smaller, too small for a RoPE pair, not a divisor
        m["architecture"]["source_head_dim"] = value
        (bad / "edgeinfer.json").write_text(json.dumps(m))
        with pytest.raises(ModelFormatError, match="source_head_dim"):
            edgeinfer.load(bad)
    shutil.rmtree(bad)
    shutil.copytree(stories / "standard", bad)  # widened heads claimed by a standard-ops graph
    m = json.loads((bad / "edgeinfer.json").read_text())
    m["architecture"]["source_head_dim"] = 4
    (bad / "edgeinfer.json").write_text(json.dumps(m))
    with pytest.raises(ModelFormatError, match="widened heads are for GroupQueryAttention"):
        edgeinfer.load(bad)


def _greedy_logits(model, ids, steps):
    """Logits of a prompt and of `steps` greedy decode steps through the model's own ring."""
    cache = model.new_cache()
    out = [model.engine.prefill(cache, ids).copy()]
    for _ in range(steps):
        out.append(model.engine.decode_one(cache, int(out[-1].argmax())).copy())
    return np.stack(out)


def test_widened_stories_decodes_like_the_narrow_one_through_wraps_and_rebases(stories):
    """A 24-slot ring with 4 sinks: 120 greedy steps wrap it five times and re-base its positions."""
    a = edgeinfer.load(stories / "standard", capacity_tokens=24, n_sink=4)
    b = edgeinfer.load(stories / "auto", capacity_tokens=24, n_sink=4)
    ids = a.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    la, lb = _greedy_logits(a, ids, 120), _greedy_logits(b, ids, 120)
    assert (la.argmax(-1) == lb.argmax(-1)).all()
    assert np.abs(la - lb).max() < 1e-4


@pytest.mark.parametrize("name", ["llama_linear_rope_bias", "qwen2_bias_tied", "llama3_mqa_untied_bf16"])
def test_widening_keeps_biases_rope_scaling_and_mqa(tmp_path, monkeypatch, name):
    """Heads of 16 (which need no widening) forced to 32: q/k/v and o biases, linear RoPE scaling and
    one KV head keep the function; compared with the same model converted at its own head size."""
    conv = sys.modules["edgeinfer.converters.convert"]  # the module (the package exports the function by its name)
    convert(TINY / name, tmp_path / "own", quant="fp32")
    monkeypatch.setattr(conv, "choose_kv_mode", lambda spec, attention, widenable=True: (GQA, 2 * spec.head_dim))
    convert(TINY / name, tmp_path / "wide", quant="fp32")
    a = edgeinfer.load(tmp_path / "own", capacity_tokens=20, n_sink=2)
    b = edgeinfer.load(tmp_path / "wide", capacity_tokens=20, n_sink=2)
    assert b.manifest.arch.head_dim == 32 and b.manifest.arch.source_head_dim == 16
    ids = np.random.default_rng(0).integers(3, a.manifest.arch.vocab_size, 12).tolist()
    la, lb = _greedy_logits(a, ids, 60), _greedy_logits(b, ids, 60)
    assert np.abs(la - lb).max() < 1e-4 * max(1.0, np.abs(la).max())


def test_bundled_int8_widened_keeps_the_model_on_both_paths():
    """The bundled int8 model (heads widened by the converter): perplexity on eval.txt within 0.2 % of
    fp32's 5.6836 on the prefill and the decode path (measured 5.6875 and 5.6858; the standard-ops
    int8 conversion: 5.6890 and 5.6923), and greedy text that equals fp32's on a golden prompt."""
    from conftest import STORIES_FIX
    from edgeinfer.evaluate import perplexity
    from edgeinfer.model import default_model_path

    for path in ("prefill", "decode"):
        r = perplexity(default_model_path(), STORIES_FIX / "eval.txt", path=path)
        assert abs(r.perplexity / 5.6836 - 1) < 0.002, (path, r.perplexity)
    m = edgeinfer.load()
    assert m.engine.mode is GQA and m.manifest.arch.source_head_dim == 8
    golden = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    assert m.generate("Once upon a time", max_new_tokens=30, temperature=0).text.startswith(golden[16:])

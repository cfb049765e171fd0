"""`convert --target cuda` and float16's range: a model whose activations pass 65504 (float16's
largest value) on the calibration text is refused for that target, one within 2x of it is noted,
and a graph that overflows anyway names float16 when its logits come out NaN. Before the check, a
model with weights a few hundred times too large converted with rc 0 and every prompt then failed
with "its weights are broken" (a hostile round)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import edgeinfer
from conftest import TINY, write_safetensors
from edgeinfer.converters import convert, cuda_graph
from edgeinfer.converters.calibration import Calibration, calibration_ids, plan
from edgeinfer.converters.convert import default_scheme
from edgeinfer.converters.families import spec_from_config
from edgeinfer.converters.hf_config import read_config
from edgeinfer.converters.safetensors_io import Checkpoint
from edgeinfer.errors import ConvertError, ModelFormatError

SRC = TINY / "llama2_gqa_tied"


def scaled(tmp_path, factor: float):
    """SRC with its gate and up projections times `factor`: silu(gate) * up grows as factor**2."""
    out = tmp_path / f"x{factor:g}"
    shutil.copytree(SRC, out)
    ck = Checkpoint(SRC)
    t = {k: ck.read(k) for k in ck.tensors}
    for k in t:
        if ".mlp.gate_proj." in k or ".mlp.up_proj." in k:
            t[k] = (t[k].astype(np.float32) * factor).astype(t[k].dtype)
    write_safetensors(out / "model.safetensors", t)
    return out


def peak_of(src):
    """Calibration.peak over the whole float forward of src (every layer, as build_decoder steps it)."""
    from edgeinfer.tokenizer import Tokenizer
    from edgeinfer.converters.hf_tokenizer import tokenizer_info

    spec = spec_from_config(read_config(src))
    ck = Checkpoint(src)
    w = lambda name: ck.read(name).astype(np.float32)  # noqa: E731
    ids = calibration_ids(Tokenizer(src, tokenizer_info(src, spec, lambda m: None)), spec)
    cal = Calibration(spec, ids, w("model.embed_tokens.weight")[ids])
    for i in range(spec.num_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        cal.attention_input(w(f"model.layers.{i}.input_layernorm.weight"))
        cal.attention(np.concatenate([w(f"{a}.{p}_proj.weight") for p in "qkv"]), None, None, None)
        cal.mlp_input(w(f"{a}.o_proj.weight"), None, w(f"model.layers.{i}.post_attention_layernorm.weight"))
        act = cal.mlp_act(np.concatenate([w(f"{m}.gate_proj.weight"), w(f"{m}.up_proj.weight")]))
        cal.end_layer(w(f"{m}.down_proj.weight"))
    cal.head_input(w("model.norm.weight"))
    return cal.peak, float(np.abs(act).max())


def test_the_peak_is_the_largest_activation_and_says_where(tmp_path):
    """With gate and up 100x, the largest activation is the last layer's silu(gate) * up (computed
    here as the forward's own output, the input down_proj meets), and past float16's range."""
    peak, last_act = peak_of(scaled(tmp_path, 100))
    assert peak.where == "layer 1's silu(gate) * up" and peak.abs_value == last_act > cuda_graph.FP16_MAX
    plain, _ = peak_of(SRC)
    assert 0 < plain.abs_value < 100


@pytest.mark.parametrize("kw", [dict(quant="int4"), dict(quant="fp16"),
                                dict(scheme=default_scheme("int4", 32, recipe="asym"))],
                         ids=["int4-gptq", "fp16", "int4-asym"])
def test_activations_past_float16_are_refused_for_cuda_only(tmp_path, kw):
    """Refused for cuda, whatever the recipe (fp16 and asym calibrate one row for the check alone),
    with nothing left at the destination; the same model converts and runs for the cpu."""
    src = scaled(tmp_path, 100)
    with pytest.raises(ConvertError, match=r"float16.*reach 1\.\d+e\+05 \(layer \d's silu\(gate\) \* up\).*--target cpu"):
        convert(src, tmp_path / "cuda", target="cuda", **kw)
    assert not (tmp_path / "cuda").exists()
    convert(src, tmp_path / "cpu", **kw)
    assert edgeinfer.load(tmp_path / "cpu").generate("hello world", max_new_tokens=5).text  # NaN logits raise


def test_the_refusal_is_not_false_the_graph_overflows(tmp_path, monkeypatch):
    """With the check switched off, the refused model's cuda graph gives NaN logits on ONNX Runtime,
    and the error then names float16 as a cause (it said only "its weights are broken")."""
    monkeypatch.setattr(cuda_graph, "check_range", lambda peak, log: None)
    out = tmp_path / "cuda"
    convert(scaled(tmp_path, 100), out, target="cuda")
    model = edgeinfer.load(out)
    with pytest.raises(ModelFormatError, match=r"logits contain NaN.*overflow float16.*--target cpu"):
        model.generate("hello world", max_new_tokens=3)


def test_activations_near_float16s_range_are_noted_and_converted(tmp_path):
    """Within 2x of 65504 (here about 36,000): converted, with a note naming the place and the risk;
    a plain model gets no note."""
    notes = []
    convert(scaled(tmp_path, 55), tmp_path / "near", target="cuda", log=notes.append)
    said = [n for n in notes if "within 2x of float16" in n]
    assert len(said) == 1 and "layer 1's silu(gate) * up" in said[0], notes
    assert edgeinfer.load(tmp_path / "near").generate("hello world", max_new_tokens=3) is not None
    notes.clear()
    convert(SRC, tmp_path / "plain", target="cuda", log=notes.append)
    assert not [n for n in notes if "float16" in n and "reach" in n], notes


def test_plan_calibrates_one_row_for_the_check_and_only_for_cuda(tmp_path):
    """asym needs no calibration: for the cpu none is run, for cuda one row (the check's alone), and
    the recipe stays asym; gptq runs its whole text as before."""
    from edgeinfer.converters.hf_tokenizer import tokenizer_info

    spec = spec_from_config(read_config(SRC))
    info = tokenizer_info(SRC, spec, lambda m: None)
    asym, gptq = default_scheme("int4", 32, recipe="asym"), default_scheme("int4", 32)
    assert plan(asym, SRC, info, spec)[0] is None
    ids, scheme = plan(asym, SRC, info, spec, check_fp16=True)
    assert ids.shape[0] == 1 and ids.size > 0 and scheme.recipe == "asym"
    full, scheme = plan(gptq, SRC, info, spec, check_fp16=True)
    assert full.shape[0] > 1 and scheme.recipe == "gptq"
    assert np.array_equal(full, plan(gptq, SRC, info, spec)[0])

"""`--via optimum` on damaged or unusual Hugging Face folders (a hostile round): each is refused with
one line, or converted into the checkpoint's own model, never a wrong one.

The checks that need no torch run everywhere; the end-to-end ones skip without the extra (`pip
install 'edgeinfer[optimum]'`), as tests/test_optimum.py's converting tests do.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT
from edgeinfer.arch import RopeSpec
from edgeinfer.converters.optimum_export import _check_loaded, _weights_read, spec_from_hf_config
from edgeinfer.errors import ConvertError

CFG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
       "vocab_size": 512, "intermediate_size": 96}


@pytest.mark.parametrize("cfg,match", [
    ({**CFG, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2},
     "use_sliding_window=true is not supported for qwen2"),
    ({**CFG, "model_type": "qwen3", "use_sliding_window": True, "sliding_window": 32},
     "use_sliding_window=true is not supported for qwen3"),
    ({**CFG, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 32},
     "layer_types mixes full_attention, sliding_attention"),
])
def test_a_window_that_binds_some_layers_only_is_refused(cfg, match):
    """Qwen2's window binds the layers from max_window_layers on; the ring capped every layer at the
    window (greedy text left transformers' at token 0 with no layer windowed, at token 4 with one)."""
    with pytest.raises(ConvertError, match=match):
        spec_from_hf_config(cfg)
    plain = spec_from_hf_config({**CFG, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32})
    assert plain.sliding_window is None


def test_only_the_weight_files_transformers_reads_are_hashed(tmp_path):
    """Every file the weight patterns matched was hashed into the manifest: an unused pytorch_model.bin
    linked to /dev/zero beside model.safetensors hashed for ever (and a FIFO blocked)."""
    src = tmp_path / "m"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"x")
    os.symlink("/dev/zero", src / "pytorch_model.bin")
    os.mkfifo(src / "consolidated.safetensors")
    assert _weights_read(src) == ["model.safetensors"]
    (src / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _weights_read(src) == ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"]
    (src / "model.safetensors.index.json").unlink()
    (src / "pytorch_model.bin").unlink()
    (src / "pytorch_model.bin").write_bytes(b"x")
    assert _weights_read(src) == ["pytorch_model.bin"]


class _Tensor:
    """What `_check_loaded` reads of a torch tensor."""

    def __init__(self, a):
        self.a = np.asarray(a, dtype=np.float32)

    def detach(self):
        return self

    def float(self):
        return self

    def numpy(self):
        return self.a


def _model(inv_freq, scaling=1.0):
    return SimpleNamespace(model=SimpleNamespace(rotary_emb=SimpleNamespace(inv_freq=_Tensor(inv_freq),
                                                                            attention_scaling=scaling)))


@pytest.mark.parametrize("info,model_rope,match", [
    ({"missing_keys": ["lm_head.weight"]}, None, r"lacks weights the model needs \(1: lm_head.weight\)"),
    ({"unexpected_keys": [f"model.layers.2.w{i}" for i in range(5)]}, None,
     r"holds weights the model does not use \(5: model.layers.2.w0, model.layers.2.w1, model.layers.2.w2, \.\.\.\)"),
    ({"mismatched_keys": [("model.embed_tokens.weight", (512, 64), (600, 64))]}, None, "of other shapes"),
    ({}, RopeSpec(theta=10000.0), "the RoPE transformers .* builds from it differs"),  # rope_parameters ignored
    ({}, "scaled", "the RoPE transformers .* builds from it differs"),
])
def test_a_model_other_than_the_checkpoint_and_config_say_is_refused(info, model_rope, match):
    """transformers fills missing weights with random values, drops unused ones, and (4.x) ignores a
    transformers-5 rope_parameters block: each converted with rc 0 into a wrong model (perplexity 537.8
    for an untied head left out, logits 21 off for a theta of 500000 exported as 10000)."""
    spec = spec_from_hf_config({**CFG, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    ours = spec.rope.inv_freq(spec.head_dim)
    model = _model(ours, 2.0 if model_rope == "scaled" else 1.0)
    if isinstance(model_rope, RopeSpec):
        model = _model(model_rope.inv_freq(spec.head_dim))
    with pytest.raises(ConvertError, match=match):
        _check_loaded(ROOT, model, info, spec, "4.57.6")
    _check_loaded(ROOT, _model(ours), {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}, spec, "4.57.6")


@pytest.mark.parametrize("files,match", [
    (("model.onnx", "config.json"), "holds an ONNX graph .* give the Hugging Face model folder it was exported from"),
    (("pytorch_model.bin",), r"its weights are PyTorch \.bin files, which the native builder does not read"),
])
def test_a_folder_without_safetensors_says_what_it_holds(tmp_path, files, match):
    """An optimum-cli export given as the source, or a .bin-only checkpoint, was told only that no
    *.safetensors file was there."""
    from edgeinfer.converters import convert

    src = tmp_path / "src"
    src.mkdir()
    for name in files:
        (src / name).write_bytes(b"x")
    (src / "config.json").write_text(json.dumps({**CFG, "architectures": ["LlamaForCausalLM"]}))
    shutil.copyfile(ROOT / "models" / "stories260K" / "tokenizer.model", src / "tokenizer.model")
    with pytest.raises(ConvertError, match=match):
        convert(src, tmp_path / "out")


# --- end to end, with the extra installed ---

def _source(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("optimum.exporters.onnx")
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_optimum_fixtures import make_source

    return make_source("phi3", tmp_path / "src")


def _convert(src, dst):
    from edgeinfer.converters.optimum_export import convert_via_optimum

    return convert_via_optimum(src, dst, quant="fp32", log=lambda m: None)


def _rewrite_weights(src, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    save_file(change(tensors), str(src / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("damage,match", [
    ("missing", "lacks weights the model needs"),
    ("extra", "holds weights the model does not use"),
    ("rope_parameters", "the RoPE transformers .* builds from it differs"),
    ("tokenizer", "the source's tokenizer cannot be used"),
    ("shape", "size mismatch"),
])
def test_a_damaged_source_is_refused_end_to_end(tmp_path, damage, match):
    src = _source(tmp_path)
    if damage == "missing":
        _rewrite_weights(src, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.down_proj" not in k})
    elif damage == "extra":
        _rewrite_weights(src, lambda t: {**t, "model.layers.9.mlp.down_proj.weight": t["model.norm.weight"]})
    elif damage == "shape":
        _rewrite_weights(src, lambda t: {**t, "model.norm.weight": np.concatenate([t["model.norm.weight"]] * 2)})
    elif damage == "rope_parameters":
        cfg = json.loads((src / "config.json").read_text())
        cfg.pop("rope_theta", None)
        (src / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 500000.0}}))
    else:
        (src / "tokenizer.model").write_bytes((src / "tokenizer.model").read_bytes()[:100])
    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match=match) as e:
        _convert(src, dst)
    assert "\n" not in str(e.value) and not dst.exists()


def test_an_unused_weight_file_is_not_read(tmp_path):
    """A pytorch_model.bin linked to /dev/zero beside model.safetensors: converted in seconds, as the
    native builder does (it was hashed for ever after the export)."""
    src = _source(tmp_path)
    os.symlink("/dev/zero", src / "pytorch_model.bin")
    t0 = time.perf_counter()
    m = _convert(src, tmp_path / "out")
    assert time.perf_counter() - t0 < 300 and "pytorch_model.bin" not in m.source
    assert set(m.source) >= {"config.json", "model.safetensors", "tokenizer.model"}


def test_a_bin_checkpoint_transformers_cannot_read_keeps_its_words(tmp_path):
    """A review: any OSError with a pytorch_model*.bin in the folder was replaced by "its weights are
    PyTorch .bin files, which the native builder does not read (--via optimum reads them)", on the
    --via optimum path, for a git-lfs pointer or a corrupt file (transformers' own words say which)."""
    src = _source(tmp_path)
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    with pytest.raises(ConvertError, match="transformers cannot load") as e:
        _convert(src, tmp_path / "out")
    assert "native builder" not in str(e.value) and "\n" not in str(e.value)

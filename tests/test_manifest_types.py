"""The typed manifest and the KV mode: sections read once into frozen dataclasses (a bad field is a
ModelFormatError naming it), older manifests' `kv_io`/`kv_layout` still read, and one KVMode object
deciding the layout for the converter, the ring and the Engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_SRC, TINY, write_manifest
from edgeinfer.kv_mode import GQA, MODES, STANDARD, kv_mode
from edgeinfer.manifest import CHECKSUM_KEY, MANIFEST_FILE, manifest_checksum, read_manifest
from edgeinfer.model import default_model_path


def copy_with(src, dst, edit):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".edgeinfer-verified.json*"))
    m = json.loads((dst / MANIFEST_FILE).read_text())
    edit(m)
    write_manifest(dst, m)
    return dst


def test_manifest_round_trips():
    folder = default_model_path()
    m = read_manifest(folder)
    on_disk = json.loads((folder / MANIFEST_FILE).read_text())
    assert m.to_json() == {k: v for k, v in on_disk.items() if k != CHECKSUM_KEY}  # write adds the checksum
    assert m.checksum == on_disk[CHECKSUM_KEY] == manifest_checksum(on_disk)
    assert m.interface.kv_mode is GQA and m.quantization.weights == "int8"  # heads widened 8 -> 16
    assert (m.arch.head_dim, m.arch.source_head_dim) == (16, 8)
    assert m.tokenizer.kind == "sentencepiece" and m.tokenizer.add_bos and m.tokenizer.eos_token_ids == (2,)


@pytest.mark.parametrize("src,mode", [(STORIES_SRC, STANDARD), (TINY / "llama2_gqa_tied", GQA)])
def test_older_manifest_with_kv_io_reads_the_same(converted, tmp_path, src, mode):
    """Folders converted before `kv_mode` name the mode by kv_io and kv_layout: same mode, same tokens."""
    folder = converted(src, "fp32", attention=mode.name)
    legacy = {GQA: ("shared_buffer", "BNSH"), STANDARD: ("runtime_append", "BSNH")}[mode]

    def old(m):
        i = m["interface"]
        m["interface"] = {"version": i["version"], "kv_io": legacy[0], "kv_layout": legacy[1],
                          **{k: v for k, v in i.items() if k not in ("version", "kv_mode")}}

    older = copy_with(folder, tmp_path / "older", old)
    assert read_manifest(older).interface == read_manifest(folder).interface
    a, b = edgeinfer.load(folder), edgeinfer.load(older)
    assert a.engine.mode is b.engine.mode is mode
    ids = [1, 5, 9, 13, 40, 77]
    assert a.generate(ids, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids == \
        b.generate(ids, max_new_tokens=12, temperature=0, ignore_eos=True).token_ids


def _set(path, value):
    def edit(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return edit


@pytest.mark.parametrize("path,value,needle", [
    (("tokenizer", "add_bos"), "yes", "tokenizer.add_bos: expected bool"),
    (("tokenizer", "kind"), "wordpiece", "tokenizer.kind: unknown 'wordpiece'"),
    (("tokenizer", "eos_token_ids"), [2, "x"], "tokenizer.eos_token_ids[1]"),
    (("tokenizer", "bos_token_id"), 100000, "tokenizer.bos_token_id: 100000 is outside the vocabulary [0, 512)"),
    (("tokenizer", "bos_token_id"), -1, "tokenizer.bos_token_id: -1 is outside"),  # eval scored a wrong figure
    (("quantization", "block_size"), 48, "quantization.block_size"),
    (("quantization", "weights"), "int3", "quantization.weights"),
    (("architecture", "head_dim"), "8", "architecture.head_dim: expected int"),
    (("architecture", "num_layers"), KeyError, "architecture.num_layers: missing"),
    (("architecture", "rope", "type"), "yarn", "architecture.rope.type"),
    # values convert refuses, read back from a hand-edited manifest (a hostile round: theta 1e308 loaded, with
    # numpy's overflow warning, and the text went astray after ~12 tokens)
    (("architecture", "rope", "theta"), 1e308, "architecture.rope.theta: 1e+308 is 0 or infinite in float32"),
    (("architecture", "rms_norm_eps"), 1e-300, "architecture.rms_norm_eps: 1e-300 is 0 or infinite in float32"),
    (("architecture", "rope", "theta"), 1e-44, "architecture.rope: RoPE's angles are not finite"),
    (("architecture", "max_position_embeddings"), 1, "architecture.max_position_embeddings: must be at least 2"),
    (("interface", "kv_mode"), "flash", "interface.kv_mode: unknown KV mode 'flash'"),
    (("interface", "kv_mode"), "standard", "source_head_dim: widened heads are for GroupQueryAttention"),
    (("interface", "kv_dtype"), "bfloat16", "interface.kv_dtype"),
    (("interface", "version"), 3, "interface.version: 3: this edgeinfer runs interface versions 1, 2: upgrade"),
    (("interface", "version"), 1, "interface.inputs.cos_cache: not an input of interface version 1"),
    (("interface", "inputs", "past_key", "shape"), ["batch", 4, "max_sequence", 8], "interface.inputs.past_key"),
    (("architecture", "source_head_dim"), 5, "architecture.source_head_dim: 5 is not an even head size"),
    (("interface", "outputs", "extra"), {"dtype": "float32", "shape": []}, "interface.outputs.extra"),
    (("default_capacity_tokens"), "512", "default_capacity_tokens: expected int"),
    (("quantization",), KeyError, "bad field quantization: missing"),
])
def test_bad_field_is_named(tmp_path, path, value, needle):
    path = path if isinstance(path, tuple) else (path,)
    folder = copy_with(default_model_path(), tmp_path / "m", _set(path, value))
    with pytest.raises(edgeinfer.ModelFormatError, match="corrupted") as e:
        read_manifest(folder)
    assert needle in str(e.value)


def test_inconsistent_legacy_kv_layout_is_refused(tmp_path):
    def edit(m):
        m["interface"].pop("kv_mode")
        m["interface"].update(kv_io="runtime_append", kv_layout="BNSH")

    with pytest.raises(edgeinfer.ModelFormatError, match="interface.kv_layout"):
        read_manifest(copy_with(default_model_path(), tmp_path / "m", edit))


def test_kv_modes():
    assert [m.name for m in MODES] == ["gqa", "standard"] and kv_mode("gqa") is GQA
    with pytest.raises(ValueError, match="unknown KV mode"):
        kv_mode("shared_buffer")  # an old manifest name, not a mode name
    assert GQA.cache_shape(10, 2, 16) == (1, 2, 10, 16) and STANDARD.cache_shape(10, 2, 16) == (1, 10, 2, 16)
    assert GQA.takes(64) and not GQA.takes(8) and STANDARD.takes(8)
    for mode in MODES:  # the bookkeeping's view is the graph's array, slots first
        a = np.arange(np.prod(mode.cache_shape(5, 2, 4)), dtype=np.float32).reshape(mode.cache_shape(5, 2, 4))
        view = mode.slot_major(a)
        assert view.shape == (5, 2, 4) and np.shares_memory(view, a)
        view[3] = -1
        assert (np.take(a, 3, axis=mode.seq_axis) == -1).all()


def test_runtime_reads_the_manifest_without_the_converter():
    code = ("import sys, edgeinfer; edgeinfer.load(); "
            "print(sorted(m for m in sys.modules if m.startswith(('edgeinfer.converters', 'onnx.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""The `edgeinfer.json` manifest: what `convert` writes and `load` reads.

Versioned: `FORMAT_VERSION` changes when a reader of the old version would misread the folder.
A manifest from a newer version is refused with a clear error rather than half understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.arch import ArchSpec
from edgeinfer.errors import ModelFormatError

FORMAT_VERSION = 1
MANIFEST_FILE = "edgeinfer.json"
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class IONames:
    """Names of the graph's per-layer KV tensors (interface version 1)."""

    num_layers: int

    def past_key(self, i: int) -> str:
        return f"past_key_values.{i}.key"

    def past_value(self, i: int) -> str:
        return f"past_key_values.{i}.value"

    def present_key(self, i: int) -> str:
        return f"present.{i}.key"

    def present_value(self, i: int) -> str:
        return f"present.{i}.value"


def io_names(num_layers: int) -> IONames:
    return IONames(num_layers)


def graph_interface(spec: ArchSpec, kv_io: str = "runtime_append") -> dict:
    """The manifest's description of the graph's inputs and outputs.

    kv_io "runtime_append": past = the valid slots [B, T, Hkv, Dh] (BSNH), present = the S new rows;
    "shared_buffer": past and present are the same ring buffer [B, Hkv, M, Dh] (BNSH) that
    GroupQueryAttention appends to in place, with seqlens_k and total_sequence_length inputs.
    """
    n = io_names(spec.num_layers)
    if kv_io == "shared_buffer":
        kv = new = ["batch", spec.num_kv_heads, "max_sequence", spec.head_dim]
    else:
        kv = ["batch", "past_sequence", spec.num_kv_heads, spec.head_dim]
        new = ["batch", "sequence", spec.num_kv_heads, spec.head_dim]
    extra = {"seqlens_k": {"dtype": "int32", "shape": ["batch"]},
             "total_sequence_length": {"dtype": "int32", "shape": []}} if kv_io == "shared_buffer" else {}
    return {
        "version": 1,
        "kv_io": kv_io,
        "kv_layout": "BNSH" if kv_io == "shared_buffer" else "BSNH",
        "kv_dtype": "float32",
        "inputs": {
            "input_ids": {"dtype": "int64", "shape": ["batch", "sequence"]},
            "position_ids": {"dtype": "int64", "shape": ["batch", "sequence"]},
            "logits_index": {"dtype": "int64", "shape": ["num_logits"]},
            **extra,
            "past_key": {"name": n.past_key(0).replace(".0.", ".{i}."), "dtype": "float32", "shape": kv},
            "past_value": {"name": n.past_value(0).replace(".0.", ".{i}."), "dtype": "float32", "shape": kv},
        },
        "outputs": {
            "logits": {"dtype": "float32", "shape": ["batch", "num_logits", spec.vocab_size]},
            "present_key": {"name": n.present_key(0).replace(".0.", ".{i}."), "dtype": "float32", "shape": new},
            "present_value": {"name": n.present_value(0).replace(".0.", ".{i}."), "dtype": "float32", "shape": new},
        },
    }


@dataclass(frozen=True)
class Manifest:
    arch: ArchSpec
    quantization: dict
    target: str
    flavour: str
    interface: dict
    tokenizer: dict
    default_capacity_tokens: int
    files: dict = field(default_factory=dict)  # outputs: name -> {"bytes", "sha256"}
    source: dict = field(default_factory=dict)  # inputs: name -> sha256
    converter_version: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict:
        return {
            "format_version": self.format_version,
            "converter_version": self.converter_version,
            "target": self.target,
            "flavour": self.flavour,
            "architecture": self.arch.to_json(),
            "quantization": self.quantization,
            "interface": self.interface,
            "tokenizer": self.tokenizer,
            "default_capacity_tokens": self.default_capacity_tokens,
            "files": self.files,
            "source": self.source,
        }

    def write(self, folder: Path) -> None:
        (Path(folder) / MANIFEST_FILE).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def read_manifest(folder: Path) -> Manifest:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFormatError(f"model folder not found: {folder}")
    path = folder / MANIFEST_FILE
    if not path.exists():
        raise ModelFormatError(f"{folder} is not an edgeinfer model folder (no {MANIFEST_FILE}); "
                               "convert a Hugging Face folder with `edgeinfer convert`")
    try:
        d = json.loads(path.read_text())
        version = d["format_version"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise ModelFormatError(f"{path} is corrupted (not a valid manifest)") from None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ModelFormatError(f"{path} has format version {version}; this edgeinfer reads up to "
                               f"{FORMAT_VERSION}: upgrade edgeinfer")
    try:
        m = Manifest(
            arch=ArchSpec.from_json(d["architecture"]), quantization=d["quantization"], target=d["target"],
            flavour=d["flavour"], interface=d["interface"], tokenizer=d["tokenizer"],
            default_capacity_tokens=int(d["default_capacity_tokens"]), files=d.get("files", {}),
            source=d.get("source", {}), converter_version=d.get("converter_version", ""), format_version=version,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(f"{path} is corrupted (bad field: {e})") from None
    if not (folder / MODEL_FILE).exists():
        raise ModelFormatError(f"{folder} lacks {MODEL_FILE}")
    return m

"""The graph's interface, the manifest's `interface` section: the inputs and outputs of the graph a
folder holds, in the KV mode it was built for (`graph_interface` for the fused graphs,
`portable_interface` for the portable one), and the names of the per-layer KV tensors (`io_names`).
`Interface.from_json` checks a manifest's section against what this runtime binds.

The graph interface has its own version (`interface.version`). Version 2: a fused graph takes RoPE's
cos/sin table from the host (`cos_cache`, `sin_cache`: a row per position, indexed by
`position_ids`) instead of eighteen nodes that computed this call's rows. Version 1 folders load as
they are (the runtime binds no table); an edgeinfer that runs only version 1 refuses a version 2
folder by name ("upgrade edgeinfer").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from edgeinfer.arch import ArchSpec
from edgeinfer.fields import FieldError, json_fields
from edgeinfer.kv_mode import LEGACY_KEYS, OPTIMUM, PORTABLE, KVMode, from_interface
from edgeinfer.portable import PortableInfo, logit_chunks

INTERFACE_VERSION = 2  # 2: fused graphs take RoPE's cos/sin rows from the host (1: position_ids, tables in the graph)
INTERFACE_VERSIONS = (1, 2)  # what this runtime reads
ROPE_COS, ROPE_SIN = "cos_cache", "sin_cache"
KV_DTYPE = "float32"  # the ring's element type (the fused and portable graphs)
KV_DTYPES = ("float32", "float16")  # float16: the cuda target's graph (fp16 activations)


@dataclass(frozen=True)
class IONames:
    """Names of the graph's per-layer KV tensors (every interface version)."""

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


@dataclass(frozen=True)
class TensorDesc:
    """One graph input or output: element type and dims (ints, or names of symbolic dims); `name` is
    the per-layer template ("past_key_values.{i}.key") for the KV tensors, else None (the key is the name)."""

    dtype: str
    shape: tuple[int | str, ...]
    name: str | None = None

    def to_json(self) -> dict:
        return {**({"name": self.name} if self.name is not None else {}), "dtype": self.dtype,
                "shape": list(self.shape)}


@dataclass(frozen=True)
class Interface:
    """The graph's interface: its version, KV mode, KV element type, and every input and output."""

    version: int
    kv_mode: KVMode
    kv_dtype: str
    inputs: Mapping[str, TensorDesc]
    outputs: Mapping[str, TensorDesc]

    def to_json(self) -> dict:
        return {"version": self.version, "kv_mode": self.kv_mode.name, "kv_dtype": self.kv_dtype,
                "inputs": {k: t.to_json() for k, t in self.inputs.items()},
                "outputs": {k: t.to_json() for k, t in self.outputs.items()}}

    @classmethod
    def from_json(cls, d: dict, spec: ArchSpec, where: str = "interface",
                  portable: PortableInfo | None = None) -> "Interface":
        """Checked against what this runtime binds for `spec` in the mode it names (FieldError naming
        the first field that differs; the portable mode against `portable`'s geometry). Reads older
        manifests' `kv_io`/`kv_layout` (see the module doc)."""
        if not isinstance(d, dict):
            raise FieldError(where, f"expected an object, got {d!r}")
        try:
            mode = from_interface(d)
        except ValueError as e:
            raise FieldError(f"{where}.{e.args[0]}", e.args[1]) from None
        kw = json_fields(cls, d, where, skip=("kv_mode", "inputs", "outputs", *LEGACY_KEYS))
        version = kw["version"]
        if version not in INTERFACE_VERSIONS:
            newer = ": upgrade edgeinfer" if version > INTERFACE_VERSION else ""
            raise FieldError(f"{where}.version", f"{version}: this edgeinfer runs interface versions "
                             f"{', '.join(map(str, INTERFACE_VERSIONS))}{newer}")
        if spec.source_head_dim is not None and not mode.in_place:
            raise FieldError("architecture.source_head_dim", f"widened heads are for GroupQueryAttention, but the "
                             f"graph's KV mode is {mode.name!r}")
        float32_only = portable is not None or mode is OPTIMUM
        if kw["kv_dtype"] not in KV_DTYPES or (float32_only and kw["kv_dtype"] != KV_DTYPE):
            raise FieldError(f"{where}.kv_dtype", f"{kw['kv_dtype']!r}: this edgeinfer's KV cache is one of "
                             f"{', '.join(KV_DTYPES)} (portable and Optimum graphs: {KV_DTYPE})")
        if (mode is PORTABLE) != (portable is not None):
            raise FieldError(f"{where}.kv_mode", f"{mode.name!r} does not match the flavour (portable graphs have "
                             "the portable KV mode and a portable section, fused ones neither)")
        want = (graph_interface(spec, mode, kw["kv_dtype"], version) if portable is None
                else portable_interface(spec, portable, version))
        for part in ("inputs", "outputs"):
            got, expected = d.get(part), getattr(want, part)
            if not isinstance(got, dict):
                raise FieldError(f"{where}.{part}", "missing" if got is None else f"expected an object, got {got!r}")
            for key in (*expected, *(k for k in got if k not in expected)):
                if key not in got:
                    raise FieldError(f"{where}.{part}.{key}", "missing")
                if key not in expected:
                    raise FieldError(f"{where}.{part}.{key}", f"not an {part[:-1]} of interface version {version}")
                t = TensorDesc(**json_fields(TensorDesc, got[key], f"{where}.{part}.{key}"))
                if t != expected[key]:
                    raise FieldError(f"{where}.{part}.{key}", f"{t.to_json()} does not match the {mode.name} KV mode "
                                     f"and the architecture ({expected[key].to_json()})")
        return want


def host_rope(version: int, mode: KVMode) -> bool:
    """Whether a fused graph of this interface version and KV mode takes RoPE's cos/sin table from
    the host (cos_cache, sin_cache): version 2 on, except an Optimum export, whose graph computes
    RoPE itself."""
    return version >= 2 and mode is not OPTIMUM


def graph_interface(spec: ArchSpec, mode: KVMode, kv_dtype: str = KV_DTYPE, version: int | None = None) -> Interface:
    """The interface of the graph `build_decoder` makes for `spec` in KV mode `mode` (docs/architecture.md,
    "Graph interface"): ids, positions, RoPE's table (version 2, not Optimum graphs) and logits_index
    in, logits out, the mode's extra inputs, and per layer the past and present K/V in the mode's dims."""
    if version is None:  # what the converter writes: the oldest version that describes the graph, so
        version = INTERFACE_VERSION if mode is not OPTIMUM else 1  # older readers still open Optimum folders
    n = io_names(spec.num_layers)
    past = tuple(mode.past_dims(spec.num_kv_heads, spec.head_dim))
    new = tuple(mode.present_dims(spec.num_kv_heads, spec.head_dim))

    def layer(name: str) -> str:
        return name.replace(".0.", ".{i}.")

    half = spec.head_dim // 2  # version 2: cos/sin of every position's angles, a row per position up to beyond both
    table = {ROPE_COS: TensorDesc(kv_dtype, ("rope_rows", half)),  # the largest position and the total length
             ROPE_SIN: TensorDesc(kv_dtype, ("rope_rows", half))} if host_rope(version, mode) else {}
    inputs = {
        "input_ids": TensorDesc("int64", ("batch", "sequence")),
        "position_ids": TensorDesc("int64", ("batch", "sequence")),
        **table,
        "logits_index": TensorDesc("int64", ("num_logits",)),
        **{e.name: TensorDesc(e.dtype, tuple(e.dims)) for e in mode.extra_inputs},
        "past_key": TensorDesc(kv_dtype, past, layer(n.past_key(0))),
        "past_value": TensorDesc(kv_dtype, past, layer(n.past_value(0))),
    }
    outputs = {
        "logits": TensorDesc("float32", ("batch", "num_logits", spec.vocab_size)),
        "present_key": TensorDesc(kv_dtype, new, layer(n.present_key(0))),
        "present_value": TensorDesc(kv_dtype, new, layer(n.present_value(0))),
    }
    return Interface(version, mode, kv_dtype, MappingProxyType(inputs), MappingProxyType(outputs))


def portable_interface(spec: ArchSpec, info: PortableInfo, version: int = 1) -> Interface:
    """The interface of the portable decode graph (converters/portable.py; the prefill graph is the
    same with P for 1): static shapes, host-computed inputs, the logits in chunks. The same in every
    interface version; written as version 1, so that older readers open it."""
    n, Hkv, Dh, R = io_names(spec.num_layers), spec.num_kv_heads, spec.head_dim, info.ring_rows
    g = spec.num_heads // Hkv

    def layer(name: str) -> str:
        return name.replace(".0.", ".{i}.")

    inputs = {"inputs_embeds": TensorDesc("float32", (1, 1, spec.hidden_size)),
              "rope_cos": TensorDesc("float32", (1, 1, 1, Dh)), "rope_sin": TensorDesc("float32", (1, 1, 1, Dh)),
              "attention_mask": TensorDesc("float32", (1, 1, g, R + 1)),
              "logits_select": TensorDesc("float32", (1, 1, 1)),
              "past_key": TensorDesc(KV_DTYPE, (1, Hkv, R, Dh), layer(n.past_key(0))),
              "past_value": TensorDesc(KV_DTYPE, (1, Hkv, R, Dh), layer(n.past_value(0)))}
    outputs = {f"logits.{c}": TensorDesc("float32", (1, 1, hi - lo))
               for c, (lo, hi) in enumerate(logit_chunks(spec.vocab_size))}
    outputs.update(present_key=TensorDesc(KV_DTYPE, (1, Hkv, 1, Dh), layer(n.present_key(0))),
                   present_value=TensorDesc(KV_DTYPE, (1, Hkv, 1, Dh), layer(n.present_value(0))))
    return Interface(version, PORTABLE, KV_DTYPE, MappingProxyType(inputs), MappingProxyType(outputs))

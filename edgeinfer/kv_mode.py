"""The KV mode: how the graph's KV inputs and outputs are laid out and bound, as one object.

The converter chooses a mode (`edgeinfer convert --attention auto|gqa|standard`), builds the graph
for it and writes its name into the manifest's interface; the runtime reads it back and sizes the
ring, binds the graph and describes the folder from the same `KVMode`. This module is the only one
that knows the modes' names (and the names older manifests used); everything else asks the object:

    name            "gqa" | "standard" (`--attention`), "portable", "optimum": the one name, in the manifest
    layout          axis order of the cache arrays the graph reads and writes (B batch, N KV heads,
                    S sequence, H head dim); `cache_shape(rows, Hkv, Dh)` is one layer's array
    seq_axis        where S sits in that layout
    past_dims / present_dims   the graph's symbolic KV dims (ONNX value infos, manifest shapes)
    extra_inputs    graph inputs the mode adds (GroupQueryAttention's seqlens_k, total_sequence_length;
                    Optimum's attention_mask)
    in_place        past and present are one buffer the graph appends to in place (the whole ring
                    is bound once); otherwise past is the block of valid slots and present the S new
                    rows, which the runtime binds right after them
    head_multiple   the head size must be a multiple of this (ONNX Runtime's CPU GroupQueryAttention: 16)

The modes:

    gqa        GroupQueryAttention reads and appends in place: past = present = the ring buffer
               [1, Hkv, C + S_max, Dh]; head size a multiple of 16
    standard   standard ONNX ops: past = the valid slots [1, T, Hkv, Dh], present = this call's S
               rows [1, S, Hkv, Dh]; any head size
    portable   the portable flavour's (converters/portable.py): past = the whole ring [1, Hkv, R, Dh]
               with a fixed R, present = this call's rows [1, Hkv, S, Dh], copied in by the runtime
    optimum    a graph exported by Hugging Face Optimum (converters/optimum_export.py), rewired to the
               standard mode's KV exchange (converters/optimum_graph.py): past = the valid slots
               [1, T, Hkv, Dh], present = this call's S rows [1, S, Hkv, Dh], plus Optimum's
               attention_mask [1, T + S] (all ones: the ring holds only valid slots)

`MODES` is the converter's order of preference (`--attention auto` takes gqa when the head size
allows it or when widening the heads at most doubles them, converters/widen.py; else standard).
`from_interface` reads a manifest's interface section: `kv_mode` by name, or an older manifest's
`kv_io` ("shared_buffer" -> gqa, "runtime_append" -> standard; its `kv_layout` must then agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
ATTENTION_MASK = "attention_mask"  # the optimum mode's: 1 for every slot attended to (past and new)
KV_AXES = "BNSH"  # the letters of a layout: batch, KV heads, sequence, head dim


class ExtraInput(NamedTuple):
    """A graph input a mode adds: its name, element type (numpy/ONNX name) and symbolic dims."""

    name: str
    dtype: str
    dims: tuple


@dataclass(frozen=True)
class KVMode:
    name: str
    layout: str  # a permutation of KV_AXES starting with B
    in_place: bool  # past and present are the same buffer (the graph appends to it)
    head_multiple: int = 1  # the head size must be a multiple of this
    extra_inputs: tuple[ExtraInput, ...] = ()
    past_sequence: str = "past_sequence"  # symbolic name of the past's sequence dim
    present_sequence: str = "sequence"  # symbolic name of the present's sequence dim
    description: str = ""  # one line for `edgeinfer inspect`
    host_writes: bool = False  # the runtime copies the graph's new rows into the ring (portable graphs)

    def __post_init__(self) -> None:
        if sorted(self.layout) != sorted(KV_AXES) or self.layout[0] != "B":
            raise ValueError(f"KV mode {self.name}: layout {self.layout!r} is not a permutation of {KV_AXES} "
                             "with the batch first")
        if not self.in_place and not self.host_writes and self.seq_axis != 1:
            # the runtime binds the first T rows and the S rows after them as blocks of one array
            raise ValueError(f"KV mode {self.name}: a mode that is not in place needs the sequence axis first "
                             "after the batch")

    @property
    def seq_axis(self) -> int:
        return self.layout.index("S")

    def _arrange(self, batch, heads, seq, head_dim) -> tuple:
        dims = {"B": batch, "N": heads, "S": seq, "H": head_dim}
        return tuple(dims[a] for a in self.layout)

    def cache_shape(self, rows: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One layer's K (or V) array holding `rows` slots, batch 1, in this mode's layout."""
        return self._arrange(1, num_kv_heads, rows, head_dim)

    def past_dims(self, num_kv_heads: int, head_dim: int) -> list:
        """The graph's past_key_values.{i}.key/value dims (symbolic batch and sequence)."""
        return list(self._arrange("batch", num_kv_heads, self.past_sequence, head_dim))

    def present_dims(self, num_kv_heads: int, head_dim: int) -> list:
        """The graph's present.{i}.key/value dims (symbolic batch and sequence)."""
        return list(self._arrange("batch", num_kv_heads, self.present_sequence, head_dim))

    def slot_major(self, a):
        """A view [rows, Hkv, Dh] of one layer's cache array (batch 1), slots first, whatever the
        layout: the same memory, so the ring's bookkeeping has one layout and the graph its own."""
        return a.transpose([self.layout.index(x) for x in "BSNH"])[0]

    def takes(self, head_dim: int) -> bool:
        """Whether a model with this head size can run in this mode."""
        return head_dim % self.head_multiple == 0


GQA = KVMode(
    name="gqa", layout="BNSH", in_place=True, head_multiple=16,
    extra_inputs=(ExtraInput(SEQLENS_K, "int32", ("batch",)), ExtraInput(TOTAL_SEQUENCE_LENGTH, "int32", ())),
    past_sequence="max_sequence", present_sequence="max_sequence",
    description="GroupQueryAttention appending in place to the KV ring")
STANDARD = KVMode(
    name="standard", layout="BSNH", in_place=False,
    description="standard ops over the valid KV slots")

PORTABLE = KVMode(
    name="portable", layout="BNSH", in_place=False, host_writes=True,
    past_sequence="ring_rows", present_sequence="sequence",
    description="standard ops over the whole fixed-size ring; the runtime writes the new rows")

OPTIMUM = KVMode(
    name="optimum", layout="BSNH", in_place=False,
    extra_inputs=(ExtraInput(ATTENTION_MASK, "int64", ("batch", "total_sequence")),),
    description="Optimum's exported graph: standard ops over the valid KV slots, an all-ones attention mask")

MODES = (GQA, STANDARD)  # order of preference for `--attention auto` (the fused flavour's modes)
NAMES = tuple(m.name for m in MODES)
_BY_NAME = {m.name: m for m in (*MODES, PORTABLE, OPTIMUM)}
_LEGACY_KV_IO = {"shared_buffer": GQA, "runtime_append": STANDARD}  # manifests before `kv_mode`


def kv_mode(name: str) -> KVMode:
    """The mode called `name`; ValueError for another name."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV mode {name!r} (choose from {', '.join(NAMES)})") from None


def from_interface(d: dict) -> KVMode:
    """The mode a manifest's interface section names: `kv_mode`, or an older manifest's `kv_io`
    (with `kv_layout`). A missing, unknown or inconsistent one raises ValueError(field, problem)."""
    if "kv_mode" in d:
        try:
            return kv_mode(d["kv_mode"])
        except ValueError as e:
            raise ValueError("kv_mode", str(e)) from None
    if "kv_io" not in d:
        raise ValueError("kv_mode", "missing")
    mode = _LEGACY_KV_IO.get(d["kv_io"]) if isinstance(d["kv_io"], str) else None
    if mode is None:
        raise ValueError("kv_io", f"unknown {d['kv_io']!r} (choose from {', '.join(_LEGACY_KV_IO)})")
    if d.get("kv_layout", mode.layout) != mode.layout:
        raise ValueError("kv_layout", f"{d['kv_layout']!r} does not match kv_io {d['kv_io']!r} ({mode.layout})")
    return mode


LEGACY_KEYS = ("kv_io", "kv_layout")  # interface keys only older manifests have (read by from_interface)

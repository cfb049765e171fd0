"""The architecture spec shared by the converter (which writes it) and the runtime (which reads it).

`ArchSpec` is the part of the `edgeinfer.json` manifest that describes the network: everything
needed to size the KV cache and to interpret the graph, and nothing about how it was quantized.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from edgeinfer.fields import FieldError, json_fields

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies, float32 [head_dim // 2], computed in float32 as transformers does."""
        f32 = np.float32
        inv = f32(1.0) / (f32(self.theta) ** (np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)))
        if self.type == "linear":
            return (inv / f32(self.factor)).astype(f32)
        if self.type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = f32(2 * math.pi) / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(f32)
        return inv


# the most each size may be: far past any model this runtime is for, and small enough that what a
# manifest's sizes make (the graph inputs named per layer, the ring, RoPE's table) cannot take the
# machine's memory before a check fails (an edited num_layers of 10**12 ran a load out of memory)
SIZE_LIMITS = {"hidden_size": 1 << 20, "intermediate_size": 1 << 22, "num_layers": 4096, "num_heads": 4096,
               "num_kv_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 27}


@dataclass(frozen=True)
class ArchSpec:
    family: str  # registry key: "llama", "mistral", "qwen2", "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2, Llama attention_bias)
    o_bias: bool = False  # o_proj has a bias (Llama attention_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # each query attends to the last W tokens: the ring keeps it so
    # (`kv_cache.binding_window`)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    source_head_dim: int | None = None  # the checkpoint's head size, when the converter widened the heads
    # to head_dim for GroupQueryAttention (converters/widen.py: the same function); None: not widened

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V bytes one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    def to_json(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.source_head_dim is None:  # written only when the heads were widened
            del d["source_head_dim"]
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "architecture") -> "ArchSpec":
        """Checked (FieldError naming a bad field): types, positive sizes, a known rope type."""
        spec = cls(**json_fields(cls, d, where))
        check_sizes(spec, where)
        if spec.max_position_embeddings < 2:  # the least ring is 2 tokens (1 passed, then every load was refused
            # with advice to use "a capacity of at most 1")
            raise FieldError(f"{where}.max_position_embeddings", "must be at least 2, got 1")
        s = spec.source_head_dim
        if s is not None and (s < 2 or s % 2 or s >= spec.head_dim or spec.head_dim % s):
            raise FieldError(f"{where}.source_head_dim", f"{s} is not an even head size that divides head_dim "
                             f"{spec.head_dim} and is smaller")
        if spec.sliding_window is not None and spec.sliding_window < 3:  # its ring holds W - 1 >= 2 tokens
            raise FieldError(f"{where}.sliding_window", f"must be null or at least 3, got {spec.sliding_window}")
        if spec.num_heads % spec.num_kv_heads:
            raise FieldError(f"{where}.num_kv_heads", f"{spec.num_kv_heads} does not divide num_heads {spec.num_heads}")
        if spec.rope.type not in SUPPORTED_ROPE_TYPES:
            raise FieldError(f"{where}.rope.type", f"unknown {spec.rope.type!r} (choose from "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)})")
        r = spec.rope
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if getattr(r, name) <= 0:
                raise FieldError(f"{where}.rope.{name}", f"must be positive, got {getattr(r, name)}")
        # as convert refuses them (a hand-edited theta of 1e308 loaded, with numpy's overflow warning and other text)
        for name, v in (("rope.theta", r.theta), ("rope.factor", r.factor), ("rms_norm_eps", spec.rms_norm_eps)):
            if not positive_in_float32(v):
                raise FieldError(f"{where}.{name}", f"{v!r:.40} is 0 or infinite in float32, where the graph "
                                 "holds it")
        if not rope_angles_finite(spec):
            raise FieldError(f"{where}.rope", f"RoPE's angles are not finite in float32 by position "
                             f"{spec.max_position_embeddings - 1}")
        if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:  # the smoothing divides by their gap
            raise FieldError(f"{where}.rope.high_freq_factor", f"{r.high_freq_factor} must exceed low_freq_factor "
                             f"{r.low_freq_factor}")
        return spec


def check_sizes(spec: ArchSpec, where: str) -> None:
    """FieldError unless every size is within SIZE_LIMITS (and llama3 RoPE's original context within
    max_position_embeddings' limit): checked before anything is made from them (RoPE's table is
    head_dim / 2 long: a head_dim of 2**29 took 3 GB and 30 s before its refusal, 2**63 a traceback)."""
    for name, most in SIZE_LIMITS.items():
        if not 1 <= getattr(spec, name) <= most:
            raise FieldError(f"{where}.{name}", f"must be in 1..{most:,}, got {getattr(spec, name):,}")
    most, old = SIZE_LIMITS["max_position_embeddings"], spec.rope.original_max_position_embeddings
    if not 0 < old <= most:
        shown = str(old) if len(str(old)) <= 40 else f"a number of {len(str(old))} digits"
        raise FieldError(f"{where}.rope.original_max_position_embeddings", f"must be in 1..{most:,}, got {shown}")


def positive_in_float32(v: float) -> bool:
    """Whether `v` is finite and positive and stays so in float32 (1e-300 is 0 there, 1e308 infinity)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return False
    with np.errstate(over="ignore", under="ignore"):
        held = np.float32(v)
    return bool(0 < held < np.inf)


def rope_angles_finite(spec: ArchSpec) -> bool:
    """Whether RoPE's inverse frequencies, and the angles at the last trained position, are finite in
    float32 (a theta or scaling factor of 1e-37 passes `positive_in_float32` but not this)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        inv = spec.rope.inv_freq(spec.head_dim)
        last = np.float32(spec.max_position_embeddings - 1) * inv
    return bool(np.isfinite(inv).all() and np.isfinite(last).all())

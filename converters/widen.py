"""The KV mode a conversion takes (`choose_kv_mode`, `--attention`), and wider attention heads that
compute the same function, so that a small head size runs on GroupQueryAttention.

ONNX Runtime's CPU GroupQueryAttention needs a head size that is a multiple of 16. A model whose
head size Dh is not (stories260K: 8) would otherwise take the standard-ops KV mode, whose graph has
about ten attention nodes per layer and whose runtime rebinds every layer's KV arrays on every
decode step. Widening each head to W = lcm(Dh, 16) keeps the model's function exactly (in real
arithmetic; at fp32 the logits agree to ~2e-5; quantized, o_proj's blocks hold zeros beside the real
inputs, so their rounding differs: stories260K int8 scores 5.6875 against the narrow int8's 5.6890)
and lets it take the in-place mode: measured 2.5x the decode tokens/s on stories260K int8 (docs/benchmarks.md, "Decode step"), for W / Dh times the KV memory per token.

How. Rotate-half RoPE pairs dim j with dim j + Dh/2 at frequency theta^(-2j/Dh). With m = W / Dh,
dim pair m*j (with m*j + W/2) of the wider head has frequency theta^(-2mj/W) = theta^(-2j/Dh): the
original pair's (the same float32 arithmetic in `RopeSpec.inv_freq`, and rope scaling maps each
frequency on its own). So original dims j and j + Dh/2 go to m*j and m*j + W/2; every other new dim
is zero in q, k and v (their rows of the projections and biases are zero, and zero columns of o_proj
read them), so attention scores are unchanged once q is scaled by sqrt(W / Dh) to undo the softmax's
1/sqrt(W). Keys of the zero dims stay zero under any rotation, so the ring's re-basing holds too.

Not for q/k-normed heads (Qwen3: a per-head RMSNorm over W dims would change its mean) nor for GGUF
blocks kept exactly (o_proj's input dim would get zero columns inside its blocks).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.decoder import ATTENTION_CHOICES, TensorSource
from edgeinfer.errors import ConvertError
from edgeinfer.kv_mode import GQA, MODES, KVMode, kv_mode

GQA_HEAD_MULTIPLE = GQA.head_multiple
AUTO_MAX_WIDENING = 2  # `--attention auto` widens heads at most this many times (the KV memory grows as much)


def wide_head_dim(head_dim: int, multiple: int = GQA_HEAD_MULTIPLE) -> int:
    """The smallest head size that is a multiple of both `head_dim` and `multiple`."""
    return head_dim * multiple // math.gcd(head_dim, multiple)


def widened_spec(spec: ArchSpec, width: int) -> ArchSpec:
    """`spec` with heads of `width`, remembering the checkpoint's head size in `source_head_dim`."""
    return replace(spec, head_dim=width, source_head_dim=spec.head_dim)


class WidenedSource(TensorSource):
    """A `TensorSource` whose attention projections are read at the checkpoint's head size and handed
    out widened (`spec` is the checkpoint's, `width` the wider head size; see the module doc)."""

    def __init__(self, ckpt, spec: ArchSpec, width: int):
        if width % spec.head_dim or width <= spec.head_dim:
            raise ConvertError(f"width {width} is not a larger multiple of head size {spec.head_dim}")
        if spec.qk_norm:
            raise ConvertError("heads with a q/k norm cannot be widened exactly")
        super().__init__(ckpt, keep=False)
        self.spec, self.width = spec, width
        dh, m = spec.head_dim, width // spec.head_dim
        half = dh // 2
        self.where = np.concatenate([m * np.arange(half), width // 2 + m * np.arange(half)])  # old dim j -> new

    def _rows(self, w: np.ndarray, heads: int, scale: float) -> np.ndarray:
        """[heads * Dh, ...] -> [heads * W, ...]: each head's rows placed at `where`, zeros between."""
        out = np.zeros((heads, self.width) + w.shape[1:], np.float32)
        out[:, self.where] = w.reshape((heads, self.spec.head_dim) + w.shape[1:]) * np.float32(scale)
        return out.reshape((heads * self.width,) + w.shape[1:])

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        s, dh = self.spec, self.spec.head_dim
        kind = next((k for k in ("q_proj", "k_proj", "v_proj", "o_proj") if name.endswith(f"self_attn.{k}.weight")
                     or (k != "o_proj" and name.endswith(f"self_attn.{k}.bias"))), None)
        if kind is None:
            return super().get(name, shape)
        heads = s.num_heads if kind in ("q_proj", "o_proj") else s.num_kv_heads
        if kind == "o_proj":  # [D, H * Dh] -> [D, H * W]: the inputs (columns) widen
            w = super().get(name, (s.hidden_size, heads * dh))
            return np.ascontiguousarray(self._rows(w.T, heads, 1.0).T)
        narrow = (heads * dh,) + tuple(shape[1:])
        scale = math.sqrt(self.width / dh) if kind == "q_proj" else 1.0
        return self._rows(super().get(name, narrow), heads, scale)


def choose_kv_mode(spec: ArchSpec, attention: str, widenable: bool = True) -> tuple[KVMode, int]:
    """The KV mode and the graph's head size for `--attention` (the spec's head size unless widened).

    "auto": GroupQueryAttention when its kernel takes the head size, or when `widenable` and widening
    to `wide_head_dim` at most doubles the head (KV memory per token grows as much); else standard
    ops. "gqa": GroupQueryAttention, widening as far as needed when it must (ConvertError when the
    heads cannot be widened). "standard": standard ops at the spec's head size. widenable is False for
    q/k-normed heads and for GGUF blocks kept exactly (see the module doc)."""
    dh = spec.head_dim
    widenable = widenable and not spec.qk_norm
    if attention == "auto":
        if GQA.takes(dh) or (widenable and wide_head_dim(dh) <= AUTO_MAX_WIDENING * dh):
            return GQA, dh if GQA.takes(dh) else wide_head_dim(dh)
        return next(m for m in MODES if m.takes(dh)), dh
    try:
        mode = kv_mode(attention)
    except ValueError:
        raise ConvertError(f"unknown attention {attention!r} (choose from {', '.join(ATTENTION_CHOICES)})") from None
    if mode.takes(dh):
        return mode, dh
    if mode is GQA and widenable:
        return GQA, wide_head_dim(dh)
    why = "q/k-normed heads" if spec.qk_norm else \
        "weights taken as a GGUF file stores them (--quant keep; --quant int4/int8/fp32 can be widened)"
    raise ConvertError(f"--attention {mode.name} needs a head size that is a multiple of {mode.head_multiple}, "
                       f"this model has {dh}, and {why} cannot be widened to one")

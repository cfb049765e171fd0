"""Small graph-building functions: each adds the nodes of one concept and returns output names.

Node names follow ONNX Runtime GenAI's greppable scheme, e.g.
`/model/layers.0/attn/qkv_proj/MatMulNBits`; a node's outputs are `<node name>/output_<i>`.
Weights go through the `WeightWriter` (streamed to the external-data file); only small
constants live inline. Shapes in comments use B batch, S new tokens, T past tokens,
H heads, Hkv kv heads, G = H / Hkv, Dh head dim, D hidden, I intermediate, V vocab.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from edgeinfer.converters.onnx_writer import WeightWriter
from edgeinfer.converters.quantize import QuantScheme, bits_of, quantize_blockwise

MS = "com.microsoft"


class Graph:
    """Mutable collector of nodes and initializers for one ONNX graph (owned by the builder)."""

    def __init__(self, writer: WeightWriter):
        self.writer = writer
        self.nodes: list = []
        self.initializers: list[TensorProto] = []
        self._names: set[str] = set()

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "",
             outputs: list[str] | None = None, **attrs) -> list[str]:
        outputs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def weight(self, name: str, array: np.ndarray) -> str:
        assert name not in self._names, name
        self._names.add(name)
        self.initializers.append(self.writer.add(name, array))
        return name

    def const(self, name: str, array) -> str:
        """An inline constant, created once per name."""
        if name not in self._names:
            self._names.add(name)
            self.initializers.append(self.writer.add(name, np.asarray(array)))
        return name


def linear(g: Graph, prefix: str, x: str, w_out_in: np.ndarray, bias: np.ndarray | None, kind: str,
           scheme: QuantScheme, inputs: np.ndarray | None = None) -> str:
    """y = x @ W^T (+ b). x [B, S, K] -> [B, S, N]; W given as Hugging Face stores it, [N, K]. inputs:
    x on the calibration text [tokens, K], for the gptq recipe (`quantize_blockwise`)."""
    n, k = w_out_in.shape
    if kind in ("int4", "int8"):
        bits = bits_of(kind)
        packed, scales, zp = quantize_blockwise(w_out_in, bits, scheme.block_size, scheme.symmetric, scheme.recipe,
                                                inputs if bits == 4 else None)
        ins = [x, g.weight(f"{prefix}.qweight", packed), block_scales(g, f"{prefix}.scales", scales, scheme)]
        if zp is not None:
            ins.append(g.weight(f"{prefix}.zero_points", zp))
        (y,) = g.node("MatMulNBits", ins, f"{prefix}/MatMulNBits", domain=MS, K=k, N=n, bits=bits,
                      block_size=scheme.block_size, accuracy_level=scheme.accuracy_level)
    elif kind == "fp16":
        (w,) = g.node("Cast", [g.weight(f"{prefix}.weight", w_out_in.T.astype(np.float16))], f"{prefix}/Cast",
                      to=TensorProto.FLOAT)
        (y,) = g.node("MatMul", [x, w], f"{prefix}/MatMul")
    else:
        (y,) = g.node("MatMul", [x, g.weight(f"{prefix}.weight", w_out_in.T.astype(np.float32))], f"{prefix}/MatMul")
    if bias is not None:
        (y,) = g.node("Add", [y, g.weight(f"{prefix}.bias", bias.astype(np.float32))], f"{prefix}/Add")
    return y


def block_scales(g: Graph, name: str, scales: np.ndarray, scheme: QuantScheme) -> str:
    """Block scales as MatMulNBits / GatherBlockQuantized read them (float32): the initializer, or with
    `scheme.scale_dtype` float16 an fp16 initializer and a Cast that ONNX Runtime folds at load (the
    file is smaller, the kernels see float32)."""
    if scheme.scale_dtype == "float32":
        return g.weight(name, scales)
    (y,) = g.node("Cast", [g.weight(f"{name}_fp16", scales.astype(np.float16))], f"/{name}/Cast", to=TensorProto.FLOAT)
    return y


def rms_norm(g: Graph, prefix: str, x: str, weight: np.ndarray, eps: float) -> str:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    w = g.weight(f"{prefix}.weight", weight.astype(np.float32))
    (y,) = g.node("SimplifiedLayerNormalization", [x, w], f"{prefix}/SimplifiedLayerNorm", axis=-1, epsilon=eps,
                  stash_type=1)
    return y


def skip_rms_norm(g: Graph, prefix: str, x: str, skip: str, weight: np.ndarray, eps: float) -> tuple[str, str]:
    """(RMSNorm(x + skip), x + skip): the residual add fused with the next norm."""
    w = g.weight(f"{prefix}.weight", weight.astype(np.float32))
    name = f"{prefix}/SkipSimplifiedLayerNorm"
    outs = [f"{name}/output_0", "", "", f"{name}/output_3"]
    g.node("SkipSimplifiedLayerNormalization", [x, skip, w], name, domain=MS, outputs=outs, epsilon=eps)
    return outs[0], outs[3]


def rotary(g: Graph, prefix: str, x: str, positions: str, cos: str, sin: str, num_heads: int) -> str:
    """Rotate-half RoPE on x [B, S, heads * Dh]: row `positions` of the cos/sin tables."""
    (y,) = g.node("RotaryEmbedding", [x, positions, cos, sin], f"{prefix}/RotaryEmbedding", domain=MS,
                  interleaved=0, num_heads=num_heads)
    return y


def causal_mask(g: Graph, input_ids: str, past_key: str) -> str:
    """Additive mask [S, T + S]: query i sees every past slot and new tokens 0..i (float32)."""
    p = "/model/attn_mask"
    (s_shape,) = g.node("Shape", [input_ids], f"{p}/ShapeS", start=1, end=2)
    (t_shape,) = g.node("Shape", [past_key], f"{p}/ShapeT", start=1, end=2)
    (s,) = g.node("Squeeze", [s_shape], f"{p}/SqueezeS")
    (t,) = g.node("Squeeze", [t_shape], f"{p}/SqueezeT")
    (total,) = g.node("Add", [t, s], f"{p}/Total")
    one = g.const("const_i64_1", np.array(1, np.int64))
    (rows,) = g.node("Range", [t, total, one], f"{p}/Rows")  # [S] index of each query in the KV
    (cols,) = g.node("Range", [g.const("const_i64_0", np.array(0, np.int64)), total, one], f"{p}/Cols")
    (rows2,) = g.node("Unsqueeze", [rows, g.const("const_axis_m1", np.array([-1], np.int64))], f"{p}/Unsqueeze")
    (future,) = g.node("Greater", [cols, rows2], f"{p}/Greater")  # [S, T+S]
    neg = g.const("const_f32_neg_large", np.array(np.finfo(np.float32).min, np.float32))
    zero = g.const("const_f32_0", np.array(0.0, np.float32))
    (mask,) = g.node("Where", [future, neg, zero], f"{p}/Where")
    return mask


def attention(g: Graph, prefix: str, q: str, k: str, v: str, past_k: str, past_v: str, mask: str,
              num_heads: int, num_kv_heads: int, head_dim: int, present_k: str, present_v: str) -> str:
    """Grouped-query attention with standard ops over [past ++ new] keys and values.

    q [B, S, H*Dh] (roped), k/v [B, S, Hkv*Dh] (k roped); past_k/past_v [B, T, Hkv, Dh] hold only
    the valid slots, so the work is proportional to T, not to the ring's capacity.
    Writes present_k/present_v [B, S, Hkv, Dh] (this call's new rows; the runtime stores them).
    Returns [B, S, H*Dh]. Query head h uses kv head h // G, as transformers' repeat_kv does.
    """
    groups = num_heads // num_kv_heads
    kv_shape = g.const(f"shape_kv_{num_kv_heads}_{head_dim}", np.array([0, 0, num_kv_heads, head_dim], np.int64))
    q_shape = g.const(f"shape_q_{num_kv_heads}_{groups}_{head_dim}",
                      np.array([0, 0, num_kv_heads, groups, head_dim], np.int64))
    g.node("Reshape", [k, kv_shape], f"{prefix}/k_reshape", outputs=[present_k])
    g.node("Reshape", [v, kv_shape], f"{prefix}/v_reshape", outputs=[present_v])
    (k_all,) = g.node("Concat", [past_k, present_k], f"{prefix}/k_concat", axis=1)  # [B, T+S, Hkv, Dh]
    (v_all,) = g.node("Concat", [past_v, present_v], f"{prefix}/v_concat", axis=1)
    (k_t,) = g.node("Transpose", [k_all], f"{prefix}/k_transpose", perm=[0, 2, 3, 1])  # [B, Hkv, Dh, T+S]
    (v_t,) = g.node("Transpose", [v_all], f"{prefix}/v_transpose", perm=[0, 2, 1, 3])  # [B, Hkv, T+S, Dh]
    axis2 = g.const("const_axis_2", np.array([2], np.int64))
    (k_t,) = g.node("Unsqueeze", [k_t, axis2], f"{prefix}/k_unsqueeze")  # [B, Hkv, 1, Dh, T+S]
    (v_t,) = g.node("Unsqueeze", [v_t, axis2], f"{prefix}/v_unsqueeze")  # [B, Hkv, 1, T+S, Dh]
    (q5,) = g.node("Reshape", [q, q_shape], f"{prefix}/q_reshape")  # [B, S, Hkv, G, Dh]
    (q5,) = g.node("Transpose", [q5], f"{prefix}/q_transpose", perm=[0, 2, 3, 1, 4])  # [B, Hkv, G, S, Dh]
    scale = g.const(f"const_attn_scale_{head_dim}", np.array(1.0 / np.sqrt(head_dim), np.float32))
    (q5,) = g.node("Mul", [q5, scale], f"{prefix}/q_scale")
    (scores,) = g.node("MatMul", [q5, k_t], f"{prefix}/qk_MatMul")  # [B, Hkv, G, S, T+S]
    (scores,) = g.node("Add", [scores, mask], f"{prefix}/mask_Add")
    (probs,) = g.node("Softmax", [scores], f"{prefix}/Softmax", axis=-1)
    (ctx,) = g.node("MatMul", [probs, v_t], f"{prefix}/pv_MatMul")  # [B, Hkv, G, S, Dh]
    (ctx,) = g.node("Transpose", [ctx], f"{prefix}/out_transpose", perm=[0, 3, 1, 2, 4])  # [B, S, Hkv, G, Dh]
    out_shape = g.const(f"shape_out_{num_heads * head_dim}", np.array([0, 0, num_heads * head_dim], np.int64))
    (ctx,) = g.node("Reshape", [ctx, out_shape], f"{prefix}/out_reshape")
    return ctx


def gqa_packed_attention(g: Graph, prefix: str, qkv: str, past_k: str, past_v: str, seqlens_k: str, total_len: str,
                         cos: str, sin: str, positions: str, num_heads: int, num_kv_heads: int, present_k: str,
                         present_v: str) -> str:
    """GroupQueryAttention on the packed q|k|v projection, RoPE inside the op (one node per layer).

    Same shared-buffer contract as `gqa_attention`; each token's RoPE is row `positions` of the host's
    cos/sin tables (rows beyond every position and total_sequence_length, as the op checks).
    """
    outs = [f"{prefix}/GroupQueryAttention/output_0", present_k, present_v]
    g.node("GroupQueryAttention", [qkv, "", "", past_k, past_v, seqlens_k, total_len, cos, sin, positions],
           f"{prefix}/GroupQueryAttention", domain=MS, outputs=outs, num_heads=num_heads, kv_num_heads=num_kv_heads,
           do_rotary=1, rotary_interleaved=0)
    return outs[0]


def gqa_attention(g: Graph, prefix: str, q: str, k: str, v: str, past_k: str, past_v: str, seqlens_k: str,
                  total_len: str, num_heads: int, num_kv_heads: int, present_k: str, present_v: str) -> str:
    """GroupQueryAttention over a shared KV buffer (the ring itself), q/k already rotated.

    past_k/past_v [B, Hkv, C + S_max, Dh] are the same memory as present_k/present_v: the op writes
    this call's rows at [total - S, total) and attends over [0, total), so the work is proportional
    to the valid slots, not to the buffer. seqlens_k [B] int32 = total - 1; total_len [] int32.
    """
    outs = [f"{prefix}/GroupQueryAttention/output_0", present_k, present_v]
    g.node("GroupQueryAttention", [q, k, v, past_k, past_v, seqlens_k, total_len], f"{prefix}/GroupQueryAttention",
           domain=MS, outputs=outs, num_heads=num_heads, kv_num_heads=num_kv_heads, do_rotary=0)
    return outs[0]


def split_last(g: Graph, prefix: str, x: str, sizes: list[int]) -> list[str]:
    return g.node("Split", [x, g.const(f"split_{'_'.join(map(str, sizes))}", np.array(sizes, np.int64))],
                  f"{prefix}/Split", n_out=len(sizes), axis=-1)


def silu_mul(g: Graph, prefix: str, gate: str, up: str) -> str:
    """silu(gate) * up; QuickGelu with alpha = 1 is exactly x * sigmoid(x)."""
    (act,) = g.node("QuickGelu", [gate], f"{prefix}/act_fn/QuickGelu", domain=MS, alpha=1.0)
    (y,) = g.node("Mul", [act, up], f"{prefix}/Mul")
    return y

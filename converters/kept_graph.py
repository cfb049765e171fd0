"""Graph nodes for GGUF blocks taken over exactly (`--quant keep`): the projections and the embedding.

A kept weight is stored once as `gguf_blocks.packs` says: symmetric MatMulNBits packs (ONNX
Runtime's fast kernels) plus, where the blocks need it, a per-block offset. Its initializers:

    {prefix}.qweight[.hi|.lo]   the packs' codes (uint8, MatMulNBits layout)
    {prefix}.scales_fp16        the file's fp16 scales; each pack's float32 scale is Cast(.) * factor
    {prefix}.mins_fp16          Q4_1's fp16 minimums (only with minimums)

Every node between those initializers and a MatMulNBits / GatherBlockQuantized is constant
(Cast, Mul, Add, Transpose), so ONNX Runtime folds them into float32 initializers when the
session loads: the file holds the GGUF's bytes, the kernels see float32 scales.

    y   = sum over packs of MatMulNBits(x, codes, scale)  +  blocksum(x) @ offset^T
    emb = sum over packs of GatherBlockQuantized(codes, ids, scale)  +  offset[ids] spread over each block
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from edgeinfer.converters.graph import MS, Graph
from edgeinfer.converters.gguf_blocks import BLOCK, Blocks, packs


@dataclass(frozen=True)
class KeptWeight:
    """A kept [N, K] weight's graph tensors: per pack (bits, codes, float32 scale), and the float32
    per-block offset [N, K/32] or None."""

    n: int
    k: int
    packs: tuple[tuple[int, str, str], ...]
    offset: str | None


def kept_weight(g: Graph, prefix: str, b: Blocks, accuracy_level: int) -> KeptWeight:
    """Write `b`'s initializers once (8-bit blocks split into two 4-bit packs unless the accuracy
    level is 4, where ONNX Runtime's 8-bit kernel is fast)."""
    plan, k_offset = packs(b, split_8bit=accuracy_level != 4)
    (scale,) = g.node("Cast", [g.weight(f"{prefix}.scales_fp16", b.scales)], f"{prefix}/scales/Cast",
                      to=TensorProto.FLOAT)
    names = [".qweight"] if len(plan) == 1 else [".qweight.hi", ".qweight.lo"]
    out = []
    for p, suffix in zip(plan, names):
        s = scale
        if p.scale_factor != 1.0:
            factor = g.const(f"{prefix}.scale_factor", np.array(p.scale_factor, np.float32))
            (s,) = g.node("Mul", [scale, factor], f"{prefix}/scales{suffix}/Mul")
        out.append((p.bits, g.weight(f"{prefix}{suffix}", p.codes), s))
    offset = None
    if k_offset is not None:
        k_name = g.const(f"{prefix}.offset_k", np.array(k_offset, np.float32))
        (offset,) = g.node("Mul", [scale, k_name], f"{prefix}/offset/Mul")
        if b.mins is not None:
            (mins,) = g.node("Cast", [g.weight(f"{prefix}.mins_fp16", b.mins)], f"{prefix}/mins/Cast",
                             to=TensorProto.FLOAT)
            (offset,) = g.node("Add", [offset, mins], f"{prefix}/offset/Add")
    n, k = b.shape
    return KeptWeight(n, k, tuple(out), offset)


def kept_matmul(g: Graph, prefix: str, x: str, w: KeptWeight, accuracy_level: int) -> str:
    """y = x @ W^T for a kept weight: x [B, S, K] -> [B, S, N]."""
    y = None
    for i, (bits, codes, scale) in enumerate(w.packs):
        (yi,) = g.node("MatMulNBits", [x, codes, scale], f"{prefix}/MatMulNBits{'' if i == 0 else i}", domain=MS,
                       K=w.k, N=w.n, bits=bits, block_size=BLOCK, accuracy_level=accuracy_level)
        y = yi if y is None else g.node("Add", [y, yi], f"{prefix}/packs/Add{i}")[0]
    if w.offset is not None:
        blocks = g.const(f"shape_blocks_{w.k}", np.array([0, 0, w.k // BLOCK, BLOCK], np.int64))
        (xb,) = g.node("Reshape", [x, blocks], f"{prefix}/blocksum/Reshape")
        (sums,) = g.node("ReduceSum", [xb, g.const("axes_last", np.array([-1], np.int64))], f"{prefix}/blocksum/ReduceSum",
                         keepdims=0)  # [B, S, K/32]
        (off_t,) = g.node("Transpose", [w.offset], f"{prefix}/offset/Transpose", perm=[1, 0])  # [K/32, N]
        (extra,) = g.node("MatMul", [sums, off_t], f"{prefix}/offset/MatMul")
        (y,) = g.node("Add", [y, extra], f"{prefix}/offset/AddToOutput")
    return y


def kept_linear(g: Graph, prefix: str, x: str, b: Blocks, bias: np.ndarray | None, accuracy_level: int) -> str:
    """`graph.linear` for blocks taken over from a GGUF file."""
    y = kept_matmul(g, prefix, x, kept_weight(g, prefix, b, accuracy_level), accuracy_level)
    if bias is not None:
        (y,) = g.node("Add", [y, g.weight(f"{prefix}.bias", bias.astype(np.float32))], f"{prefix}/Add")
    return y


def kept_gather(g: Graph, prefix: str, w: KeptWeight, ids: str) -> str:
    """Rows `ids` [B, S] of a kept [V, D] weight as float32 [B, S, D] (the token embedding)."""
    h = None
    for i, (bits, codes, scale) in enumerate(w.packs):
        shape = g.const(f"shape_rows_packed_{w.n}_{w.k * bits // 8}", np.array([w.n, w.k * bits // 8], np.int64))
        (data,) = g.node("Reshape", [codes, shape], f"{prefix}/Reshape{'' if i == 0 else i}")
        (hi,) = g.node("GatherBlockQuantized", [data, ids, scale], f"{prefix}/GatherBlockQuantized{'' if i == 0 else i}",
                       domain=MS, gather_axis=0, quantize_axis=1, block_size=BLOCK, bits=bits)
        h = hi if h is None else g.node("Add", [h, hi], f"{prefix}/packs/Add{i}")[0]
    if w.offset is not None:
        (picked,) = g.node("Gather", [w.offset, ids], f"{prefix}/offset/Gather", axis=0)  # [B, S, D/32]
        (spread,) = g.node("Unsqueeze", [picked, g.const("axes_last", np.array([-1], np.int64))],
                           f"{prefix}/offset/Unsqueeze")
        (spread,) = g.node("Mul", [spread, g.const("ones_block", np.ones(BLOCK, np.float32))], f"{prefix}/offset/Spread")
        (spread,) = g.node("Reshape", [spread, g.const(f"shape_BS_{w.k}", np.array([0, 0, w.k], np.int64))],
                           f"{prefix}/offset/Reshape")
        (h,) = g.node("Add", [h, spread], f"{prefix}/offset/AddToRows")
    return h

"""Weight quantization, on ONNX Runtime's own block quantizers.

`quantize_blockwise` wraps `onnxruntime.capi._pybind_state.quantize_matmul_{4,8}bits` (the C++
kernels behind ORT's MatMulNBitsQuantizer) and returns the exact initializers MatMulNBits reads:

    packed [N, n_blocks, block_size * bits / 8] uint8   (low nibble first for 4 bits)
    scales [N, n_blocks] float32
    zero_points [N, ceil(n_blocks * bits / 8)] uint8    (None when symmetric: MatMulNBits then uses 2^(bits-1))

K need not be a multiple of the block: the last block of each row is zero-padded (stories260K's
down_proj has K = 172 = 5 * 32 + 12), so every weight is kept; nothing is truncated.

`QuantScheme` (the manifest's `quantization` section) lives in `edgeinfer.quant_scheme`, so the
runtime reads it without these kernels; it is re-exported here for the converter.
"""

from __future__ import annotations

import numpy as np
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from edgeinfer.quant_scheme import BLOCK_SIZES, PROJECTIONS, QUANTS, QuantScheme  # noqa: F401 (re-exported)


def bits_of(kind: str) -> int:
    return {"int4": 4, "int8": 8}[kind]


def quantize_blockwise(w_out_in: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """Quantize a [N, K] (out, in) float32 weight for MatMulNBits; returns (packed, scales, zero_points)."""
    n, k = w_out_in.shape
    n_blocks = (k + block_size - 1) // block_size
    blob = block_size * bits // 8
    packed = np.zeros((n, n_blocks, blob), np.uint8)
    scales = np.zeros((n, n_blocks), np.float32)
    zero_points = np.zeros((n, (n_blocks * bits + 7) // 8), np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, np.ascontiguousarray(w_out_in.T, dtype=np.float32), scales, zero_points, block_size, n, k, symmetric)
    return packed, scales, (None if symmetric else zero_points)

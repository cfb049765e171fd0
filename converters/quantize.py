"""Weight quantization schemes, on ONNX Runtime's own block quantizers.

`quantize_blockwise` wraps `onnxruntime.capi._pybind_state.quantize_matmul_{4,8}bits` (the C++
kernels behind ORT's MatMulNBitsQuantizer) and returns the exact initializers MatMulNBits reads:

    packed [N, n_blocks, block_size * bits / 8] uint8   (low nibble first for 4 bits)
    scales [N, n_blocks] float32
    zero_points [N, ceil(n_blocks * bits / 8)] uint8    (None when symmetric: MatMulNBits then uses 2^(bits-1))

K need not be a multiple of the block: the last block of each row is zero-padded (stories260K's
down_proj has K = 172 = 5 * 32 + 12), so every weight is kept; nothing is truncated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from edgeinfer.errors import ConvertError

QUANTS = ("fp32", "fp16", "int8", "int4")
BLOCK_SIZES = (16, 32, 64, 128, 256)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class QuantScheme:
    """How the converter stores weights; written to the manifest's `quantization` section."""

    weights: str = "fp32"  # one of QUANTS: transformer-block linear layers
    block_size: int = 32  # int4/int8 only
    symmetric: bool = True  # int4/int8: no zero points when True
    accuracy_level: int = 0  # MatMulNBits: 0 = fp32 math, 4 = int8 activations (faster on CPU)
    embedding: str = "fp32"  # fp32 | fp16 | int8 | int4: the token embedding (and tied lm_head)
    lm_head: str = "fp32"  # same choices; equals `embedding` when tied (one shared matrix)
    int8_tensors: tuple[str, ...] = ()  # with weights=int4: projections kept at int8 (mixed precision)

    def kind_for(self, projection: str) -> str:
        """Storage of one projection ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")."""
        if self.weights == "int4" and projection in self.int8_tensors:
            return "int8"
        return self.weights

    def __post_init__(self) -> None:
        for field_name in ("weights", "embedding", "lm_head"):
            if getattr(self, field_name) not in QUANTS:
                raise ConvertError(f"unknown quantization {getattr(self, field_name)!r} (choose from {', '.join(QUANTS)})")
        if self.block_size not in BLOCK_SIZES:
            raise ConvertError(f"block size {self.block_size} not supported (choose from {BLOCK_SIZES})")
        unknown = set(self.int8_tensors) - set(PROJECTIONS)
        if unknown:
            raise ConvertError(f"unknown projection(s) {', '.join(sorted(unknown))} (choose from {', '.join(PROJECTIONS)})")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConvertError(f"accuracy_level must be 0..4, got {self.accuracy_level}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["int8_tensors"] = list(self.int8_tensors)
        return d


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

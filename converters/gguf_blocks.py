"""llama.cpp's Q4_0, Q4_1 and Q8_0 blocks as MatMulNBits blocks, exactly (no re-quantization).

llama.cpp (ggml-common.h) stores a row of K weights as K/32 blocks:

    Q8_0   fp16 d, int8 q[32]                       w = d * q
    Q4_0   fp16 d, uint8 qs[16]                     w = d * (q - 8);     q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4
    Q4_1   fp16 d, fp16 m, uint8 qs[16]             w = d * q + m;       same nibble order as Q4_0

ONNX Runtime's MatMulNBits (block 32) computes w = scale * (q - zero_point) with q packed two per
byte, element 2i in the low nibble of byte i (8 bits: one per byte), and a default zero point of
2^(bits-1) when none is given. So Q8_0 is q + 128 with zero point 128 and Q4_0 its nibbles
re-ordered with zero point 8, with the same scales: the same numbers llama.cpp holds. Q4_1 is
d * (q - 8) plus a per-block offset m + 8 d (`packs` says how each kind of block is computed).
`Blocks` keeps the fp16 scales (and Q4_1's fp16 minimums) as the file has them; the graph casts
them to float32 and ONNX Runtime folds that at load, so the file is no bigger than the GGUF's.

"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import ConvertError

BLOCK = 32
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # GGUF types taken over without re-quantization
TYPE_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block of 32


@dataclass(frozen=True)
class Blocks:
    """An [N, K] weight as MatMulNBits blocks of 32 (K a multiple of 32).

    packed  [N, K/32, 32*bits/8] uint8, element 2i in the low nibble of byte i (bits 4)
    scales  [N, K/32] float16
    mins    [N, K/32] float16 or None: w = scale * q + min; None: w = scale * (q - 2^(bits-1))
    source  the GGUF type(s) the blocks came from ("Q4_1", or "Q4_0+Q8_0" after `stack`)
    """

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * BLOCK

    def codes(self) -> np.ndarray:
        """The unsigned integer codes [N, K/32, 32] (uint8)."""
        if self.bits == 8:
            return self.packed
        out = np.empty((*self.packed.shape[:2], BLOCK), np.uint8)
        out[..., 0::2] = self.packed & 15
        out[..., 1::2] = self.packed >> 4
        return out

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], as llama.cpp's dequantization computes it."""
        q, d = self.codes().astype(np.float32), self.scales.astype(np.float32)[..., None]
        w = d * q + self.mins.astype(np.float32)[..., None] if self.mins is not None \
            else d * (q - 2 ** (self.bits - 1))
        return w.reshape(self.shape)

    def rows(self, order: np.ndarray) -> "Blocks":
        """The same weight with its rows re-ordered (`order[i]` = the source row of row i)."""
        return Blocks(self.bits, self.packed[order], self.scales[order],
                      None if self.mins is None else self.mins[order], self.source)

    def to_8bit(self) -> "Blocks":
        """The same values as 8-bit blocks (exact: the codes are re-centred, scales and mins kept)."""
        if self.bits == 8:
            return self
        q = self.codes()
        return Blocks(8, q if self.mins is not None else q + np.uint8(120), self.scales, self.mins, self.source)

    def with_mins(self) -> "Blocks":
        """The same values in the w = scale * q + min form (min = -scale * 2^(bits-1), exact in fp16
        unless it overflows, which raises ValueError)."""
        if self.mins is not None:
            return self
        with np.errstate(over="ignore"):
            mins = (self.scales * np.float16(-(2 ** (self.bits - 1)))).astype(np.float16)
        if not np.isfinite(mins).all():
            raise ValueError("a scale too large for an fp16 minimum")
        return Blocks(self.bits, self.packed, self.scales, mins, self.source)


@dataclass(frozen=True)
class Pack:
    """One MatMulNBits weight with the default zero point 2^(bits-1) (ONNX Runtime's fast kernels):
    codes in its layout, and its scale as a multiple of the blocks' scale."""

    bits: int
    codes: np.ndarray  # [N, K/32, 32*bits/8] uint8
    scale_factor: float


def packs(b: Blocks, split_8bit: bool) -> tuple[list[Pack], float | None]:
    """`b` as symmetric MatMulNBits packs and a per-block offset, exactly:

        w = sum over packs of (scale * factor) * (code - 2^(bits-1))  +  offset
        offset = min + k * scale per block (k returned; None: no offset)

    Why not MatMulNBits' own zero points: ONNX Runtime 1.32's CPU kernel takes floating-point ones
    (Q4_1 kept exactly, checked to 1e-6) but runs 8-50x slower with them, and its 8-bit kernel at
    accuracy level 0 is 6-40x slower than two 4-bit packs (one decode row, 3072x576 and 49152x576;
    scripts/bench_kept_blocks.py, docs/benchmarks/kept-blocks.json). So a minimum becomes an offset
    times the input's block sums (llama.cpp's own Q4_1 x Q8_1 arithmetic), and with `split_8bit` an
    8-bit code u = 16 hi + lo becomes two 4-bit packs (scales 16 d and d)."""
    if b.bits == 4:
        return [Pack(4, b.packed, 1.0)], (8.0 if b.mins is not None else None)
    if not split_8bit:
        return [Pack(8, b.packed, 1.0)], (128.0 if b.mins is not None else None)
    hi, lo = _split8(b.packed)
    return [Pack(4, hi, 16.0), Pack(4, lo, 1.0)], (136.0 if b.mins is not None else 8.0)


def _split8(u: np.ndarray, rows: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """8-bit codes [N, nb, 32] as two 4-bit packs [N, nb, 16] (high and low nibbles), a few rows at a
    time so that a large embedding costs no full-size temporaries."""
    hi = np.empty((*u.shape[:2], BLOCK // 2), np.uint8)
    lo = np.empty_like(hi)
    for r in range(0, u.shape[0], rows):
        part = u[r:r + rows]
        hi[r:r + rows] = pack4(part >> 4)
        lo[r:r + rows] = pack4(part & 15)
    return hi, lo


def pack4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (uint8, last axis even) two per byte, element 2i in the low nibble: MatMulNBits' layout."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def stack(parts: list[Blocks]) -> Blocks:
    """Blocks of several weights with the same K, one on top of the other (q|k|v, gate|up), exactly:
    mixed widths become 8-bit, mixed zero-point forms all take minimums. ValueError if they cannot."""
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError("parts differ in K")
    if len({p.bits for p in parts}) > 1:
        parts = [p.to_8bit() for p in parts]
    if any(p.mins is not None for p in parts):
        parts = [p.with_mins() for p in parts]
    mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
    source = "+".join(dict.fromkeys(s for p in parts for s in p.source.split("+")))
    return Blocks(parts[0].bits, np.concatenate([p.packed for p in parts]),
                  np.concatenate([p.scales for p in parts]), mins, source)


def from_gguf(raw: np.ndarray, qtype: str, n: int, k: int) -> Blocks:
    """Blocks of one GGUF tensor: `raw` its bytes (uint8), `n` rows of `k` weights."""
    if qtype not in KEPT_TYPES:
        raise ValueError(f"{qtype} is not kept as blocks")
    if k % BLOCK:
        raise ConvertError(f"a {qtype} tensor has rows of {k} weights, not a multiple of {BLOCK}")
    size = TYPE_BYTES[qtype]
    if raw.size != n * (k // BLOCK) * size:
        raise ConvertError(f"a {qtype} tensor of {n}x{k} should hold {n * (k // BLOCK) * size} bytes, not {raw.size}")
    b = raw.reshape(n, k // BLOCK, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q8_0":
        return Blocks(8, b[..., 2:] ^ np.uint8(0x80), d, None, qtype)  # int8 q + 128, as a byte
    qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # llama.cpp: q[j] low nibbles, q[j+16] high
    mins = b[..., 2:4].copy().view(np.float16)[..., 0] if qtype == "Q4_1" else None
    return Blocks(4, pack4(codes), d, mins, qtype)


def q4_1_blocks(w: np.ndarray, rows: int = 2048) -> Blocks:
    """A float32 [N, K] weight (K a multiple of 32) quantized as llama.cpp's Q4_1 does it: per block of
    32, d = (max - min) / 15 and m = min (both fp16), q = round((w - m) / d) in [0, 15]. Run by
    `kept_graph` like a Q4_1 GGUF tensor (symmetric packs plus a block-sum offset: full speed)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"rows of {k} weights are not whole blocks of {BLOCK}")
    packed = np.empty((n, k // BLOCK, BLOCK // 2), np.uint8)
    scales = np.empty((n, k // BLOCK), np.float16)
    mins = np.empty_like(scales)
    for r in range(0, n, rows):
        x = w[r:r + rows].reshape(-1, k // BLOCK, BLOCK).astype(np.float32)
        lo, hi = x.min(-1), x.max(-1)
        d = ((hi - lo) / 15).astype(np.float16)
        m = lo.astype(np.float16)
        d32, m32 = d.astype(np.float32), m.astype(np.float32)
        inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
        q = np.clip(np.rint((x - m32[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        packed[r:r + rows], scales[r:r + rows], mins[r:r + rows] = pack4(q), d, m
    return Blocks(4, packed, scales, mins, "q4_1")


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (convert_hf_to_gguf.py, Llama): per head,
    the GGUF holds the rotary pairs interleaved (row 2j, 2j+1) where Hugging Face holds them halved
    (row j, j + Dh/2). Returns `order` with hf_rows = gguf_rows[order]."""
    if n_rows % (2 * n_heads):
        raise ConvertError(f"cannot undo the q/k permutation: {n_rows} rows over {n_heads} heads")
    return np.arange(n_rows).reshape(n_heads, n_rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)

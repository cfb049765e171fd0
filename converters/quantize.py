"""Weight quantization into the initializers MatMulNBits reads.

`quantize_blockwise` runs a recipe: ONNX Runtime's own `quantize_matmul_{4,8}bits` (the C++ kernels
behind ORT's MatMulNBitsQuantizer: int8, int4 `rtn`) or our per-block searches (int4 `asym` and
`mse`; `gptq`, the default, in converters/gptq.py), and returns the exact initializers MatMulNBits reads:

    packed [N, n_blocks, block_size * bits / 8] uint8   (low nibble first for 4 bits)
    scales [N, n_blocks] float32
    zero_points [N, ceil(n_blocks * bits / 8)] uint8    (None when symmetric: MatMulNBits then uses 2^(bits-1))

K need not be a multiple of the block: the last block of each row is zero-padded (stories260K's
down_proj has K = 172 = 5 * 32 + 12), so every weight is kept; nothing is truncated.

`QuantScheme` (the manifest's `quantization` section) lives in `edgeinfer.quant_scheme`, so the
runtime reads it without these kernels; it is re-exported here for the converter.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

from edgeinfer.converters.gguf_blocks import pack4
from edgeinfer.session import usable_cores
from edgeinfer.quant_scheme import BLOCK_SIZES, PROJECTIONS, QUANTS, RECIPES, QuantScheme  # noqa: F401 (re-exported)
from edgeinfer.errors import ConvertError

MAX_WEIGHT_ABS = 65504.0  # float16's largest: trained weights are orders of magnitude smaller


def check_magnitude(name: str, w: np.ndarray) -> None:
    """ConvertError for a weight past MAX_WEIGHT_ABS: finite, yet no trained model has one (one flipped
    exponent bit turns 1.0 into 3e38); it passed the NaN check and made every logit NaN at run time,
    and fp16 targets and int4's float16 scales cannot hold it at all."""
    peak = max(float(w.max()), -float(w.min())) if w.size else 0.0  # no |w| copy of a large tensor
    if peak > MAX_WEIGHT_ABS:
        raise ConvertError(f"{name}: a weight of magnitude {peak:.3g}, past any trained model's (at most "
                           f"{MAX_WEIGHT_ABS:g} here): a damaged file (a flipped exponent bit, say)")


def bits_of(kind: str) -> int:
    return {"int4": 4, "int8": 8}[kind]


MSE_FACTORS = np.linspace(0.80, 1.10, 13, dtype=np.float32)  # scale candidates around the signed maximum's


def quantize_blockwise(w_out_in: np.ndarray, bits: int, block_size: int, symmetric: bool, recipe: str = "rtn",
                       inputs: np.ndarray | None = None):
    """Quantize a [N, K] (out, in) float32 weight (for gptq, also a `rows.Rows`, read a slice at a time)
    for MatMulNBits; returns (packed, scales, zero_points).

    recipe (int4 only; other widths always "rtn"; asym is asymmetric storage, rtn either, mse symmetric):
      rtn  ONNX Runtime's quantizer, round to nearest: scale = (the block's signed extreme) / -8, as
           llama.cpp's Q4_0 (a numpy copy of that rule gives the same perplexity on stories260K)
      mse  per block, the scale among `MSE_FACTORS` x that one with the least squared weight error
           (a smaller scale clips the extreme and resolves the rest finer). Measured (docs/quantization
           notes in issue 14): stories260K +15.2 % -> +12.2 %; SmolLM2-135M +23.3 % -> +26.3 %, whose
           reference weights are a Q4_1 file's grid, so not a default.
      asym asymmetric blocks with integer zero points (MatMulNBits' fast uint8 zero points), the scale
           and zero point of each block searched for the least squared error around min/max's
      gptq asym's storage, the grid fitted to the inputs and the rounding errors fed forward, from
           `inputs`, the weight's input on the calibration text [tokens, K] (converters/gptq.py); a
           weight with none (an embedding table read by lookups alone) takes asym
      q4_1 asymmetric blocks of 32 with an fp16 scale and minimum, as llama.cpp's Q4_1 (5 bits per
           weight); built by `gguf_blocks.q4_1_blocks` and run by `kept_graph` (the decoder routes it
           there; this function never sees it)
    """
    if bits == 4 and symmetric and recipe == "mse":
        return _int4_signed(w_out_in, block_size, MSE_FACTORS)
    if bits == 4 and not symmetric and recipe == "gptq" and inputs is not None:
        from edgeinfer.converters.gptq import gptq_int4  # (it builds on this module's search)
        return gptq_int4(w_out_in, inputs, block_size)
    if bits == 4 and not symmetric and recipe in ("asym", "gptq"):  # gptq without inputs: a tensor no input reaches
        return int4_asym(w_out_in, block_size)
    n, k = w_out_in.shape
    n_blocks = (k + block_size - 1) // block_size
    blob = block_size * bits // 8
    packed = np.zeros((n, n_blocks, blob), np.uint8)
    scales = np.zeros((n, n_blocks), np.float32)
    zero_points = np.zeros((n, (n_blocks * bits + 7) // 8), np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, np.ascontiguousarray(w_out_in.T, dtype=np.float32), scales, zero_points, block_size, n, k, symmetric)
    return packed, scales, (None if symmetric else zero_points)


def _row_blocks(w: np.ndarray, block: int, rows: int = 2048):
    """(first row, x [rows, n_blocks, block]) a few rows of `w` at a time, the last block of each row
    zero-padded as ONNX Runtime's quantizer pads it."""
    n, k = w.shape
    nb = -(-k // block)
    for r in range(0, n, rows):
        x = np.zeros((min(rows, n - r), nb * block), np.float32)
        x[:, :k] = w[r:r + rows]
        yield r, x.reshape(len(x), nb, block)


def _int4_signed(w: np.ndarray, block: int, factors: np.ndarray):
    """Symmetric 4-bit blocks (MatMulNBits' default zero point 8) with scale d = f * extreme / -8, the
    factor f per block from `factors` with the least squared error; a few rows at a time."""
    n, nb = len(w), -(-w.shape[1] // block)
    packed = np.empty((n, nb, block // 2), np.uint8)
    scales = np.empty((n, nb), np.float32)
    for r, x in _row_blocks(w, block):
        extreme = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # signed, [rows, nb]
        best_err = np.full(extreme.shape, np.inf, np.float32)
        best_d = np.zeros_like(extreme)
        for f in factors:
            d = extreme * (f / -8.0)
            inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
            q = np.clip(np.rint(x * inv[..., None]), -8, 7)
            err = np.square(x - q * d[..., None]).sum(-1)
            better = err < best_err
            best_err, best_d = np.where(better, err, best_err), np.where(better, d, best_d)
        inv = np.divide(1.0, best_d, out=np.zeros_like(best_d), where=best_d != 0)
        packed[r:r + len(x)] = pack4((np.clip(np.rint(x * inv[..., None]), -8, 7) + 8).astype(np.uint8))
        scales[r:r + len(x)] = best_d
    return packed, scales, None


ASYM_FACTORS = np.linspace(0.85, 1.05, 9, dtype=np.float32)


def int4_asym(w: np.ndarray, block: int):
    """Asymmetric 4-bit blocks, w = s (q - z) with an integer z in [0, 15]: per block the (s, z) among
    s = f (max - min) / 15 (f in ASYM_FACTORS) and z = round(-min / s) + {-1, 0, 1} with the least
    squared error, min and max the block's with 0 included. Zero points packed two per byte, low
    nibble first, as MatMulNBits reads them. Chunks of rows are searched on the cores this process
    may use (numpy releases the GIL)."""
    n, nb = len(w), -(-w.shape[1] // block)
    packed = np.empty((n, nb, block // 2), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zps = np.zeros((n, nb + nb % 2), np.uint8)  # an even count, so the last byte's high nibble is 0

    def one(chunk):
        r, x = chunk
        codes, s, z = asym_search(x)
        packed[r:r + len(x)] = pack4(codes)
        scales[r:r + len(x)] = s
        zps[r:r + len(x), :nb] = z.astype(np.uint8)

    workers = min(usable_cores(), -(-n // ASYM_ROWS))
    if workers <= 1:
        for chunk in _row_blocks(w, block, ASYM_ROWS):
            one(chunk)
        return packed, scales, pack4(zps)
    with ThreadPoolExecutor(workers) as pool:  # at most `workers` chunks in memory at once
        running: list = []
        for chunk in _row_blocks(w, block, ASYM_ROWS):
            if len(running) == workers:
                running.pop(0).result()
            running.append(pool.submit(one, chunk))
        for fut in running:
            fut.result()
    return packed, scales, pack4(zps)


ASYM_ROWS = 512  # rows per chunk: a chunk's buffers are a few times rows x K floats


def asym_search(x: np.ndarray, importance: np.ndarray | None = None):
    """`int4_asym`'s search on blocks x [rows, n_blocks, block]: (codes uint8, s, z) per block. The
    candidates' error is computed in place, in the same operations' order as the plain expression
    sum((x - s (clip(rint(x / s) + z, 0, 15) - z))^2), so the choice does not depend on the buffers.
    importance [n_blocks, block] (the gptq recipe: each input's mean square on calibration text)
    weighs each weight's squared error: an input that is large costs its weights' rounding more."""
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)  # the range holds 0, as ONNX Runtime's
    # asymmetric quantizer's does: a block on one side of it (a constant one) is then reached by the grid
    # s (q - z), z in [0, 15], where its own [min, max] left it at 0 (hostile round)
    span = np.maximum(hi - lo, 1e-12)
    best_err = np.full(lo.shape, np.inf, np.float32)
    best_s, best_z = np.zeros_like(lo), np.zeros(lo.shape, np.float32)
    c, q = np.empty_like(x), np.empty_like(x)
    for f in ASYM_FACTORS:
        s = span * (f / 15.0)
        z0 = np.rint(-lo / s)
        np.rint(np.divide(x, s[..., None], out=c), out=c)  # the codes before the zero point (shared by the z)
        for dz in (-1.0, 0.0, 1.0):
            z = np.clip(z0 + dz, 0, 15)
            np.clip(np.add(c, z[..., None], out=q), 0, 15, out=q)
            np.subtract(q, z[..., None], out=q)
            np.multiply(s[..., None], q, out=q)
            np.square(np.subtract(x, q, out=q), out=q)
            if importance is not None:
                np.multiply(q, importance, out=q)
            err = q.sum(-1)
            better = err < best_err
            best_err, best_s, best_z = (np.where(better, err, best_err), np.where(better, s, best_s),
                                        np.where(better, z, best_z))
    np.rint(np.divide(x, best_s[..., None], out=c), out=c)
    codes = np.clip(np.add(c, best_z[..., None], out=c), 0, 15, out=c).astype(np.uint8)
    return codes, best_s, best_z

"""int4's calibrated recipe, `gptq`: asymmetric blocks (integer zero points, as `asym`) whose grid is
fitted to the inputs the weights meet, and whose rounding feeds each weight's error forward to the
weights still to be rounded (GPTQ, Frantar et al. 2022), both from X, the projection's input on the
calibration text (`calibration.Calibration`).

`gptq_int4(w, x, block)` quantizes a [N, K] (out, in) float weight and returns what
`quantize_blockwise` returns for asym: (packed, scales, zero_points). Its steps:
1. Importance: d = sum over tokens of x^2, each input's (the diagonal of H = X^T X).
2. The grid: each block's scale s and zero point z by `quantize.asym_search` on the weights as
   they are, each weight's squared error weighed by its input's d (the grid is fixed before step
   4: "static groups"). Weighing is what fits the grid: SmolLM2-135M's perplexity +21.3 % with
   plain asym grids, +9.2 % with weighed ones (an experiment at fp32, with or without step 4).
3. The order: inputs by decreasing d ("act order"), so that the inputs that weigh most are
   rounded first, while many inputs are left to take up their error (measured on SmolLM2-135M,
   with the shipped text's paragraphs in four orders: 36.07, 36.92, 37.22, 37.79 in input order,
   34.09, 36.73, 35.20, 35.61 in this one; stories260K 6.097, 6.145, 6.085, 6.119 against 6.081,
   6.081, 6.060, 6.028). Damping: H + `DAMP` mean(diag H) I, rows and columns in that order; U,
   the upper Cholesky factor of its inverse (not positive definite in float64: ten times the
   damping, and so on).
4. Error feedback, input by input in that order, rows independent: code = clip(rint(w_j / s) + z,
   0, 15), on the grid of the block input j belongs to; e = (w_j - s (code - z)) / U[j, j]; the
   inputs after it w_{j'} -= e U[j, j'] (within a batch of `block` consecutive inputs of that order
   at once, the rest once per batch; a batch is not a quantization block). Only for weights of at
   most `FEEDBACK_MAX_INPUTS` inputs: H and its inverse cost K^2 per token and K^3 (a 4864-input
   down_proj: 9 s a layer here), and cutting H into diagonal windows to save that made SmolLM2
   worse than no feedback at all (+27 % against +21 %); a wider weight is rounded to nearest on its
   fitted grid. In input order the feedback added nothing on SmolLM2 (+9.2 % either way) and most of
   the gain on stories260K (+10.6 % -> +6.5 %); in act order it is the gain on SmolLM2 (the four
   orders of step 3).
5. Pack codes and zero points as MatMulNBits reads them.
Steps 2, 4 and 5 run on chunks of `ROWS` rows, on the cores this process may use (numpy releases
the GIL), with BLAS on one thread (`threadpoolctl`): its own threads on top of ours oversubscribed
the cores, and on a busy machine OpenBLAS's waiting threads took a SmolLM2 conversion from 13 s to
110-122 s (a 576-input inverse: 397 ms on two threads, 14 ms on one); its sums on one thread are also
the same whatever the core count. Each input's weight in step 2 is d over d's mean plus a small
floor (`FLOOR`): an input that never varies in calibration (a widened head's zero dims, a channel
the text never reaches) leaves its block's choice to the plain squared error, and passes no error
on. Inputs whose squares are not finite even in float64 (a source whose activations pass float32's
range squared: values past 1e19) give asym's blocks instead, as a weight with no input does.
"""

from __future__ import annotations

import numpy as np

from threadpoolctl import threadpool_limits

from edgeinfer.converters.gguf_blocks import pack4
from edgeinfer.converters.quantize import asym_search, int4_asym
from edgeinfer.session import on_cores

DAMP = 0.01  # of the mean diagonal, added to H's diagonal (GPTQ's default)
FLOOR = 0.001  # importance every input has, over the mean's 1
FEEDBACK_MAX_INPUTS = 1024  # wider weights: rounded on their fitted grid, no feedback (step 4)
ROWS = 2048  # rows per chunk (steps 2, 4, 5): two in flight on 2 cores, about 50 MB each for a 896-input weight


def gptq_int4(w: np.ndarray, x: np.ndarray, block: int):
    """Steps 1-5 of the module doc on w [N, K] (an array, or anything that gives float rows for `w[a:b]`
    and has `shape`: `rows.Rows`) with its inputs x [tokens, K]; (packed, scales, zero_points)."""
    with threadpool_limits(1, "blas"):
        return _gptq_int4(w, np.asarray(x, np.float64).reshape(-1, w.shape[1]), block)


def _gptq_int4(w, x: np.ndarray, block: int):
    n, k = w.shape
    nb = -(-k // block)
    d = np.zeros(nb * block, np.float64)
    d[:k] = np.einsum("tk,tk->k", x, x)  # 1.
    if not np.isfinite(d).all():  # no grid fits inputs past float64's range
        return int4_asym(w if isinstance(w, np.ndarray) else w[0:n], block)
    importance = (d / max(float(d.mean()), 1e-300) + FLOOR).astype(np.float32).reshape(nb, block)
    order = u = None
    if k <= FEEDBACK_MAX_INPUTS:  # 3.
        order = np.argsort(-d[:k], kind="stable")  # equal d: input order
        u = _inverse_cholesky((x.T @ x)[np.ix_(order, order)])
    packed = np.empty((n, nb, block // 2), np.uint8)
    scales = np.empty((n, nb), np.float32)
    zps = np.zeros((n, nb + nb % 2), np.uint8)  # an even count: the last byte's high nibble is 0

    def rows(r: int) -> None:
        m = min(ROWS, n - r)
        blocks = np.zeros((m, nb * block), np.float32)
        blocks[:, :k] = w[r:r + m]
        _, s, z = asym_search(blocks.reshape(m, nb, block), importance)  # 2.
        codes = np.repeat(z.T, block, 0)  # input-major: each input's codes contiguous (padding: the zero point's)
        if u is None:
            codes[:k] = _round(blocks[:, :k].T, s, z, block, k)
        else:
            codes[:k] = _feedback(blocks[:, :k].T, s, z, u, order, block)  # 4.
        packed[r:r + m] = pack4(codes.T.reshape(m, nb, block).astype(np.uint8))  # 5.
        scales[r:r + m] = s
        zps[r:r + m, :nb] = z.astype(np.uint8)

    on_cores(rows, range(0, n, ROWS))
    return packed, scales, pack4(zps)


def _grid(s: np.ndarray, z: np.ndarray, block: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per input (rows of the input-major layout): (s, z) [k, m] from the blocks' [m, n_blocks]."""
    return np.repeat(s.T, block, 0)[:k], np.repeat(z.T, block, 0)[:k]


def _round(wt: np.ndarray, s: np.ndarray, z: np.ndarray, block: int, k: int) -> np.ndarray:
    """Codes [k, m] of the input-major weights wt, rounded to nearest on the grid (as asym rounds:
    w / s, so that with no feedback the codes are asym's on the same grid)."""
    s_in, z_in = _grid(s, z, block, k)
    return np.clip(np.rint(wt / s_in) + z_in, 0, 15)


def _feedback(wt: np.ndarray, s: np.ndarray, z: np.ndarray, u: np.ndarray, order: np.ndarray,
              block: int) -> np.ndarray:
    """Step 4 on input-major weights wt [K, m] (not written to): codes [K, m]. u is step 3's, its
    rows and columns in `order`; each input keeps its own block's grid."""
    k = len(wt)
    s_in, z_in = _grid(s, z, block, k)
    wt, s_in, z_in = wt[order], s_in[order], z_in[order]  # copies, in the order of rounding
    codes = np.empty_like(wt)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        err = np.empty((i2 - i1, wt.shape[1]), np.float32)
        for j in range(i1, i2):
            q = np.clip(np.rint(wt[j] / s_in[j]) + z_in[j], 0, 15)
            codes[j] = q
            e = (wt[j] - s_in[j] * (q - z_in[j])) / u[j, j]
            if j + 1 < i2:
                wt[j + 1:i2] -= u[j, j + 1:i2, None] * e
            err[j - i1] = e
        if i2 < k:
            wt[i2:] -= u[i1:i2, i2:].T @ err
    out = np.empty_like(codes)
    out[order] = codes
    return out


def _inverse_cholesky(h: np.ndarray) -> np.ndarray:
    """U with U^T U = (H + damping)^-1, U upper triangular (float32); an input with no calibration
    signal (diagonal 0) gets 1 there, and no coupling, so it passes no error on."""
    h = h.astype(np.float64)
    dead = np.diag(h) <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    mean = float(np.mean(np.diag(h)))
    damp = DAMP
    for _ in range(4):
        try:
            return np.linalg.cholesky(np.linalg.inv(h + np.eye(len(h)) * (damp * mean))).T.astype(np.float32)
        except np.linalg.LinAlgError:
            damp *= 10
    return np.diag(1 / np.sqrt(np.diag(h) + damp * mean)).astype(np.float32)  # no feedback at all

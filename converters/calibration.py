"""What the float model computes on a short text: the inputs each projection meets, for int4's
calibrated recipe (`gptq`, the default; `converters/gptq.py`).

`calibration_ids(tokenizer, spec)` encodes the text we ship (`calibration.txt`: about 3 KB of plain
English we wrote for this, of several kinds: a story, dialogue, instructions, facts, questions and
answers, a little Python) into rows of `SEQ_TOKENS` tokens. A shipped text, not one the model
writes itself: it needs no generation at convert time (which would need a runtime for a model not
yet converted), it is the same for every conversion, and it is nobody's eval text. Measured, its
kind matters little: stories260K's own sampled stories as the calibration text gave 6.129 against
this text's 6.138 (an experiment outside the repo, dequantized weights at fp32).

The same bytes conversion after conversion, on one core as on all: the products run with BLAS on
one thread (`decoder.build_decoder`), a calibration row per core (`project`). OpenBLAS on two
threads sums in another order than on one, and a weight near a rounding boundary then went the
other way (a hostile round: 8 codes of stories260K's, 4,507 of SmolLM2's lm_head). This holds where
threadpoolctl can hold BLAS to one thread: OpenBLAS, as numpy's wheels for Linux and Windows ship
it; numpy built on Apple's Accelerate (macOS arm64 wheels) is not held, and there the bytes may
still depend on the core count.

`plan` decides whether a conversion calibrates (the gptq recipe with some weight at int4, a text
the tokenizer reads as enough tokens; or, for `--target cuda`, one row to check the range) and says
so. `Calibration` runs the model on those rows in numpy, one layer at a time, in the order
`decoder.build_decoder` reads the layer's weights, and returns each projection's input X [tokens, K]
(float32; the recipe takes what it needs: its Gram matrix X^T X, or each input's sum of squares),
just before that projection is quantized:
1. `attention_input(ln)`: RMSNorm of the residual stream (q|k|v's input).
2. `attention(w_qkv, b_qkv, q_norm, k_norm)`: q, k, v (biases, per-head norms, RoPE as the graph's
   host tables compute it), causal attention (within the sliding window, if any) with grouped
   heads; the context (o_proj's input).
3. `mlp_input(w_o, b_o, post_ln)`: the residual plus o_proj's output, normed (gate|up's input).
4. `mlp_act(w_gate_up)`: silu(gate) * up (down_proj's input).
5. `end_layer(w_down)`: the residual plus down_proj's output.
6. `head_input(norm)`: the final norm (the lm_head's input).
Each step takes the float weights (the source's, not the quantized ones: every layer sees what the
float model computes). The arithmetic is the graph's in float32, so the logits it implies match
transformers' (`tests/test_gptq.py`), widened heads included (`widen.py`: the same function).

Along the way `peak` keeps the largest magnitude of any activation the graph holds (the residual
stream, each projection's output, the norms' and the MLP's products). A `--target cuda` graph holds
them in float16, where one past 65504 becomes infinity and the logits NaN: `convert` refuses such a
model for that target (`cuda_graph.check_range`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgeinfer.arch import ArchSpec
from edgeinfer.manifest import TokenizerInfo
from edgeinfer.quant_scheme import PROJECTIONS, QuantScheme
from edgeinfer.session import on_cores

CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")
SEQ_TOKENS = 256  # tokens per calibration row (fewer for a model trained on fewer positions)
MAX_TOKENS = 1024  # the calibration's cost grows with them (a 0.5B model: ~40 ms a token)


def calibration_ids(tokenizer, spec: ArchSpec, text: str | None = None) -> np.ndarray:
    """The calibration text's token ids as rows [n, T]: each paragraph encoded as the tokenizer
    encodes a prompt (BOS first where the model adds one), concatenated, the first MAX_TOKENS cut
    into rows of T = min(SEQ_TOKENS, trained positions, sliding window) tokens; the tail that does not fill a row
    is dropped, unless there is no whole row (then one row of all the tokens). Ids past the model's
    vocabulary (a tokenizer larger than the embedding) are dropped: none left gives [1, 0], which
    `too_thin` turns down."""
    text = CALIBRATION_FILE.read_text(encoding="utf-8") if text is None else text
    ids: list[int] = []
    for para in text.split("\n\n"):
        if para.strip():
            ids += [t for t in tokenizer.encode(para.strip()) if 0 <= t < spec.vocab_size]
    t = min(SEQ_TOKENS, spec.max_position_embeddings, spec.sliding_window or SEQ_TOKENS)
    ids = ids[:MAX_TOKENS]
    n = len(ids) // t
    if n == 0:
        return np.array([ids], np.int64)
    return np.array(ids[:n * t], np.int64).reshape(n, t)


MIN_TOKENS, MIN_DISTINCT = 256, 32  # fewer: the fit follows too few inputs (see `too_thin`)


def too_thin(ids: np.ndarray) -> str | None:
    """Why calibration rows cannot stand for what the model reads (None: they can): fewer than
    MIN_TOKENS tokens or MIN_DISTINCT distinct ones (a tokenizer that meets the text as unknown
    tokens). Measured on stories260K, such rows made gptq worse than no calibration at all (asym
    6.3789): every token the same 6.4696 and 6.5661, 8 tokens 6.6379."""
    distinct = len(np.unique(ids)) if ids.size else 0
    if ids.size < MIN_TOKENS or distinct < MIN_DISTINCT:
        return f"{ids.size} tokens, {distinct} distinct (at least {MIN_TOKENS} and {MIN_DISTINCT} needed)"
    return None


def plan(scheme: QuantScheme, folder: Path, info: TokenizerInfo, spec: ArchSpec, log=lambda msg: None,
         check_fp16: bool = False):
    """(calibration ids [n, T] or None, the scheme as it will be done) for a conversion by `scheme`,
    its tokenizer in `folder`: ids for the gptq recipe with some weight at int4 (else nothing to fit,
    and the label says asym), and asym instead when the text reads `too_thin`, with a note. With
    `check_fp16` (`--target cuda`) and nothing to fit, one row of ids still, for `Calibration.peak`
    alone (a row is enough to see the activations' scale, and costs a quarter of the fit's forward).
    ConvertError when the tokenizer cannot be used."""
    from edgeinfer.errors import ConvertError, EdgeInferError
    from edgeinfer.tokenizer import Tokenizer

    fit = scheme.recipe == "gptq" and scheme.weights == "int4" and (
        bool(set(PROJECTIONS) - set(scheme.int8_tensors)) or scheme.embedding == "int4" or scheme.lm_head == "int4")
    if scheme.recipe == "gptq" and not fit:
        scheme = replace(scheme, recipe="asym")  # nothing at int4 to fit: the label says what was done
    if not fit and not check_fp16:
        return None, scheme
    try:
        ids = calibration_ids(Tokenizer(folder, info), spec)
    except (EdgeInferError, ValueError) as e:
        raise ConvertError(f"the source's tokenizer cannot be used: {e}") from None
    if fit:
        thin = too_thin(ids)
        if not thin:
            log(f"calibration: {ids.size} tokens of the shipped text (the gptq recipe)")
            return ids, scheme
        # fitting to so little is worse than not fitting
        log(f"note: the model's tokenizer reads the calibration text as {thin}: int4 takes the asym recipe, "
            "which needs none")
        scheme = replace(scheme, recipe="asym")
    if not check_fp16 or ids.size == 0:
        return None, scheme
    ids = ids[:1]
    log(f"calibration: {ids.size} tokens of the shipped text, to check that the activations fit float16")
    return ids, scheme


def tokens(x: np.ndarray) -> np.ndarray:
    """x [n, T, K] as [n T, K]: one row per calibration token."""
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(eps))) * weight.astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [n, T, heads, Dh] with cos, sin [1, T, 1, Dh/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def project(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [n, T, K] @ w.T ([N, K] as Hugging Face stores it): [n, T, N], float32, one calibration row
    per core at a time (`decoder.build_decoder` holds BLAS to one thread: each row's sums are then
    the same whatever the core count)."""
    wt = np.ascontiguousarray(w.T, np.float32)
    out = np.empty((*x.shape[:2], wt.shape[1]), np.float32)

    def row(r: int) -> None:
        np.matmul(x[r], wt, out=out[r])

    on_cores(row, range(len(x)))
    return out


@dataclass(frozen=True)
class Peak:
    """The largest magnitude an activation reached on the calibration rows, and where."""
    abs_value: float
    where: str


class Calibration:
    """The float model's forward on calibration rows, a layer at a time (steps in the module doc)."""

    def __init__(self, spec: ArchSpec, ids: np.ndarray, embedding_rows: np.ndarray):
        """ids [n, T]; embedding_rows [n, T, D]: the embedding's rows for them (float)."""
        self.spec = spec
        self.x = np.asarray(embedding_rows, np.float32)  # the residual stream
        self.h: np.ndarray | None = None  # the current normed input
        self.ctx: np.ndarray | None = None
        self.act: np.ndarray | None = None
        n, t = ids.shape
        ang = np.arange(t, dtype=np.float32)[:, None] * spec.rope.inv_freq(spec.head_dim).astype(np.float32)[None, :]
        self.cos, self.sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
        pos = np.arange(t)
        allowed = pos[None, :] <= pos[:, None]
        if spec.sliding_window:  # each query sees the last W tokens, itself included
            allowed &= pos[None, :] > pos[:, None] - spec.sliding_window
        self.mask = np.where(allowed, np.float32(0), np.float32(-np.inf))
        self.tokens = n * t
        self.layer = 0
        self.peak = Peak(0.0, "")
        self._watch("the embedding", self.x, in_layer=False)

    def _watch(self, what: str, a: np.ndarray, in_layer: bool = True) -> None:
        """Keep `peak` (a NaN or infinity counts as infinitely large)."""
        m = float(np.max(np.abs(a))) if a.size else 0.0
        m = m if np.isfinite(m) else float("inf")
        if m > self.peak.abs_value:
            self.peak = Peak(m, f"layer {self.layer}'s {what}" if in_layer else what)

    def attention_input(self, ln: np.ndarray) -> np.ndarray:
        self.h = rms_norm(self.x, ln, self.spec.rms_norm_eps)
        self._watch("input norm", self.h)
        return tokens(self.h)

    def attention(self, w_qkv: np.ndarray, b_qkv: np.ndarray | None, q_norm: np.ndarray | None,
                  k_norm: np.ndarray | None) -> np.ndarray:
        s = self.spec
        H, Hkv, Dh = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = project(self.h, w_qkv)
        if b_qkv is not None:
            qkv += b_qkv.astype(np.float32)
        self._watch("q|k|v projection", qkv)
        n, t, _ = qkv.shape
        q = qkv[..., :H * Dh].reshape(n, t, H, Dh)
        k = qkv[..., H * Dh:(H + Hkv) * Dh].reshape(n, t, Hkv, Dh)
        v = qkv[..., (H + Hkv) * Dh:].reshape(n, t, Hkv, Dh)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, s.rms_norm_eps), rms_norm(k, k_norm, s.rms_norm_eps)
        q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
        group = H // Hkv
        k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [n, H, T, Dh] ...
        scores = q @ k * np.float32(1 / np.sqrt(Dh)) + self.mask  # [n, H, T, T]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        self.ctx = (scores @ v).transpose(0, 2, 1, 3).reshape(n, t, H * Dh)
        self._watch("attention", self.ctx)
        return tokens(self.ctx)

    def mlp_input(self, w_o: np.ndarray, b_o: np.ndarray | None, post_ln: np.ndarray) -> np.ndarray:
        out = project(self.ctx, w_o)
        if b_o is not None:
            out += b_o.astype(np.float32)
        self._watch("o_proj", out)
        self.x = self.x + out
        self._watch("residual stream after attention", self.x)
        self.ctx = None
        self.h = rms_norm(self.x, post_ln, self.spec.rms_norm_eps)
        self._watch("post-attention norm", self.h)
        return tokens(self.h)

    def mlp_act(self, w_gate_up: np.ndarray) -> np.ndarray:
        gu = project(self.h, w_gate_up)
        self._watch("gate|up projection", gu)
        gate, up = gu[..., :self.spec.intermediate_size], gu[..., self.spec.intermediate_size:]
        self.act = gate * (np.float32(0.5) * (np.float32(1) + np.tanh(gate * np.float32(0.5)))) * up  # silu(gate) * up
        self._watch("silu(gate) * up", self.act)
        return tokens(self.act)

    def end_layer(self, w_down: np.ndarray) -> None:
        out = project(self.act, w_down)
        self._watch("down_proj", out)
        self.x = self.x + out
        self._watch("residual stream after the MLP", self.x)
        self.act = self.h = None
        self.layer += 1

    def head_input(self, norm: np.ndarray) -> np.ndarray:
        self.h = rms_norm(self.x, norm, self.spec.rms_norm_eps)
        self._watch("the final norm", self.h, in_layer=False)
        return tokens(self.h)

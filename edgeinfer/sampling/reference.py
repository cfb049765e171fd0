"""The sampling chain in plain numpy: the specification the C extension is held equal to.

One token is three steps, each a function here and in sampler_chain.c (llama.cpp's default chain):

1. `adjust_logits(logits, params, history)` -> float64 logits [V]:
   1a. Penalties over the last `penalty_last_n` ids of `history` (0 disables them), in float64:
       with c = count of token t in that window, if c > 0: a positive logit is divided by
       `repetition_penalty`, a negative one multiplied by it; then
       logit -= c * frequency_penalty + presence_penalty.
   1b. Logit bias: logit[t] += bias for each (t, bias) in `logit_bias`.
2. `filter_logits(adjusted, params)` -> float64 probabilities [V], zero outside the kept set:
   2a. If `temperature == 0`: 1 at the argmax (lowest id on ties), 0 elsewhere; stop here.
   2b. Top-k (k > 0 and k < V): keep the k largest logits; ties broken by the lower id.
   2c. Typical (typical_p < 1): p = softmax of the kept logits (temperature 1), H = -sum p log p
       (p > 0); order the kept tokens by |-log p - H| ascending (lower id first on ties) and keep
       the shortest prefix whose mass reaches typical_p.
   2d. Top-p (top_p < 1): p = softmax of the kept logits; order by logit descending (lower id
       first on ties) and keep the shortest prefix whose mass reaches top_p.
   2e. Min-p (min_p > 0): p = softmax of the kept logits; keep p >= min_p * max(p).
   2f. Temperature: divide the kept logits by `temperature`; softmax over the kept tokens.
3. `draw_token(probs, params, rng)` -> token id: temperature 0: the argmax, no RNG used. Else
   u = rng.uniform() in [0, 1); walk the kept tokens in ascending id, accumulating probability;
   the first token whose running sum exceeds u * total is chosen.

`filter_probs` = steps 1-2 and `sample` = steps 1-3. Each filter keeps at least one token. "Mass
reaches x" means running sum >= x (float64). Bad input: NaN or +inf logits, an empty or non-1-D
vector, all logits -inf, history or bias ids outside the vocabulary raise ValueError. -inf logits
are allowed (banned tokens). Logits of another float dtype are converted to float32 first. In
every softmax, a logit at or below `EXP_FLOOR` nats under the largest kept one gets probability 0
(a subnormal in float64 otherwise).
"""

from __future__ import annotations

import numpy as np

from edgeinfer.sampling.params import SamplingParams
from edgeinfer.sampling.rng import Rng

EXP_FLOOR = -708.0  # exp(x) for x <= this is 0 (the C chain's exp: numpy's would give subnormals down to -745)


def check_logits(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1:
        raise ValueError(f"logits must be a 1-D vector, got shape {x.shape}")
    if x.size == 0:
        raise ValueError("logits are empty")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"logits must be floating point, got {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if np.isnan(x).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(x).any():
        raise ValueError("logits contain +inf")
    return x


def check_history(history, vocab: int) -> np.ndarray:
    try:
        h = np.asarray(history if history is not None else [], dtype=np.int64).reshape(-1)
    except OverflowError:  # an id past int64
        raise ValueError(f"history has token ids outside the vocabulary [0, {vocab})") from None
    if h.size and (h.min() < 0 or h.max() >= vocab):
        raise ValueError(f"history has token ids outside the vocabulary [0, {vocab})")
    return h


def adjust_logits(logits, params: SamplingParams, history=None) -> np.ndarray:
    """Step 1: penalties and bias applied to a float64 copy of the checked logits. Mutates nothing."""
    x = check_logits(logits)
    v = x.size
    h = check_history(history, v)
    out = x.astype(np.float64)
    if params.penalty_last_n > 0 and h.size and params.has_penalties:
        window = h[-params.penalty_last_n:]
        ids, counts = np.unique(window, return_counts=True)
        vals = out[ids]
        rp = params.repetition_penalty
        vals = np.where(vals > 0, vals / rp, vals * rp)
        vals = vals - (counts * params.frequency_penalty + params.presence_penalty)
        out[ids] = vals
    for tok, bias in params.logit_bias_items:
        if not 0 <= tok < v:
            raise ValueError(f"logit_bias token id {tok} is outside the vocabulary [0, {v})")
        out[tok] += bias
    if np.isneginf(out).all():
        raise ValueError("all logits are -inf: nothing can be sampled")
    if np.isposinf(out).any():  # SamplingParams' bounds keep this from happening
        raise ValueError("the penalties and logit_bias push a logit to +inf")
    return out


def _softmax(lg: np.ndarray, keep: np.ndarray) -> np.ndarray:
    m = lg[keep].max()
    p = np.zeros_like(lg)
    d = lg[keep] - m
    p[keep] = np.where(d > EXP_FLOOR, np.exp(np.maximum(d, EXP_FLOOR)), 0.0)
    return p / p[keep].sum()


def _prefix_mass(order: np.ndarray, p: np.ndarray, mass: float) -> np.ndarray:
    """Indices (in `order`) of the shortest prefix whose running sum reaches `mass` (>= 1 token)."""
    reached = np.cumsum(p[order]) >= mass
    n = int(np.argmax(reached)) + 1 if reached.any() else order.size
    return order[:n]


def filter_logits(lg: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Step 2: the float64 probability vector over the whole vocabulary that `draw_token` draws from,
    given the float64 logits of `adjust_logits` (not mutated)."""
    v = lg.size
    ids = np.arange(v)
    if params.temperature == 0:  # 2a
        p = np.zeros(v)
        p[int(np.argmax(lg))] = 1.0
        return p
    keep = np.isfinite(lg)
    if 0 < params.top_k < keep.sum():  # 2b
        order = np.lexsort((ids, -lg))  # logit descending, id ascending
        kept = order[:params.top_k]
        keep = np.zeros(v, bool)
        keep[kept] = True
    if params.typical_p < 1.0:  # 2c
        p = _softmax(lg, keep)
        cand = ids[keep]
        with np.errstate(divide="ignore"):
            logp = np.log(p[cand])  # -inf where p underflowed to 0: those tokens sort last
        entropy = -np.sum(p[cand] * np.where(p[cand] > 0, logp, 0.0))
        score = np.abs(-logp - entropy)
        order = cand[np.lexsort((cand, score))]
        kept = _prefix_mass(order, p, params.typical_p)
        keep = np.zeros(v, bool)
        keep[kept] = True
    if params.top_p < 1.0:  # 2d
        p = _softmax(lg, keep)
        cand = ids[keep]
        order = cand[np.lexsort((cand, -lg[cand]))]
        kept = _prefix_mass(order, p, params.top_p)
        keep = np.zeros(v, bool)
        keep[kept] = True
    if params.min_p > 0.0:  # 2e
        p = _softmax(lg, keep)
        keep = keep & (p >= params.min_p * p[keep].max())
    return _softmax(lg / params.temperature, keep)  # 2f


def filter_probs(logits, params: SamplingParams, history=None) -> np.ndarray:
    """Steps 1-2: the float64 probability vector over the whole vocabulary that `sample` draws from."""
    return filter_logits(adjust_logits(logits, params, history), params)


def draw_token(p: np.ndarray, params: SamplingParams, rng: Rng | None = None) -> int:
    """Step 3: one token id from the probabilities of `filter_logits` (argmax when temperature == 0,
    no RNG used; rng=None draws from a fresh unseeded Rng)."""
    if params.temperature == 0:
        return int(np.argmax(p))
    rng = rng if rng is not None else Rng(None)
    kept = np.flatnonzero(p)
    cum = np.cumsum(p[kept])
    target = rng.uniform() * cum[-1]
    i = int(np.searchsorted(cum, target, side="right"))
    return int(kept[min(i, kept.size - 1)])


def sample(logits, params: SamplingParams, history=None, rng: Rng | None = None) -> int:
    """Steps 1-3: one token id drawn from `filter_probs(logits, params, history)`."""
    return draw_token(filter_probs(logits, params, history), params, rng)

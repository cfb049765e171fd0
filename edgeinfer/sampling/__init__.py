"""Sampling: the chain of DESIGN §6, fused in C, with a pure-numpy twin as its specification.

    sampler = Sampler(SamplingParams(temperature=0.8, top_k=40), seed=1)
    token = sampler.sample(logits, history)          # logits: float32 [V]; history: ids so far
    result = sampler.sample_with_logprobs(logits, history, top_n=5)

`BACKEND` is "c" when the extension `_csampler` is loaded, else "numpy" (same results, slower).
The order and meaning of every step are in `edgeinfer.sampling.reference`. Inputs are not
mutated; logits of another float dtype or a non-contiguous array are converted (copied) first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.sampling import reference
from edgeinfer.sampling.params import SamplingParams
from edgeinfer.sampling.rng import Rng, resolve_seed

try:
    from edgeinfer.sampling import _csampler
except ImportError:  # no compiler at install time: the numpy twin does the work
    _csampler = None

BACKEND = "c" if _csampler is not None else "numpy"
_EMPTY = np.zeros(0, np.int64)

__all__ = ["BACKEND", "SampleResult", "Sampler", "SamplingParams", "filter_probs", "logprobs"]


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float  # log-softmax of the penalised, biased logits (temperature 1, whole vocabulary)
    top: tuple[tuple[int, float], ...]  # the top_n (id, logprob) of that distribution, best first


def _logits(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        if x.ndim == 1 and x.size and not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"logits must be floating point, got {x.dtype}")
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"logits must be a 1-D vector, got shape {x.shape}")
    return x


def _history(history) -> np.ndarray:
    if history is None or (hasattr(history, "__len__") and len(history) == 0):
        return _EMPTY
    return np.ascontiguousarray(np.asarray(history, dtype=np.int64).reshape(-1))


def _c_sampler(params: SamplingParams, seed: int | None):
    bias = params.logit_bias_items
    ids = np.array([k for k, _ in bias], np.int64)
    vals = np.array([v for _, v in bias], np.float64)
    return _csampler.Sampler(float(params.temperature), params.top_k, float(params.top_p), float(params.min_p),
                             float(params.typical_p), float(params.repetition_penalty),
                             float(params.frequency_penalty), float(params.presence_penalty), params.penalty_last_n,
                             ids, vals, resolve_seed(seed))


def filter_probs(logits, params: SamplingParams, history=None) -> np.ndarray:
    """The float64 probability vector [V] that `Sampler.sample` draws from (zeros outside the kept set)."""
    if _csampler is None:
        return reference.filter_probs(logits, params, history)
    x = _logits(logits)
    out = np.empty(x.size, np.float64)
    _c_sampler(params, 0).run(x, _history(history), out, False)
    return out


def logprobs(logits, params: SamplingParams, history, token: int, top_n: int = 0) -> SampleResult:
    """Log-probabilities of the penalised, biased distribution at temperature 1 (over all tokens)."""
    lg = reference.adjusted_logits(logits, params, history)
    m = lg.max()
    lse = m + np.log(np.sum(np.exp(lg - m)))
    top: tuple = ()
    if top_n > 0:
        n = min(top_n, lg.size)
        part = np.argpartition(-lg, n - 1)[:n]
        part = part[np.lexsort((part, -lg[part]))]
        top = tuple((int(i), float(lg[i] - lse)) for i in part)
    return SampleResult(int(token), float(lg[token] - lse), top)


class Sampler:
    """Draws tokens with one `SamplingParams`, a seeded RNG it owns, and buffers it reuses.

    Not thread-safe: use one Sampler per conversation. `seed=None` seeds from os.urandom.
    """

    def __init__(self, params: SamplingParams | None = None, seed: int | None = None):
        self.params = params or SamplingParams()
        self.seed = seed = resolve_seed(seed)
        self._c = _c_sampler(self.params, seed) if _csampler is not None else None
        self._rng = Rng(seed) if _csampler is None else None

    def sample(self, logits, history=None) -> int:
        """One token id. `history`: the prompt and generated ids so far (for the penalties)."""
        if self._c is not None:
            return self._c.run(_logits(logits), _history(history), None, True)
        return reference.sample(logits, self.params, history, self._rng)

    def sample_with_logprobs(self, logits, history=None, top_n: int = 0) -> SampleResult:
        """The token and its log-probability (plus the top_n alternatives), computed in C from the
        same penalised, biased logits the chain used; the numpy twin's `logprobs` is the reference."""
        token = self.sample(logits, history)
        if self._c is not None:
            lp, top = self._c.logprobs(token, int(top_n))
            return SampleResult(token, lp, tuple(top))
        return logprobs(logits, self.params, history, token, top_n)

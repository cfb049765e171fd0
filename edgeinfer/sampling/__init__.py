"""Sampling: the chain of DESIGN §6, fused in C, with a pure-numpy twin as its specification.

    sampler = Sampler(SamplingParams(temperature=0.8, top_k=40), seed=1, history=prompt_ids)
    token = sampler.sample(logits)          # logits: float32 [V]
    sampler.accept(token)                   # the penalties count it from the next draw on
    result = sampler.sample_with_logprobs(logits, top_n=5)

`BACKEND` is "c" when the extension `_csampler` is loaded, else "numpy" (same results, slower): no
compiler at install time, or a build from other sources than this code (its API_VERSION is not
`C_API_VERSION`: a RuntimeWarning says to rebuild).
The order and meaning of every step are in `edgeinfer.sampling.reference`. Inputs are not
mutated; logits of another float dtype or a non-contiguous array are converted (copied) first.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass

import numpy as np

from edgeinfer.sampling import reference
from edgeinfer.sampling.params import INT32_MAX, SamplingParams
from edgeinfer.sampling.penalties import PenaltyWindow
from edgeinfer.sampling.rng import Rng, resolve_seed

C_API_VERSION = 2  # what this code calls in `_csampler` (its API_VERSION): run(..., top_n) since 2

try:
    from edgeinfer.sampling import _csampler
except ImportError:  # no compiler at install time: the numpy twin does the work
    _csampler = None
if _csampler is not None and getattr(_csampler, "API_VERSION", 1) != C_API_VERSION:  # built from other sources
    warnings.warn("edgeinfer's compiled sampler was built from other sources than this code (a checkout changed "  # (a
                  "since it was built): using the numpy sampler; rebuild it with pip install -e .", RuntimeWarning)
    _csampler = None  # review: a stale build failed every request for logprobs)

BACKEND = "c" if _csampler is not None else "numpy"
_EMPTY = np.zeros(0, np.int64)
_BAD_ID = "history has token ids outside the vocabulary [0, 2**31 - 1]"  # the C glue's words

__all__ = ["BACKEND", "SampleResult", "Sampler", "SamplingParams", "filter_probs", "logprobs"]


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float  # log-softmax of the penalised, biased logits (temperature 1, whole vocabulary)
    top: tuple[tuple[int, float], ...]  # the top_n (id, logprob) of that distribution, best first


def _logits(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1:  # before a conversion: ascontiguousarray makes a 0-d array 1-D (the twin refuses a scalar)
        raise ValueError(f"logits must be a 1-D vector, got shape {x.shape}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        if x.ndim == 1 and x.size and not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"logits must be floating point, got {x.dtype}")
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x


def _int(value, what: str) -> int:
    """An int (numpy's too), not a bool: TypeError otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got bool")
    return operator.index(value)


def _count(top_n) -> int:
    """top_n checked: an int >= 0."""
    top_n = _int(top_n, "top_n")
    if top_n < 0:
        raise ValueError(f"top_n must be >= 0, got {top_n}")
    return top_n


def _history(history) -> np.ndarray:
    if history is None or (hasattr(history, "__len__") and len(history) == 0):
        return _EMPTY
    try:
        return np.ascontiguousarray(np.asarray(history, dtype=np.int64).reshape(-1))
    except OverflowError:  # an id past int64: outside every vocabulary, as for accept()
        raise ValueError(_BAD_ID) from None


def _c_sampler(params: SamplingParams, seed: int):
    bias = params.logit_bias_items
    return _csampler.Sampler(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        typical_p=params.typical_p, repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        penalty_last_n=params.penalty_last_n, bias_ids=np.array([k for k, _ in bias], np.int64),
        bias_values=np.array([v for _, v in bias], np.float64), seed=seed)


def filter_probs(logits, params: SamplingParams, history=None) -> np.ndarray:
    """The float64 probability vector [V] that `Sampler.sample` draws from (zeros outside the kept set)."""
    if _csampler is None:
        return reference.filter_probs(logits, params, history)
    x = _logits(logits)
    out = np.empty(x.size, np.float64)
    c = _c_sampler(params, 0)
    c.reset(_history(history))
    c.run(x, probs_out=out, draw=False)
    return out


def logprobs(logits, params: SamplingParams, history, token: int, top_n: int = 0) -> SampleResult:
    """Log-probabilities of the penalised, biased distribution at temperature 1 (over all tokens);
    `top`: the top_n most likely, best first, the lower id first on ties, banned (-inf) ones left
    out, as the C sampler gives them. ValueError for a token outside the vocabulary or a negative top_n
    (TypeError for either not an int)."""
    top_n, token = _count(top_n), _int(token, "token")
    lg = reference.adjust_logits(logits, params, history)
    if not 0 <= token < lg.size:
        raise ValueError(f"token {token} is outside the vocabulary [0, {lg.size})")
    m = lg.max()
    lse = m + np.log(np.sum(np.exp(lg - m)))
    top: tuple = ()
    n = min(top_n, int(np.count_nonzero(lg > -np.inf))) if top_n > 0 else 0
    if n > 0:
        least = lg[np.argpartition(-lg, n - 1)[n - 1]]  # the n-th largest value: ties there go by id
        above = np.flatnonzero(lg > least)
        part = np.concatenate([above, np.flatnonzero(lg == least)[:n - len(above)]])
        part = part[np.lexsort((part, -lg[part]))]
        top = tuple((int(i), float(lg[i] - lse)) for i in part)
    return SampleResult(int(token), float(lg[token] - lse), top)


class Sampler:
    """Draws tokens with one `SamplingParams`, and owns what persists between draws: a seeded RNG,
    the penalty history, and buffers it reuses.

    The history is what the penalties count: `history` (e.g. the prompt ids), then every id given
    to `accept` (the tokens generated). Only the last `params.penalty_last_n` are kept, in constant
    memory; none when no penalty is on, which makes `accept` nearly free. Each draw equals
    `reference.sample(logits, params, ids, rng)` with `ids` = history followed by the accepted ids
    and `rng` = Rng(seed) advanced by the earlier draws.

    Ids: the constructor, `accept` and `reset` raise ValueError for an id outside [0, 2**31 - 1];
    `sample` raises ValueError if an id given since the last reset is >= the vocabulary size.
    One Sampler per conversation: with the C back end a call while another thread's runs raises
    RuntimeError (the numpy twin does not check). `seed=None` seeds from os.urandom.
    """

    def __init__(self, params: SamplingParams | None = None, seed: int | None = None, history=()):
        self.params = params or SamplingParams()
        self.seed = seed = resolve_seed(seed)
        self._c = _c_sampler(self.params, seed) if _csampler is not None else None
        plain_greedy = self.params.temperature == 0 and not self.params.has_penalties and not self.params.logit_bias
        self._greedy = self._c.greedy if self._c is not None and plain_greedy else None  # the same tokens, 6x sooner
        self._rng = Rng(seed) if _csampler is None else None
        self._window_n = self.params.penalty_last_n if self.params.has_penalties else 0
        self.reset(history)

    def reset(self, history=()) -> None:
        """Forget the history and start again from `history` (ids); the RNG continues as it is.
        On a bad id (ValueError) the history stays as it was."""
        ids = _history(history)
        if self._c is not None:
            self._c.reset(ids)
            return
        if ids.size and (ids.min() < 0 or ids.max() > INT32_MAX):
            raise ValueError(_BAD_ID)
        self._max_id = int(ids.max()) if ids.size else -1
        self._window = PenaltyWindow(self._window_n, ids)

    def accept(self, token: int) -> None:
        """Append one id (the token just generated) to the history."""
        if self._c is not None:
            self._c.accept(token)
            return
        token = operator.index(token)
        if not 0 <= token <= INT32_MAX:
            raise ValueError(_BAD_ID)
        self._max_id = max(self._max_id, token)
        self._window.push(token)

    def sample(self, logits) -> int:
        """One token id drawn from `logits` (float [V]), penalised by the history."""
        if self._greedy is not None:
            return self._greedy(_logits(logits))
        if self._c is not None:
            return self._c.run(_logits(logits))
        x = reference.check_logits(logits)
        if self._max_id >= x.size:
            raise ValueError(f"history has token ids outside the vocabulary [0, {x.size})")
        return reference.sample(x, self.params, self._window.view(), self._rng)

    def sample_with_logprobs(self, logits, *, top_n: int = 0) -> SampleResult:
        """The token and its log-probability (plus the top_n alternatives), computed in C from the
        same penalised, biased logits the chain used; the numpy twin's `logprobs` is the reference.
        top_n: an int >= 0 (TypeError for a non-integer, ValueError for a negative one, before anything
        is drawn); more than the vocabulary gives all of it. In C the draw and its logprobs are one
        call: another thread's use between them is refused, as for `sample`."""
        top_n = _count(top_n)
        if self._c is not None:
            x = _logits(logits)
            token, lp, top = self._c.run(x, top_n=min(top_n, x.size))  # not greedy(): logprobs need the adjusted logits
            return SampleResult(token, lp, tuple(top))
        token = self.sample(logits)
        return logprobs(logits, self.params, self._window.view(), token, top_n)

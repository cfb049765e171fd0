"""`SamplingParams`: the sampler's settings, validated once at construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from edgeinfer.errors import InvalidArgumentError

INT32_MAX = 2**31 - 1  # the C sampler indexes the vocabulary with int32
MIN_TEMPERATURE = 1e-6  # (0, 1e-6) is refused: 1 / 1e-310 overflows, and the sampler drew garbage
PENALTY_LIMIT = 1e6  # penalties and biases beyond it could push a logit to +inf (the sampler drew garbage)


def is_integer(v) -> bool:
    """An integer, a numpy one included, and not a bool (True is an int in Python)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real number (int, float, a numpy float or int, a Fraction), not a bool. Decimal is not one."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def as_float(v) -> float:
    """`v` as a Python float if it is a real number that a float holds, else NaN (an int past float's
    range is no infinity: only a float -inf is a ban in logit_bias)."""
    if not is_real(v):
        return math.nan
    try:
        return float(v)
    except OverflowError:
        return math.nan


class CheckedBias(Mapping):
    """A checked logit_bias {id: bias}: read-only (a plain dict let NaN in after the check), and,
    unlike a MappingProxyType, it pickles and copies (options sent to another process)."""

    __slots__ = ("_items",)

    def __init__(self, items: dict[int, float]):
        self._items = dict(items)

    def __getitem__(self, token: int) -> float:
        return self._items[token]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)


@dataclass(frozen=True)
class SamplingParams:
    """Settings of the sampling chain (order and meaning: `edgeinfer.sampling.reference`).

    temperature 0 is greedy; top_k 0, top_p 1, min_p 0, typical_p 1, repetition_penalty 1 and
    frequency/presence penalties 0 switch their step off. `logit_bias` maps token id -> added logit
    (a number in [-1e6, 1e6], or -inf to ban the token); it is given as a dict and kept as a
    `CheckedBias`, a read-only Mapping (not a dict: `dict(p.logit_bias)` for JSON), so a later change
    to the caller's dict changes nothing and the checked values cannot be changed. A temperature is
    0 or at least 1e-6; repetition_penalty lies in [1e-6, 1e6] and the frequency and presence
    penalties in [-1e6, 1e6]: within these bounds no penalised or biased logit can reach +inf.

    Integers (top_k, penalty_last_n, logit_bias ids) must lie in [0, 2**31 - 1]: no vocabulary the
    sampler supports is larger, and a larger value is refused rather than overflowing the C types.
    A top_k at or above the vocabulary size keeps every token (the same as 0). Every bad value
    raises `InvalidArgumentError` (an `EdgeInferError` and a `ValueError`) naming the field.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # given: a dict; kept: CheckedBias

    def __post_init__(self) -> None:
        def num(name: str) -> float:
            v = getattr(self, name)
            f = as_float(v)
            if not math.isfinite(f):
                raise InvalidArgumentError(f"{name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, f)  # a numpy scalar is kept as the Python float it is
            return f

        def integer(name: str) -> int:
            v = getattr(self, name)
            if not is_integer(v) or not 0 <= v <= INT32_MAX:
                raise InvalidArgumentError(f"{name} must be an integer in [0, {INT32_MAX}] (0 means off), got {v!r}")
            object.__setattr__(self, name, int(v))
            return int(v)

        t = num("temperature")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise InvalidArgumentError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                       f"{self.temperature}")
        integer("top_k")
        if not 0 < num("top_p") <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= num("min_p") <= 1:
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < num("typical_p") <= 1:
            raise InvalidArgumentError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not 1 / PENALTY_LIMIT <= num("repetition_penalty") <= PENALTY_LIMIT:
            raise InvalidArgumentError(f"repetition_penalty must be in [{1 / PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], "
                                       f"got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not abs(num(name)) <= PENALTY_LIMIT:
                raise InvalidArgumentError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], "
                                           f"got {getattr(self, name)}")
        integer("penalty_last_n")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, (dict, CheckedBias)):  # (the latter: `replace` of a checked one)
                raise InvalidArgumentError("logit_bias must be a dict {token_id: bias}")
            bias = {}  # checked as copied: the caller's dict may change later, or meanwhile
            for k, v in dict(self.logit_bias).items():
                if not is_integer(k) or not 0 <= k <= INT32_MAX:
                    raise InvalidArgumentError(f"logit_bias keys must be token ids in [0, {INT32_MAX}], got {k!r}")
                f = as_float(v)
                if not (f == -math.inf or abs(f) <= PENALTY_LIMIT):
                    raise InvalidArgumentError(f"logit_bias[{k}] must be a number in [-{PENALTY_LIMIT:g}, "
                                               f"{PENALTY_LIMIT:g}] or -inf, got {v!r}")
                bias[int(k)] = f
            object.__setattr__(self, "logit_bias", CheckedBias(bias))  # read-only: checked once, it stays so
            # (a writable copy let NaN in after the check: every token became <unk>)

    def check_vocabulary(self, vocab_size: int) -> None:
        """InvalidArgumentError naming the first logit_bias id at or past the model's vocabulary."""
        bad = next((t for t in self.logit_bias or {} if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

"""`SamplingParams`: the sampler's settings, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Settings of the sampling chain (order and meaning: `edgeinfer.sampling.reference`).

    temperature 0 is greedy; top_k 0, top_p 1, min_p 0, typical_p 1, repetition_penalty 1 and
    frequency/presence penalties 0 switch their step off. `logit_bias` maps token id -> added logit.
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
    logit_bias: dict[int, float] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
            return v

        if num("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if integer("top_k") < 0:
            raise ValueError(f"top_k must be >= 0 (0 means off), got {self.top_k}")
        if not 0 < num("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= num("min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < num("typical_p") <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if num("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        num("frequency_penalty")
        num("presence_penalty")
        if integer("penalty_last_n") < 0:
            raise ValueError(f"penalty_last_n must be >= 0 (0 means off), got {self.penalty_last_n}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a dict {token_id: bias}")
            for k, v in self.logit_bias.items():
                if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {k!r}")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v == math.inf:
                    raise ValueError(f"logit_bias[{k}] must be a number or -inf, got {v!r}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

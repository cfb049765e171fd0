"""`GenerationOptions`: everything a request may set besides the prompt, declared once with its defaults.

The API (`Model.generate / stream`, `Conversation.say / stream_say / reply`), the CLI (its flags'
defaults come from here) and the daemon's request mapping all build one with `from_kwargs`, which
takes the flat keyword form (`max_new_tokens=64, temperature=0, stop="."`). The sampler's own
settings live in `SamplingParams` (defaults declared there, once) inside `sampling`.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from edgeinfer.errors import InvalidArgumentError, InvalidArgumentTypeError
from edgeinfer.sampling import SamplingParams
from edgeinfer.sampling.params import is_integer

SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
SPECULATIVE = ("ngram", "draft")  # drafters for speculative decoding (edgeinfer/speculative.py)


@dataclass(frozen=True)
class GenerationOptions:
    """max_new_tokens: a positive int; stop: strings that end the reply (not included in its text);
    seed: None (random) or any int; ignore_eos: keep going past the model's end-of-sequence token;
    sampling: the chain's settings (temperature 0 is greedy); speculative: None (plain decoding) or
    "ngram" (prompt-lookup drafts checked in one graph call: the same tokens, sooner, on text that
    repeats itself; `speculative.py`) or "draft" (drafts by the small model of the same tokenizer
    that `Model.set_draft` attached); penalize_prompt: the penalties (`sampling`'s repetition, frequency
    and presence penalties, over its last `penalty_last_n` ids) count the prompt's ids (a
    conversation's earlier turns too) as well as the reply's, as llama.cpp does (True), or the
    reply's alone (False: OpenAI's rule for its frequency and presence penalties, which the daemon
    applies over the whole reply). Bad values raise InvalidArgumentError (most values of a wrong type
    too: `seed="a"`, `stop=5`); an unknown option, or a `sampling` that is not a SamplingParams,
    InvalidArgumentTypeError."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculative: str | None = None
    penalize_prompt: bool = True

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if not is_integer(n) or n <= 0:
            raise InvalidArgumentError(f"max_new_tokens must be a positive integer, got {n!r}")
        object.__setattr__(self, "max_new_tokens", int(n))
        stop = self.stop
        stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
            raise InvalidArgumentError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        for s in stops:  # a lone surrogate is no text a reply can hold (the prompt's are refused): it never matched
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgumentError(f"stop {s!r:.60} is not valid UTF-8 text (a lone surrogate)") from None
        object.__setattr__(self, "stop", tuple(stops))
        if self.seed is not None:
            if not is_integer(self.seed):
                raise InvalidArgumentError(f"seed must be an integer or None, got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        for name in ("ignore_eos", "penalize_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.speculative is not None and (not isinstance(self.speculative, str) or self.speculative not in SPECULATIVE):
            raise InvalidArgumentError(f"speculative must be None or one of {', '.join(map(repr, SPECULATIVE))}, "
                                       f"got {self.speculative!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentTypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")

    @classmethod
    def from_kwargs(cls, **options) -> "GenerationOptions":
        """The flat keyword form; an unknown keyword is an InvalidArgumentTypeError naming it."""
        own = {f.name for f in fields(cls)} - {"sampling"}
        unknown = sorted(set(options) - own - set(SAMPLING_FIELDS))
        if unknown:
            known = ", ".join(sorted(own | set(SAMPLING_FIELDS)))
            raise InvalidArgumentTypeError(f"unknown generation option {unknown[0]!r} (known: {known})")
        sampling = SamplingParams(**{k: v for k, v in options.items() if k in SAMPLING_FIELDS})
        return cls(**{k: v for k, v in options.items() if k in own}, sampling=sampling)


def resolve(options: GenerationOptions | None, overrides: dict) -> GenerationOptions:
    """`options` (or the defaults) with flat keyword `overrides` applied on top."""
    if options is None:
        return GenerationOptions.from_kwargs(**overrides)
    if not isinstance(options, GenerationOptions):
        raise InvalidArgumentTypeError(f"options must be a GenerationOptions, got {type(options).__name__}")
    if not overrides:
        return options
    flat = {f.name: getattr(options, f.name) for f in fields(GenerationOptions) if f.name != "sampling"}
    flat.update({name: getattr(options.sampling, name) for name in SAMPLING_FIELDS})
    return GenerationOptions.from_kwargs(**{**flat, **overrides})


def default(name: str):
    """The default of one flat option (for CLI flags and docs)."""
    for cls in (GenerationOptions, SamplingParams):
        for f in fields(cls):
            if f.name == name:
                return f.default if f.default is not MISSING else f.default_factory()
    raise KeyError(name)


__all__ = ["GenerationOptions", "SAMPLING_FIELDS", "default", "resolve"]

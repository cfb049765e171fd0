"""What a request gives back: `Completion` (with its `Usage` and `Timings`) and a stream's `Chunk`s."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    dropped_tokens: int  # prompt tokens truncated plus tokens the ring forgot during this request
    cached_tokens: int = 0  # prompt tokens not prefilled again: a reused prefix the cache held, or the tokens
    # a conversation's earlier turns fed (of which a full ring under shift has forgotten the oldest)


@dataclass(frozen=True)
class Timings:
    load_ms: float
    ttft_ms: float
    tpot_ms: float
    prefill_tok_s: float
    decode_tok_s: float  # wall-clock: includes time paced
    paced_ms: float = 0.0  # time the power plan's pacing slept between tokens


@dataclass(frozen=True)
class Completion:
    """A finished request: its text and ids, why it ended, its token counts and its timings (each
    field's meaning beside it)."""

    text: str  # generated text, without the stop string that ended it
    token_ids: tuple[int, ...]  # generated ids (no EOS; a stop string's tokens are included)
    finish_reason: str  # "eos", "stop" or "length"
    usage: Usage
    timings: Timings


@dataclass(frozen=True)
class Chunk:
    """One step of a stream: the text released, the token that made it, and its log-probabilities
    when asked for (each field's meaning beside it; the daemon asks, for a request's `logprobs`:
    `Model.stream` has no such option, and leaves them None and ())."""

    text: str  # may be "" while a UTF-8 character or a possible stop string is incomplete
    token_id: int | None  # None only for a final chunk that flushes held-back text
    logprob: float | None = None  # with `logprobs`: the token's log-probability (penalised, biased, T=1)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # with `logprobs` = n > 0: the n best (id, logprob)
    piece: str = ""  # the text the token added, before the stop filter held any back ("" while a character is
    # incomplete): what the daemon releases a token's logprobs in step with

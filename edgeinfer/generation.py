"""The generation loop shared by `generate`, `stream` and conversations, and its result types.

Steps of one request (`run`):
1. Validate the options; build the `Sampler` (seeded) for this request.
2. Fit the prompt to the ring by the overflow policy (shift: everything goes in, the ring forgets
   the oldest; truncate: drop the oldest prompt tokens after the sinks, reported; error: refuse).
3. Prefill the prompt in chunks; sample the first token (time to first token ends here).
4. Decode one token at a time: sample, detokenize incrementally, hold back text that may be the
   start of a stop string, stop on EOS / stop string / max_new_tokens / a full ring that may not shift.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from edgeinfer.engine import Engine
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.kv_cache import ContextOverflowError, RingKVCache
from edgeinfer.sampling import Sampler, SamplingParams
from edgeinfer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    dropped_tokens: int  # prompt tokens truncated plus tokens the ring forgot during this request


@dataclass(frozen=True)
class Timings:
    load_ms: float
    ttft_ms: float
    tpot_ms: float
    prefill_tok_s: float
    decode_tok_s: float


@dataclass(frozen=True)
class Completion:
    text: str  # generated text, without the stop string that ended it
    token_ids: tuple[int, ...]  # generated ids (no EOS; a stop string's tokens are included)
    finish_reason: str  # "eos", "stop" or "length"
    usage: Usage
    timings: Timings


@dataclass(frozen=True)
class Chunk:
    text: str  # may be "" while a UTF-8 character or a possible stop string is incomplete
    token_id: int | None  # None only for a final chunk that flushes held-back text


@dataclass(frozen=True)
class Request:
    params: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool


def make_request(max_new_tokens: int = 128, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, typical_p: float = 1.0, repetition_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, penalty_last_n: int = 64,
                 logit_bias: dict[int, float] | None = None, stop: str | Sequence[str] | None = None,
                 seed: int | None = None, ignore_eos: bool = False) -> Request:
    """Validate generation options: a bad value raises InvalidArgumentError (an EdgeInferError and a
    ValueError) naming the option; an unknown keyword is Python's TypeError naming it.

    max_new_tokens: a positive int; stop: None, a non-empty string, or a list/tuple of them; seed:
    None (random) or any int (masked to 64 bits); the sampling options: see `SamplingParams`.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidArgumentError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or any(not isinstance(s, str) or not s for s in stops):
        raise InvalidArgumentError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgumentError(f"seed must be an integer or None, got {seed!r}")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                            repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty, penalty_last_n=penalty_last_n, logit_bias=logit_bias)
    return Request(params, max_new_tokens, tuple(stops), seed, bool(ignore_eos))


class PenaltyWindow:
    """The last `n` ids (prompt, then generated) for the penalties, in a buffer of 2n: constant
    memory however long generation runs; `view()` is a contiguous slice, no copy."""

    def __init__(self, n: int, prompt: list[int]):
        self.n = n
        self.buf = np.zeros(max(2 * n, 1), np.int64)
        tail = prompt[-n:] if n else []
        self.buf[:len(tail)] = tail
        self.end = len(tail)

    def push(self, token: int) -> None:
        if not self.n:
            return
        if self.end == self.buf.size:  # full: keep the last n - 1, then append
            self.buf[:self.n - 1] = self.buf[self.end - self.n + 1:self.end]
            self.end = self.n - 1
        self.buf[self.end] = token
        self.end += 1

    def view(self) -> np.ndarray | None:
        return self.buf[max(0, self.end - self.n):self.end] if self.n else None


class Detokenizer:
    """Incremental decode of generated tokens, seeded with the prompt's last ids as left context.

    Contract: the texts `add` returns, joined, are exactly what the generated ids add after the
    context: decode(context + ids) minus its prefix decode(context). So the first token keeps its
    leading space (decoders drop a leading space at the start of a decode: "▁time" alone is "time",
    after "Once upon a" it is " time"). With no context, they join to decode(ids). Each call decodes
    the new tokens with a little left context (the last emitted tokens), and holds text back while
    it ends in an incomplete UTF-8 character. A context that ends inside a character (a prompt of
    ids cut mid-character) has that character's text come with the first token that completes it.
    """

    CONTEXT = 8  # prompt ids kept as left context: enough for a leading space or a split character

    def __init__(self, tok: Tokenizer, context: Sequence[int] = ()):
        self.tok = tok
        # the context window (prompt tail, later the last emitted tokens) + tokens not yet turned into text
        self.ids: list[int] = [int(t) for t in context[-self.CONTEXT:]]
        self.read = len(self.ids)  # how many of `ids` are already text
        for _ in range(3):  # a character split across the end of the context is decoded with the new tokens
            if not self.read or not tok.decode(self.ids[:self.read]).endswith("\ufffd"):
                break
            self.read -= 1

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[:self.read])
        after = self.tok.decode(self.ids)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        del self.ids[:self.read]  # the new tokens become the next call's left context
        self.read = len(self.ids)
        return after[len(before):]


class StopFilter:
    """Emits text as it comes, except a tail that could still become one of the stop strings."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""  # everything generated (cut at a stop string once found)
        self.emitted = 0
        self.stopped = False

    def feed(self, new: str) -> str:
        if self.stopped:
            return ""
        self.text += new
        if not self.stops:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        longest = max(map(len, self.stops))
        start = max(0, self.emitted - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def truncate_reserve(capacity_tokens: int, max_new_tokens: int) -> int:
    """Slots `truncate` keeps free for the reply: max_new_tokens, but at most half the ring (a huge
    max_new_tokens must not cut the prompt to nothing; the reply then ends "length" when the ring is full)."""
    return min(max_new_tokens, capacity_tokens // 2)


def fit_prompt(cache: RingKVCache, ids: list[int], overflow: str, max_new_tokens: int) -> tuple[list[int], int]:
    """Apply the overflow policy to a prompt about to enter `cache`; returns (ids to feed, dropped count).

    shift: everything goes in (the ring forgets its oldest tokens after the sinks as it must).
    error: the prompt must fit the free slots, else ContextOverflowError stating the counts.
    truncate: the prompt plus `truncate_reserve` slots must fit; if not, the oldest prompt tokens after
    the first n_sink (the sinks: BOS and the start of a system prompt, when the cache is empty) are
    dropped, exactly as many as needed, and reported.
    """
    room = cache.capacity - cache.n_valid
    if overflow == "shift" or len(ids) <= room and overflow == "error":
        return ids, 0
    if overflow == "error":
        raise ContextOverflowError(
            f"prompt of {len(ids)} tokens does not fit: the context holds {cache.n_valid} of "
            f"{cache.capacity} tokens, {room} free (overflow='error'; use 'shift' or 'truncate', or a larger "
            f"capacity_tokens)")
    budget = max(1, room - truncate_reserve(cache.capacity, max_new_tokens))
    if len(ids) <= budget:
        return ids, 0
    keep_head = min(cache.n_sink, budget - 1) if cache.n_valid == 0 else 0
    kept = ids[:keep_head] + ids[len(ids) - (budget - keep_head):]
    return kept, len(ids) - len(kept)


STOP_MARKS = 64  # how many recent tokens' cache marks a request keeps, to take a stop string back out


def run(engine: Engine, tok: Tokenizer, cache: RingKVCache, prompt_ids: list[int], req: Request, overflow: str,
        load_ms: float, result: dict) -> Iterator[Chunk]:
    """Yield one Chunk per generated token; at the end set result["completion"] (a Completion).

    `result` is complete before the last chunk is yielded, so a caller that stops right after the
    final chunk (it has all the text) still has the whole completion. Mutates `cache`: the context
    grows by the prompt and the generated tokens, except
    - the last sampled token, not fed back: result["unfed"] (for a conversation's next turn);
    - on a stop string, the tokens that carry it (and anything after it) are taken back out
      (`rewind`), so that the cache holds exactly result["cached_text"] after the prompt; if the ring
      already evicted or moved older tokens meanwhile, result["cache_stale"] is True instead.
    """
    sampler = Sampler(req.params, req.seed)
    vocab = engine.spec.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    bad = [t for t in (req.params.logit_bias or {}) if not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
    eos = set() if req.ignore_eos else set(tok.eos_ids)
    feed, dropped = fit_prompt(cache, prompt_ids, overflow, req.max_new_tokens)
    dropped_before = cache.dropped
    last_n = req.params.penalty_last_n if req.params.has_penalties else 0
    window = PenaltyWindow(last_n, feed)
    detok, stops = Detokenizer(tok, prompt_ids), StopFilter(req.stop)
    generated: list[int] = []
    finish = "length"
    # (tokens fed, text length they make, no text pending, cache mark) for the last tokens, if stop strings
    marks: deque = deque(maxlen=STOP_MARKS if req.stop else 1)
    text_len = 0

    t0 = time.perf_counter()
    logits = engine.prefill(cache, feed)
    marks.append((0, 0, True, cache.mark()))
    t_prefill = time.perf_counter()
    t_first = t_prefill
    while True:
        token = sampler.sample(logits, window.view())
        if not generated:
            t_first = time.perf_counter()
        if token in eos:
            finish, final = "eos", None
            break
        generated.append(token)
        window.push(token)
        piece = detok.add(token)
        text = stops.feed(piece)
        if stops.stopped:
            finish, final = "stop", Chunk(text, token)
            break
        if len(generated) >= req.max_new_tokens or (cache.full and overflow != "shift"):
            final = Chunk(text + stops.flush(), token)
            break
        yield Chunk(text, token)
        logits = engine.decode_one(cache, token)
        text_len += len(piece)
        if req.stop:
            marks.append((len(generated), text_len, detok.read == len(detok.ids), cache.mark()))
    if final is None:  # eos: what the stop filter held back
        rest = stops.flush()
        final = Chunk(rest, None) if rest else None
    t_end = time.perf_counter()
    n = len(generated)
    decode_s = t_end - t_first
    unfed, cached_text, stale = (generated[-1:] if finish == "length" else []), stops.text, False
    if finish == "stop":  # keep in the cache only whole tokens of the text before the stop string
        kept = [(j, length, m) for j, length, clean, m in marks if clean and length <= len(stops.text)]
        stale = not kept or not cache.rewind(kept[-1][2])
        cached_text = stops.text[:kept[-1][1]] if kept else ""
    result.update(unfed=unfed, cached_text=cached_text, cache_stale=stale, completion=Completion(
        text=stops.text, token_ids=tuple(generated), finish_reason=finish,
        usage=Usage(len(prompt_ids), n, dropped + cache.dropped - dropped_before),
        timings=Timings(load_ms=load_ms, ttft_ms=(t_first - t0) * 1e3,
                        tpot_ms=decode_s * 1e3 / (n - 1) if n > 1 else 0.0,
                        prefill_tok_s=len(feed) / max(t_prefill - t0, 1e-9),
                        decode_tok_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0)))
    if final is not None:
        yield final

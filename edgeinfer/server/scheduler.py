"""Slots and the bounded queue: who generates now, who waits, who is turned away at once.

A slot is a KV ring of its own over the one shared Model (weights, session, Engine). `slots`
requests generate at once; up to `queue` more wait for a free slot, first come first served (a
freed slot goes to the request admitted earliest, so a waiting request is never overtaken); one
more is refused at once (`QueueFull`, answered 429). When the model's KV mode appends in place
(GroupQueryAttention), the slots are rows of one `BatchedKV` and their decode steps run as one graph call (`DecodeBatcher`:
continuous batching, requests join and leave between steps); otherwise their graph calls
interleave on the Engine's lock, step by step. Either way no request waits for another's whole reply. Prefix reuse: each slot remembers the token ids its ring
holds; a request takes a free slot by `choose_slot` (the one whose cache it extends, else an empty or
the least recently used one), keeps the prefix that slot shares with its prompt
(`RingKVCache.keep_prefix`) and prefills only the rest (a chat that re-sends its history each turn
prefills only the new turn; at accuracy level 4 the reply then equals a cold start's but for a
near-tie: `prefix_cache`).

A `Job` runs one request in a worker thread and hands its events (chunks, then the end) to the
event loop; `cancel()` (the client went away) stops it within one token and frees its slot.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from edgeinfer.batching import DecodeBatcher, SoloStepper
from edgeinfer.generation import Generation, GenerationCancelled, Request
from edgeinfer.results import Chunk, Completion
from edgeinfer.kv_cache import BatchedKV, RingKVCache
from edgeinfer.options import GenerationOptions
from edgeinfer.prefix_cache import common_prefix, held_after, keepable, reuse


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


class Closed(Exception):
    """The server is shutting down: `close` was called, and no request is admitted any more."""


STALLED_S = 30.0  # a stream whose waiting tokens none were taken for this long is cancelled (its client stopped
MAX_UNREAD_CHUNKS = 4096  # reading); so is one with more than this many waiting (about 12 MB with 20 top logprobs)
STALLED_COUNT_S = 2.0  # and none taken for this long: a client that reads steadily, if slowly, is not cut
STALLED_REASON = "the client stopped reading this stream, so it was cancelled"


class Cancelled(Exception):
    """The request was cancelled (its client went away, or the server is shutting down); the message says which."""


@dataclass
class Slot:
    index: int
    cache: RingKVCache
    ids: list[int] | None = None  # the tokens the ring holds, in order (None: not known exactly)
    last_used: int = 0
    prompt_tokens: int = 0  # the prompt of the request that filled `ids` (the rest is its reply)


def generation_cue(model, variables: dict | None = None) -> tuple[int, ...]:
    """The token ids of the chat template's generation cue (what add_generation_prompt appends:
    ChatML's "<|im_start|>assistant\n"; with Qwen3's enable_thinking false, and the empty think block
    after it: `variables`, as a request gives them); () when unknown. A template may render it otherwise
    once the reply follows in the history (DeepSeek-R1's "<｜Assistant｜><think>\n" becomes
    "<｜Assistant｜>" and the reply), so a chat's next turn may leave a prompt's closing cue out
    (`choose_slot`)."""
    try:  # the ids a prompt ends with, in context (encoded alone, SentencePiece would add a leading space)
        msgs = [{"role": "user", "content": "x"}]
        t = model.template
        cued = model.encode_chat(msgs, variables)  # as a prompt is encoded (a variable's control string: text)
        base = model.encode_rendered(t.render(msgs, add_generation_prompt=False, defuse=model.tokenizer.defuse,
                                              variables=variables))
    except Exception:  # noqa: BLE001 - a template that fails here fails its requests with a clear error
        return ()
    return tuple(cued[common_prefix(cued, base):])


def choose_slot(free: list[Slot], prompt: list[int], keep: Callable[[list[int] | None], int] | None = None,
                cue: tuple[int, ...] = ()) -> Slot:
    """The free slot (`free`: not empty) a request for `prompt` takes. Deterministic: it depends only
    on the slots' remembered ids, `prompt_tokens`, `last_used` and `index`, and on the prompt.
    keep(ids): how many of the prompt's tokens a slot holding `ids` would keep (the scheduler's:
    `prefix_cache.keepable`, which keeps none of a prompt longer than the ring, say; default: the
    common prefix, less the two tokens `reuse` always feeds).

    1. A slot whose last prompt the new one starts with, whole (a chat's next turn re-sends the
       prompt and the reply; a retry or a regenerate sends the prompt again), but for its closing
       `cue` when it ended with one (`generation_cue`: a cue the template renders otherwise after a
       reply), and that keeps some of it. Of those, the most kept; then the least recently used.
    2. Else a slot holding nothing known (never used, or emptied: ids None), so that a request that
       shares only a part (the template's system prompt, BOS) does not take another conversation's
       cache while a slot is idle.
    3. Else the slot that keeps the most (a shared system prompt), then the least recently used, then
       the lowest index.

    Before (2026-12-01), any common prefix won (BOS beat an empty slot), and then any prefix of half
    what the slot held: two users sharing a 425-token system prompt kept taking one slot, each turn
    re-prefilling the other's history, and a regenerate after a long reply was prefilled cold.
    """
    def kept(slot: Slot) -> int:
        if not slot.ids:
            return 0
        return keep(slot.ids) if keep is not None else max(0, min(common_prefix(slot.ids, prompt), len(prompt) - 2))

    counts = {slot.index: kept(slot) for slot in free}
    def continued(s: Slot) -> bool:
        if not counts[s.index]:
            return False
        n = s.prompt_tokens
        slack = len(cue) if cue and tuple(s.ids[max(0, n - len(cue)):n]) == cue else 0
        return common_prefix(s.ids, prompt) >= n - slack

    continuing = [s for s in free if continued(s)]
    if continuing:
        return min(continuing, key=lambda s: (-counts[s.index], s.last_used, s.index))
    empty = [s for s in free if not s.ids]
    if empty:
        return min(empty, key=lambda s: (s.last_used, s.index))
    return min(free, key=lambda s: (-counts[s.index], s.last_used, s.index))


class Scheduler:
    def __init__(self, model, slots: int, queue: int):
        self.model = model
        engine = model.engine
        # The model's own ring is the server's from now on, taken last: a refusal before (memory, a
        # Ctrl-C) leaves the model as it was. With a batch it is dropped (the batch's rows are the slots).
        if engine.mode.in_place and slots > 1:
            kv = BatchedKV(model.manifest.arch, slots, model.capacity_tokens, model.n_sink, engine.max_chunk, engine.mode,
                           dtype=engine.kv_dtype)
            model.lend_default_cache("a server")
            caches, self.stepper = kv.caches, DecodeBatcher(engine, kv)
        else:  # slot 0 is the model's own ring
            more = [model.new_cache() for _ in range(1, slots)]
            caches, self.stepper = [model.lend_default_cache("a server")] + more, SoloStepper(engine)
        for c in caches:  # the slots' memory taken now, not under the first burst (`commit_memory`)
            c.commit_memory()
        self.slots = [Slot(i, c) for i, c in enumerate(caches)]
        self.cue = generation_cue(model)
        self._cues: dict[str, tuple[int, ...]] = {}  # `cue_for`'s, by the variables' JSON
        self.queue_limit = queue
        self._free = list(self.slots)
        self._cond = threading.Condition()
        self.waiting = 0  # admitted, not yet in a slot
        self._tickets = itertools.count(1)
        self._line: deque[int] = deque()  # the waiting requests' tickets, in the order they were admitted
        self._clock = 0
        self.prefix_hits = 0  # requests that reused a cached prefix
        self.cached_tokens = 0  # prompt tokens not prefilled thanks to that
        self.jobs: set[Job] = set()  # admitted and not finished (for cancel_all)
        self.cancel_reason = "the request was cancelled"  # what a cancelled job's error says
        self.closed = False  # shutting down: admit refuses (set with in_flight read under one lock: `close`)

    def after_fork_idle(self) -> None:
        """In a forked child of a server with nothing in flight (`Server.forked`): locks of its own,
        since another thread of the parent may have held one for a moment at the fork (a count read
        as a request arrived, a finished job's last bookkeeping), and the child then hung at its
        first request (a review)."""
        self._cond = threading.Condition()
        self.stepper.after_fork_idle()

    @property
    def busy(self) -> int:
        return len(self.slots) - len(self._free)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self.busy + self.waiting

    @property
    def full(self) -> bool:
        """Whether `admit` would raise QueueFull now (read before a request is tokenized, so that one
        turned away costs no tokenizing; `admit` checks again after). Not while closing: `admit`
        then raises Closed, a 503 (retry elsewhere), not a 429 (retry here)."""
        with self._cond:
            return not self.closed and self._full()

    def _full(self) -> bool:  # under _cond
        return self.waiting - len(self._free) >= self.queue_limit  # those beyond the free slots would queue

    def admit(self) -> int:
        """Reserve a place (a free slot or the queue), or raise QueueFull at once. Returns the request's
        ticket, its place in line: pass it to `take`, or to `withdraw` if the request never gets there."""
        with self._cond:
            if self.closed:
                raise Closed
            if self._full():
                raise QueueFull
            self.waiting += 1
            ticket = next(self._tickets)
            self._line.append(ticket)
            return ticket

    def close(self) -> int:
        """Admit nothing more (shutdown); returns how many requests are in flight. Under the lock that
        `admit` takes: a request is either counted here or refused (Closed), never admitted after the
        drain counted none (a request read as SIGTERM came was admitted and then cut off: a bare 500)."""
        with self._cond:
            self.closed = True
            return self.busy + self.waiting

    def withdraw(self, ticket: int) -> None:
        """Give up an admitted request's place without taking a slot."""
        with self._cond:
            self._leave_line(ticket)

    def _leave_line(self, ticket: int) -> None:  # under _cond
        self._line.remove(ticket)
        self.waiting -= 1
        self._cond.notify_all()  # the next in line may now be first

    def cancel_all(self) -> None:
        """Stop every request (shutdown): each stops at its next prefill chunk or token, or leaves the queue."""
        self.cancel_reason = "the server shut down before this request finished"
        with self._cond:
            jobs = list(self.jobs)
        for job in jobs:
            job.cancel()

    CUES = 16  # `cue_for`'s kept (requests give one or two sets of variables: Qwen3's thinking on and off)

    def cue_for(self, variables: dict | None) -> tuple[int, ...]:
        """`generation_cue` with a request's template variables (`cue` without): a review found a chat's
        next turn with Qwen3's enable_thinking false taken for a new prompt, its whole history prefilled
        cold in another slot, because the cue it ends with has the empty think block."""
        if not variables:
            return self.cue
        key = json.dumps(variables, sort_keys=True)
        with self._cond:
            cue = self._cues.get(key)
        if cue is None:
            cue = generation_cue(self.model, variables)
            with self._cond:
                if len(self._cues) >= self.CUES:
                    self._cues.clear()
                self._cues[key] = cue
        return cue

    def take(self, ticket: int, prompt: list[int], cancelled: threading.Event,
             max_new_tokens: int, cue: tuple[int, ...] | None = None) -> tuple[Slot, int]:
        """Wait until a slot is free and `ticket` (from `admit`) is first in line; returns the slot
        `choose_slot` picks (`cue`: the prompt's generation cue, `cue_for`; default the template's own)
        and how many prompt tokens it already holds. Raises Cancelled (its place given up) once
        `cancelled` is set while it waits."""
        with self._cond:
            while not (self._free and self._line[0] == ticket):
                if cancelled.is_set():
                    self._leave_line(ticket)
                    raise Cancelled(self.cancel_reason)
                self._cond.wait(timeout=0.1)
            self._leave_line(ticket)
            m = self.model
            best = choose_slot(self._free, prompt,
                               lambda ids: keepable(ids, prompt, m.capacity_tokens, m.overflow, max_new_tokens),
                               self.cue if cue is None else cue)
            self._free.remove(best)
            self._clock += 1
            best.last_used = self._clock
        try:
            kept = reuse(best.ids, prompt, best.cache, self.model.overflow, max_new_tokens)
        except BaseException:  # the slot is not this request's after all: back to the free list
            best.ids = None
            self.give_back(best)
            raise
        if kept:
            self.prefix_hits += 1
            self.cached_tokens += kept
        else:
            best.ids = None
        return best, kept

    def give_back(self, slot: Slot) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()


class Job:
    """One request: generation in a worker thread, events for the event loop in `events`.

    Events: ("chunk", Chunk), then exactly one of ("done", Completion, cached_tokens) or
    ("error", exception). Nothing after that.
    """

    def __init__(self, scheduler: Scheduler, ticket: int, prompt: list[int], options: GenerationOptions,
                 logprobs: int | None, loop: asyncio.AbstractEventLoop, streamed: bool = False,
                 refusal: Callable[[], Exception | None] | None = None, cue: tuple[int, ...] | None = None):
        """ticket: the request's place in line (`Scheduler.admit`); streamed: its reply is a stream, whose
        client may stop reading (`_stalled`; a whole reply's events are taken as they come); refusal: asked
        once the job has its slot, an exception to end with instead of generating (a background request
        the power plan now refuses: admitted while cool, it ran hot after its wait; a hostile round); cue:
        the prompt's generation cue (`Scheduler.cue_for`), for the slot's choice."""
        self.refusal, self.cue = refusal, cue
        self.scheduler, self.ticket, self.prompt, self.options, self.logprobs = scheduler, ticket, prompt, options, logprobs
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.streamed = streamed
        self.sent = self.taken = 0  # chunks emitted (the worker's count) and taken by the reply (the loop's)
        self.taken_at = 0.0  # when the reply last took an event (the loop's clock reading)
        self.waiting_since = 0.0  # when the oldest chunk not yet taken was emitted (the worker's)
        self.stalled = False  # cancelled as `_stalled`
        with scheduler._cond:
            scheduler.jobs.add(self)

    def cancel(self) -> None:
        self.cancelled.set()

    def _emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next_event(self) -> tuple:
        """The next event, for the reply (on the event loop); `ready_event` the same without waiting (None)."""
        return self._took(await self.events.get())

    def ready_event(self) -> tuple | None:
        return None if self.events.empty() else self._took(self.events.get_nowait())

    def _took(self, event: tuple) -> tuple:
        self.taken += event[0] == "chunk"
        self.taken_at = time.monotonic()
        return event

    def run(self) -> None:
        end = None  # the last event, sent once the slot is free again: a client that sends its next
        try:        # request on hearing the end (a chat's next turn) finds the slot and its prefix
            try:
                slot, cached = self.scheduler.take(self.ticket, self.prompt, self.cancelled, self.options.max_new_tokens,
                                                   self.cue)
            except BaseException as e:  # noqa: BLE001 - cancelled, or failed: reported, or the request waits for ever
                end = ("error", Cancelled(self.scheduler.cancel_reason) if isinstance(e, Cancelled) else e)
                return
            try:
                refused = self.refusal() if self.refusal is not None else None
                if refused is not None:
                    end = ("error", refused)
                    return
                end = ("done", self._generate(slot, cached), cached)
            except BaseException as e:  # noqa: BLE001 - reported to the request, the server goes on
                why = STALLED_REASON if self.stalled else self.scheduler.cancel_reason
                end = ("error", Cancelled(why) if isinstance(e, GenerationCancelled) else e)
            finally:
                self.scheduler.give_back(slot)
        finally:
            with self.scheduler._cond:
                self.scheduler.jobs.discard(self)
            if end is not None:
                self._emit(*end)

    def _generate(self, slot: Slot, cached: int) -> Completion:
        model, prompt = self.scheduler.model, self.prompt
        slot.ids = None  # unknown while it runs
        gen = Generation(model.engine, model.tokenizer, slot.cache, self.options, model.overflow,
                         begin=lambda req: prompt[cached:], end=self._remember(slot, cached), logprobs=self.logprobs,
                         load_ms=model.load_ms, stepper=self.scheduler.stepper, prefix=prompt[:cached],
                         cancelled=self.cancelled, power=model.power)
        for chunk in gen:
            if self.sent == self.taken:  # nothing waits: this chunk starts the wait
                self.waiting_since = time.monotonic()
            self._emit("chunk", chunk)
            self.sent += 1
            if self.streamed and self._stalled():
                self.stalled = True  # its chunks piled up here without bound (a hostile round: 7 MB/s), and
                self.cancel()  # it held its slot: cancelled as if its client had gone away
        return gen.completion

    def _stalled(self) -> bool:
        """Whether the stream's client stopped reading: none of the chunks waiting for it were taken for
        STALLED_S, or more than MAX_UNREAD_CHUNKS wait and none were taken for STALLED_COUNT_S. Time in
        the queue or a prefill does not count (the wait starts with the oldest chunk not taken)."""
        waiting = self.sent - self.taken
        idle_s = time.monotonic() - max(self.taken_at, self.waiting_since)
        return waiting > 0 and (idle_s > STALLED_S or (waiting > MAX_UNREAD_CHUNKS and idle_s > STALLED_COUNT_S))

    def _remember(self, slot: Slot, cached: int) -> Callable[[Request], None]:
        """After the request: which tokens the slot's ring now holds, if that is known exactly."""
        def end(req: Request) -> None:
            slot.ids = held_after(req, self.prompt, slot.cache)
            slot.prompt_tokens = len(self.prompt)
        return end


__all__ = ["Scheduler", "Slot", "choose_slot", "Job", "QueueFull", "Cancelled", "Chunk",
           "Completion"]

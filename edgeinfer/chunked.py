"""Chunked prefill, and turns on the engine between chunks: `prefill_chunks` plans a prompt's calls,
`ChunkedSteps` runs them (the base of both engines)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from edgeinfer import fork_safety
from edgeinfer.interrupts import interrupts_held
from edgeinfer.errors import ForkedBusyError, ModelClosedError
from edgeinfer.kv_cache import RingKVCache
from edgeinfer.ort_lifecycle import check_thread, hold_at_exit, return_freed_memory


def prefill_chunks(n: int, chunk: int, cache: RingKVCache | None = None) -> list[tuple[int, int]]:
    """[start, end) of each prefill call for n tokens, at most `chunk` each; with the `cache` they
    enter, none of more rows than its trained length or sliding window leaves room for
    (`RingKVCache.call_room`, as the ring fills: a long prompt entering a full ring goes in calls of
    T - capacity rows, or of one row for a sliding-window model). Never a last
    call of one token after others: a one-row call takes MatMulNBits' single-row path, whose
    int8-activation arithmetic differs (at accuracy_level 4 most rows' logits within 1e-5, a few by up to
    ~0.25 on the bundled int8, 315 rows measured) from the same row inside
    a larger call, so a prompt's logits would depend on where the chunks fall. Calls of two or more
    rows agree but for a rare row (at level 4, one of 366 differed by 8e-6 between two splits)."""
    def room(held: int) -> int:  # the most rows a call may append beside `held` tokens
        return chunk if cache is None else max(1, min(chunk, cache.attend_limit - held))

    bounds, held = [], []  # each call's [start, end), and the tokens the ring holds before it
    start, h = 0, 0 if cache is None else cache.n_valid
    while start < n:
        end = min(start + room(h), n)
        bounds.append((start, end))
        held.append(h)
        start, h = end, h if cache is None else min(h + end - start, cache.capacity)
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        (a, b), (_, e) = bounds[-2], bounds[-1]
        h = held[-2] if cache is None else min(held[-2] + e - 2 - a, cache.capacity)
        if b - a > 2 and room(h) >= 2:  # the last two calls as (a, e - 2) and (e - 2, e)
            bounds[-2:] = [(a, e - 2), (e - 2, e)]
    return bounds


class ChunkedSteps:
    """`prefill` and `decode_one` over an engine's `forward(cache, ids)` and `max_chunk`, and the turns
    that keep a long prefill from holding off other threads' calls: shared by `engine.Engine` and
    `portable_engine.PortableEngine` (each calls `_init_turns` and, in its `forward`, marks its
    thread in `waiting` until it holds `lock`, and records a call of several rows in `ran`).

    Turns: each graph call holds the engine's `lock`, and a prefill releases it between its chunks,
    so another thread's call waits for at most one chunk. But a request that decodes meanwhile makes
    one call per token: alone, 3 ms a step on SmolLM2-135M int4, yet one step per 240 ms chunk beside
    another's 3,072-token prompt (32 steps: 3.0 s against 0.10 s alone, the whole other prefill). So
    a prefill whose chunk had a caller waiting lets the others use the engine after that chunk until
    they have held it for as long as the chunk ran, or leave it idle for IDLE_S (`give_way`): beside a
    long prompt, a decoding request gets about as much of the engine as the prompt (0.26 s for those
    32 steps), and a caller that is slow between its calls (a paced one, or one whose own work per
    token is long) does not hold the prompt back. Nothing changes what any call computes (the chunks
    are the same); a call costs two set operations more.
    """

    max_chunk: int
    IDLE_S = 0.01  # the engine idle this long: the others are done for now (sampling between steps is shorter)
    POLL_S = 0.001

    def _init_turns(self, what: str) -> None:
        self.lock = threading.Lock()
        fork_safety.watch(self, "lock", what)
        hold_at_exit(self)  # no graph call in flight as the interpreter finalizes (`ort_lifecycle`)
        self.waiting: set[int] = set()  # idents of threads about to take `lock` or waiting for it (a hint)
        self.prefilling: set[int] = set()  # idents of threads inside `prefill`
        self.holder_prefills = False  # whether the call that holds `lock` now is a prefill's (set under it)
        self.ran = threading.local()  # .s: this thread's last call of several rows, in seconds under the lock
        self.closed = self.dropped = False  # (`close`: refusing calls; the sessions let go)
        self.calling = threading.local()  # .now: this thread is inside `in_call` (taking or holding `lock`)
        self.in_call = _InCall(self.calling, weakref.ref(self))  # `with self.in_call, self.lock:` around each call

    def close(self) -> None:
        """Free the graph's sessions and bindings (`_drop`) once the call in flight, if any, has ended
        (under `lock`), and give the freed pages back (`return_freed_memory`): every later call raises
        ModelClosedError. Idempotent; a Ctrl-C waits for its end. Called by a thread that is inside a
        call itself (a signal handler that ran in the middle of it), it cannot wait for that call:
        it marks the engine closed, and the call's end completes it (`_InCall`); so does a close
        nested in this one (a second signal's handler). (A mark left by a Ctrl-C, with the lock free,
        is not taken for a call.)"""
        if getattr(self.calling, "now", False) and self.lock.locked():
            self.closed = True
            return
        with interrupts_held():
            self.calling.now = True
            try:
                try:
                    held = self.lock.acquire()
                except ForkedBusyError:  # (`fork_safety`) held at the fork by a thread this child lacks: none runs here
                    held = False
                try:
                    self.closed = True
                    self._drop()
                    self.dropped = True
                finally:
                    if held:
                        self.lock.release()
            finally:
                self.calling.now = False
            return_freed_memory()

    def _drop(self) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        """Under `lock`, before a graph call (at the interpreter's exit, only its thread goes on)."""
        check_thread()
        if self.closed:
            raise ModelClosedError()

    def forward(self, cache: RingKVCache, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        raise NotImplementedError

    def prefill(self, cache: RingKVCache, ids: Sequence[int], chunk: int | None = None,
                before_chunk: Callable[[], None] | None = None) -> np.ndarray:
        """Feed `ids` in chunks of at most `chunk` tokens, as the cache's room allows (`prefill_chunks`);
        return the logits [V] after the last one. `before_chunk` runs before each call (a cancellation
        check may raise there), and while the prefill gives way."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        logits, me = None, threading.get_ident()
        self.prefilling.add(me)
        try:
            for start, end in prefill_chunks(len(ids), min(chunk or self.max_chunk, self.max_chunk), cache):
                if logits is not None:
                    self.give_way(getattr(self.ran, "s", 0.0), before_chunk)
                if before_chunk is not None:  # after giving way: a cancellation meanwhile stops it before the chunk
                    before_chunk()
                logits = self.forward(cache, ids[start:end])
        finally:
            self.prefilling.discard(me)
        return logits[0]

    def give_way(self, chunk_s: float, check: Callable[[], None] | None = None) -> None:
        """Between two chunks of a prefill: if a thread that is not prefilling waited for the lock while
        the last chunk ran (`waiting`, `prefilling`), let the others use the engine until the threads
        that are not prefilling have held it for chunk_s (the chunk's time under the lock), or until it
        stays idle for IDLE_S, and for at most 2 chunk_s + IDLE_S of wall time besides the time other
        prefills hold it. Another prefill's chunk counts for none of that: with two long prompts, it
        once ended the give-way before the decoding request had its share (one step per chunk again:
        32 steps in 6.4 s). No thread but prefills left waiting: it ends. `check` (the prefill's
        cancellation check) runs at every poll: a request cancelled meanwhile stops at once. Marks
        with nobody taking the engine in that time are stale (a call stopped by an exception, Ctrl-C
        say, between marking and taking the lock, or a thread lost in a fork): they are dropped."""
        if not self.waiting - self.prefilling:
            return
        start = last = time.perf_counter()
        used = prefills_s = 0.0
        idle_since, taken = None, False
        while True:
            if check is not None:
                check()
            now = time.perf_counter()
            if self.lock.locked():
                idle_since, taken = None, True
                if not self.holder_prefills:
                    used += now - last
                elif self.waiting - self.prefilling:
                    prefills_s += now - last
                else:
                    break  # only prefills want the engine: nothing to give way to
            elif idle_since is None:
                idle_since = now
            if used >= chunk_s or now - start - prefills_s >= 2 * chunk_s + self.IDLE_S or \
                    (idle_since is not None and now - idle_since >= self.IDLE_S):
                break
            last = now
            time.sleep(self.POLL_S)  # (a woken waiter needs the GIL to take the lock: the sleep hands it over)
        if not taken and not self.lock.locked():
            self.waiting.clear()  # nobody took the engine in all that time: the marks were stale

    def decode_one(self, cache: RingKVCache, token: int) -> np.ndarray:
        """Feed one token; return the logits [V] for the next one."""
        return self.forward(cache, (token,))[0]


class _InCall:
    """`with steps.in_call, steps.lock:` marks the thread as inside a graph call from before it takes
    the lock until after it lets it go (`close` from this thread meanwhile cannot take the lock it
    holds or is taking), and completes a close made in that time once the lock is free. One per
    engine, its state per thread; it holds the engine weakly (a reference back made a cycle: the
    sessions waited for the cycle collector instead of going with the Model's last reference)."""

    __slots__ = ("calling", "steps")

    def __init__(self, calling: threading.local, steps: "weakref.ref[ChunkedSteps]"):
        self.calling, self.steps = calling, steps

    def __enter__(self) -> None:
        self.calling.now = True

    def __exit__(self, *exc) -> None:
        self.calling.now = False
        steps = self.steps()
        if steps is not None and steps.closed and not steps.dropped:
            steps.close()

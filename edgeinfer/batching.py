"""Continuous batching: the decode steps of several conversations, each in its own thread, run as one
graph call (`Engine.decode_batch` over a `BatchedKV`).

A conversation that has finished its prefill `join`s, calls `step(cache, token)` once per token, and
`leave`s when it ends. A batched step runs as soon as every joined conversation has a token waiting,
so requests join between steps and finished ones leave without anyone waiting for a whole reply,
and a conversation that is prefilling (not joined) holds nobody back. The thread whose token
completes the set runs the step for all (no extra thread); the others wait for its result. A lone
conversation takes the plain single-row path (`Engine.decode_one`), which costs less for one row.

Single decoding (`SoloStepper`) has the same three methods, so `Generation` does not know which
one it is driving. On fp32 models outputs are bit-identical to decoding each conversation alone,
except a speculating request's (alone it verifies drafts in several-row calls, which round
differently, `speculative.py`; beside others it takes plain batched steps: logprobs ~1e-6 apart and
a near-tie may resolve the other way); quantized weights (MatMulNBits, even at accuracy level 0)
take another kernel for a batch of rows than for one, so logprobs differ by ~1e-5 and a near-tie may
resolve the other way.
"""

from __future__ import annotations

import threading

import numpy as np

from edgeinfer.engine import Engine
from edgeinfer.kv_cache import BatchedKV, RingKVCache


class SoloStepper:
    """One conversation decoding on its own."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.step = engine.decode_one  # step(cache, token) -> logits [V]: the engine's own, no extra frame

    def join(self, cache: RingKVCache) -> None:
        pass

    def leave(self, cache: RingKVCache) -> None:
        pass

    def after_fork_idle(self) -> None:
        """In a forked child of a server that was idle: nothing to renew (no lock)."""

    def alone(self, cache: RingKVCache) -> bool:
        """Whether `cache` decodes on its own now (speculation may then run its own calls)."""
        return True


class DecodeBatcher:
    def __init__(self, engine: Engine, kv: BatchedKV):
        self.engine, self.kv = engine, kv
        self._row = {id(c): b for b, c in enumerate(kv.caches)}
        self._cond = threading.Condition()
        self._joined: set[int] = set()  # rows decoding now
        self._waiting: dict[int, int] = {}  # row -> token for the next step
        self._done: set[int] = set()  # rows whose step has run, not yet picked up
        self._failed: dict[int, BaseException] = {}  # rows whose step failed: each waiter raises it
        self._running = False
        self.steps = 0  # batched steps run (for tests and metrics)

    def join(self, cache: RingKVCache) -> None:
        with self._cond:
            self._joined.add(self._row[id(cache)])

    def after_fork_idle(self) -> None:
        """In a forked child of a server that was idle (no row decoding): a lock of its own, since
        another thread of the parent may have held it at the fork, leaving a row (a review)."""
        self._cond = threading.Condition()

    def leave(self, cache: RingKVCache) -> None:
        with self._cond:
            row = self._row[id(cache)]
            self._joined.discard(row)
            self._waiting.pop(row, None)
            self._done.discard(row)
            self._failed.pop(row, None)
            self._cond.notify_all()  # the others may now be a complete set

    def alone(self, cache: RingKVCache) -> bool:
        """Whether `cache`'s row is the only one joined: a speculative verify call of its own then
        holds nobody back (one that starts just before another request joins delays that request's
        first batched step by the verify call and the drafts it serves, at most `Tuning.k_max` tokens)."""
        with self._cond:
            return self._joined == {self._row[id(cache)]}

    def step(self, cache: RingKVCache, token: int) -> np.ndarray:
        """Feed `token` to `cache` (a joined row) in the next batched step; return its logits [V]."""
        row = self._row[id(cache)]
        with self._cond:
            self._waiting[row] = token
            while True:
                if row in self._done:
                    self._done.discard(row)
                    return cache.logits[0, 0]
                if row in self._failed:
                    raise self._failed.pop(row)
                if not self._running and self._waiting and self._joined <= set(self._waiting):
                    batch, self._waiting = self._waiting, {}
                    self._running = True
                    break
                self._cond.wait()
        error = None
        try:  # this thread runs the step for every waiting row, outside the condition's lock
            if len(batch) == 1:
                (b, t), = batch.items()
                self.engine.decode_one(self.kv.caches[b], t)
            else:
                self.engine.decode_batch(self.kv, batch)
        except BaseException as e:  # every row of this step learns of it (Ctrl-C included)
            error = e
            raise
        finally:
            with self._cond:
                self._running = False
                self.steps += 1
                others = [b for b in batch if b != row and b in self._joined]
                if error is None:
                    self._done.update(others)
                else:
                    self._failed.update((b, error) for b in others)
                self._cond.notify_all()
        return cache.logits[0, 0]

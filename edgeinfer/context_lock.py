"""Who may use a KV cache now: one call, or one live stream, at a time.

A Model's default cache and each Conversation's cache hold one context; two callers feeding the
same ring would interleave their tokens and both get wrong output. So each context has a
`ContextLock`: a caller in another thread waits its turn (calls serialise), while the same thread
asking again before its own stream is finished is refused with `ContextBusyError` (waiting would
deadlock, sharing would corrupt). A stream holds the lock from its first `next()` until its request
ends (released before its last chunk is returned), is closed, or is dropped (freed at once by
reference counting: `generation.Generation`); its holder is the thread that advanced it last
(`hand_to`), so a stream handed to another thread makes that thread's own second call a refusal, not
a wait on itself. (An executor that runs a stream's `next()` and other calls on its pool threads
may so refuse a call on a thread that last advanced the stream: give each concurrent task its own
conversation.)

Ctrl-C (KeyboardInterrupt, raised in the main thread between any two bytecodes) must not land
between taking the lock and recording its owner, or between the two halves of a release: a hostile
round's real signals left the lock held by nobody (every later call waited for ever, ~1 in 800
interrupts) or owned by a thread that had let it go (its every later call refused). So the lock's
state changes run with the interrupt held back (`interrupts_held`: SIGINT's handler swapped for
one that records it, then restored and called with it once the state is whole), and a
wait for another thread's turn gives up at once on Ctrl-C. What that cannot cover (the few
bytecodes before a release swaps the handler) is recovered: the lock records its holder (a
Request, or a with-block's `hold()`) by weak reference, and takes itself back once the holder is
gone, unless the holder has begun its release (`settle`: the cycle collector clears weak
references before it runs a dropped stream's finally). Each holding has a token, so a release
after the lock was taken back lets go of nothing.

A stream dropped while a reference cycle of the caller's holds it (a caught exception kept in a
local) is freed only by the cycle collector, which may not run for minutes: the lock runs it before
refusing the same thread, and after half a second of another thread's wait (`_collect`).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

from edgeinfer import fork_safety
from edgeinfer.errors import EdgeInferError, ModelClosedError
from edgeinfer.interrupts import interrupts_held


class ContextBusyError(EdgeInferError, RuntimeError):
    """A context that cannot be had: the same thread asked for one that its own unfinished stream still
    holds, a second next() of one stream came from another thread, or a server holds the model's
    default context (`Model.lend_default_cache`)."""


class ContextLock:
    def __init__(self, what: str, closed=None):
        """what: names the context in errors. closed: None, or a callable that says the model is
        closed: a wait for another thread's turn then raises ModelClosedError (within `POLL_S`), as
        any call on a closed model does, rather than waiting for a stream that may never be
        finished (an open stream kept by its holder)."""
        self.what = what  # names the context in the error message
        self._closed = closed
        self._lock = threading.Lock()
        # the holder's Thread object (not its ident: the OS reuses a finished thread's ident, and a new
        # thread must wait, not be refused); only the holder sets it to itself
        self._owner: threading.Thread | None = None
        # what holds it (a Request, a `hold()`): when that object is gone and the lock is still held,
        # its release never ran (a Ctrl-C in the few bytecodes `interrupts_held` cannot cover), and the
        # next `acquire` takes the lock back instead of waiting for ever
        self._holder: weakref.ref | None = None
        self._token = 0  # the current holding's number (0: none); a release or a settle of another is ignored
        self._count = 0
        self._reclaiming = threading.Lock()
        fork_safety.watch(self, "_lock", what, "held_here")  # held by another thread at a fork: refused there

    POLL_S = 0.05  # how often a wait looks whether it should give up, or whether its holder is gone
    COLLECT_AFTER_S = 0.5  # a wait this long runs the cycle collector (`_collect`) ...
    COLLECT_EVERY_S = 30.0  # ... and again at this interval while it goes on
    COLLECT_WAIT_S = 2.0  # how long `_collect` retries while other threads' collections make its own a no-op

    def acquire(self, holder, give_up=None, refuse_closed: bool = True) -> int:
        """Take the lock (waiting for another thread's turn) and own it for `holder` (an object that
        lives as long as the use: the lock is taken back once it is gone); returns the holding's token
        for `settle` and `release`, or 0, not holding it, when `give_up()` (polled while waiting) said
        so; ModelClosedError, not holding it, when the model closes while it waits (unless not
        `refuse_closed`: a use that a closed model allows, a conversation's reset). Callers run it inside
        `interrupts_held` with give_up polling held.pending, and record the token inside that block too
        (`Generation.steps`)."""
        me = threading.current_thread()
        self._reclaim()
        if self._owner is me:
            self._collect()  # a stream the caller dropped may be kept only by a reference cycle
        if self._owner is me:
            raise ContextBusyError(
                f"{self.what} is in use by a stream that is still open in this thread: finish it or call its "
                "close() first, or use model.conversation() for a second, independent context (a stream you "
                "no longer hold can be kept open by a saved exception's traceback, such as "
                "sys.last_traceback in an interactive session: delete it)")
        collect_at = time.monotonic() + self.COLLECT_AFTER_S
        while not self._lock.acquire(timeout=self.POLL_S):  # (a release wakes it at once)
            self._reclaim()
            if give_up is not None and give_up():
                return 0
            if refuse_closed and self._closed is not None and self._closed():
                raise ModelClosedError()
            if time.monotonic() >= collect_at:  # the holder may be a dropped stream in a reference cycle
                self._collect()
                collect_at = time.monotonic() + self.COLLECT_EVERY_S
        self._count += 1
        self._owner, self._holder, self._token = me, weakref.ref(holder), self._count
        return self._token

    def _collect(self) -> None:
        """Run the cycle collector, then take the lock back if that freed its holder. A stream dropped
        half-read while a reference cycle holds it (an exception kept in a local, `err = e`, links
        the frame that holds it to itself) is freed only by the collector, which may not run for
        minutes, or ever (`gc.disable()`); its finalizer runs here as it would at any allocation.
        While another thread is collecting, CPython's gc.collect() returns at once having done
        nothing (and that collection may be running this very stream's finalizer): so it is called
        again, a few milliseconds apart, until a full collection has run in this thread."""
        deadline = time.monotonic() + self.COLLECT_WAIT_S
        while True:
            _collections.full_here = False
            gc.collect()
            self._reclaim()
            if _collections.full_here or time.monotonic() >= deadline:
                return
            time.sleep(0.005)

    def _reclaim(self) -> None:
        """Release the lock if its holder is gone and had not begun its release (`settle`)."""
        h = self._holder
        if h is not None and h() is None:
            with self._reclaiming:
                if self._holder is h:
                    self._holder, self._owner, self._token = None, None, 0
                    self._lock.release()

    def settle(self, token: int) -> bool:
        """The holder begins its release: from now on the lock is not taken back from it, even if the
        holder object is gone (the cycle collector clears weak references before it runs a dropped
        stream's finally). False when it was already taken back: the holder must then touch neither
        the context nor the lock."""
        with self._reclaiming:
            if token == 0 or self._token != token:
                return False
            self._holder = _settled
            return True

    def hand_to(self, thread: threading.Thread) -> None:
        """The holder's stream is now advanced by `thread` (called in that thread, from inside the
        stream's steps: only the thread running them gets there)."""
        self._owner = thread

    def held_here(self) -> bool:
        """Whether the current thread holds it (its stream is open here)."""
        return self._owner is threading.current_thread()

    def release(self, token: int) -> None:
        """Let go of the holding `token` names (nothing, if it was taken back meanwhile)."""
        with interrupts_held(), self._reclaiming:
            if token != 0 and self._token == token:
                self._holder, self._owner, self._token = None, None, 0
                self._lock.release()

    def hold(self, refuse_closed: bool = True) -> "_Hold":
        """`with lock.hold():` the lock for a block (the `_Hold` is its holder: the with statement keeps
        it alive while the block runs); refuse_closed: as `acquire`'s."""
        return _Hold(self, refuse_closed)


def _settled() -> bool:  # the holder of a lock whose release has begun: never taken back
    return True


_collections = threading.local()  # full_here: a full collection began in this thread (`ContextLock._collect`)


def _note_collection(phase: str, info: dict) -> None:  # gc calls it in the collecting thread
    if phase == "start" and info.get("generation") == 2:
        _collections.full_here = True


gc.callbacks.append(_note_collection)


class _Hold:
    __slots__ = ("lock", "token", "refuse_closed", "__weakref__")

    def __init__(self, lock: ContextLock, refuse_closed: bool = True):
        self.lock, self.token, self.refuse_closed = lock, 0, refuse_closed

    def __enter__(self) -> "_Hold":
        try:
            while not self.token:  # a SIGINT handler that does not raise: wait again
                with interrupts_held() as held:
                    self.token = self.lock.acquire(self, give_up=held.pending, refuse_closed=self.refuse_closed)
        except BaseException:
            self.lock.release(self.token)  # the interrupt came as it took the lock: the block will not run
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release(self.token)

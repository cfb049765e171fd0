"""Who may use a KV cache now: one call, or one live stream, at a time.

A Model's default cache and each Conversation's cache hold one context; two callers feeding the
same ring would interleave their tokens and both get wrong output. So each context has a
`ContextLock`: a caller in another thread waits its turn (calls serialise), while the same thread
asking again before its own stream is finished is refused with `ContextBusyError` (waiting would
deadlock, sharing would corrupt). A stream holds the lock from its first `next()` until it ends,
is closed, or is dropped (freed at once by reference counting: `generation.Generation`); its holder
is the thread that advanced it last (`hand_to`), so a stream handed to another thread makes that
thread's own second call a refusal, not a wait on itself. (An executor that runs a stream's `next()`
and other calls on its pool threads may so refuse a call on a thread that last advanced the stream:
give each concurrent task its own conversation.)
"""

from __future__ import annotations

import threading

from edgeinfer import fork_safety
from edgeinfer.errors import EdgeInferError


class ContextBusyError(EdgeInferError, RuntimeError):
    """The same thread asked for a context that its own unfinished stream still holds."""


class ContextLock:
    def __init__(self, what: str):
        self.what = what  # names the context in the error message
        self._lock = threading.Lock()
        # the holder's Thread object (not its ident: the OS reuses a finished thread's ident, and a new
        # thread must wait, not be refused); only the holder sets it to itself
        self._owner: threading.Thread | None = None
        fork_safety.watch(self, "_lock", what, "held_here")  # held by another thread at a fork: refused there

    def acquire(self) -> None:
        me = threading.current_thread()
        if self._owner is me:
            raise ContextBusyError(
                f"{self.what} is in use by a stream that is still open in this thread: finish it or call its "
                "close() first, or use model.conversation() for a second, independent context")
        self._lock.acquire()
        self._owner = me

    def hand_to(self, thread: threading.Thread) -> None:
        """The holder's stream is now advanced by `thread` (called in that thread, from inside the
        stream's steps: only the thread running them gets there)."""
        self._owner = thread

    def held_here(self) -> bool:
        """Whether the current thread holds it (its stream is open here)."""
        return self._owner is threading.current_thread()

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def __enter__(self) -> "ContextLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

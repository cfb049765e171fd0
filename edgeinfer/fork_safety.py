"""After fork(): a child refuses what the parent's other threads were using, instead of hanging.

fork() copies the process with only the thread that called it. A Model that was idle at that
moment works in the child as in the parent. But a lock that another thread held (an engine's,
during a graph call; a context's, while a stream was open) stays held in the child by a thread that
does not exist there, so the child's next call on it would wait for ever (and ONNX Runtime may be
halfway through a call). `watch(obj, attr)` registers such a lock; in the child, each watched lock
that another thread held is replaced by one that refuses at once with `ForkedBusyError`, naming
what to do. Locks that were free, or held by the thread that forked (a stream it has open), are
left alone.
"""

from __future__ import annotations

import os
import threading
import weakref

from edgeinfer.errors import ForkedBusyError

_WATCHED: "weakref.WeakKeyDictionary[object, dict[str, tuple[str, str | None]]]" = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()


class _Refusing:
    """A lock held at fork by a thread the child lacks: acquiring it raises."""

    def __init__(self, what: str):
        self.what = what

    def acquire(self, *args, **kwargs):
        raise ForkedBusyError(f"{self.what} was in use by another thread when this process forked, and that thread "
                              "does not exist here: load the model again in this process (or fork while it is idle)")

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        pass

    def release(self) -> None:
        pass

    def locked(self) -> bool:
        return True


def watch(obj: object, attr: str, what: str, held_here: str | None = None) -> None:
    """In a forked child, refuse `obj.<attr>` (a threading.Lock) if another thread held it at the
    fork. held_here: the name of a method of obj that says whether the current thread holds it
    (the thread that forks is the child's: its own locks stay as they are); None: a lock held only
    inside a call, which no thread can fork from."""
    with _GUARD:
        _WATCHED.setdefault(obj, {})[attr] = (what, held_here)


def _after_fork_in_child() -> None:
    global _GUARD
    _GUARD = threading.Lock()  # it may have been held by a thread that is gone
    for obj, locks in list(_WATCHED.items()):
        for attr, (what, held_here) in locks.items():
            lock = getattr(obj, attr, None)
            if lock is None or not lock.locked() or isinstance(lock, _Refusing):
                continue
            if held_here is None or not getattr(obj, held_here)():
                setattr(obj, attr, _Refusing(what))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

"""ONNX Runtime sessions across fork() and interpreter exit: two ways a process ended badly.

1. A forked child inherits the parent's sessions but not their thread pools' workers, and ONNX
   Runtime's session destructor waits on those workers' condition variables: a child that dropped
   an inherited Model, or simply exited, hung for ever (a hostile round: with 2 threads, once the
   model had been idle about a second; at once with a spin duration set). In the child each
   inherited session is kept alive for good (`keep_in_forked_child`): its destructor never runs
   there. Sessions the child makes itself are its own and are freed as usual.
2. At interpreter exit, a daemon thread still generating was killed inside a graph call, in C++
   code: "terminate called without an active exception" and SIGABRT (6 of 10 runs of an app that
   quit while a thread generated). At exit (`atexit`, which runs before daemon threads are stopped)
   each engine's lock is taken and kept (`hold_at_exit`), waiting up to EXIT_WAIT_S for a call in
   flight to end: no thread is then inside a graph call, and one that tries to start another waits
   on a Python lock until the process is gone.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref

EXIT_WAIT_S = 10.0  # how long exit waits for graph calls in flight (a prefill call on a slow board: seconds)

_SESSIONS: "weakref.WeakSet[object]" = weakref.WeakSet()
_ENGINES: "weakref.WeakSet[object]" = weakref.WeakSet()
_KEPT: list[object] = []  # the inherited sessions, in the child


def keep_in_forked_child(session: object) -> object:
    """Register an ONNX Runtime InferenceSession made in this process; returns it."""
    _SESSIONS.add(session)
    return session


def hold_at_exit(engine: object) -> None:
    """Register an engine whose `lock` is held around each graph call."""
    _ENGINES.add(engine)


def _after_fork_in_child() -> None:
    for session in list(_SESSIONS):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(session))  # a reference no one holds: never freed here,
        _KEPT.append(session)  # not even as the interpreter finalizes (a list alone is cleared then)
    _SESSIONS.clear()


def _hold_engines() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for engine in list(_ENGINES):
        lock = getattr(engine, "lock", None)
        if isinstance(lock, type(threading.Lock())):  # (a forked child's refusing stand-in is no lock to take)
            lock.acquire(timeout=max(0.0, deadline - time.monotonic()))  # kept: released by no one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_hold_engines)

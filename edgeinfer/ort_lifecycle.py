"""ONNX Runtime sessions across fork() and interpreter exit: two ways a process ended badly.

1. A forked child inherits the parent's sessions but not their thread pools' workers, and ONNX
   Runtime's session destructor waits on those workers' condition variables: a child that dropped
   an inherited Model, or simply exited, hung for ever (a hostile round: with 2 threads, once the
   model had been idle about a second; at once with a spin duration set). In the child each
   inherited session is kept alive for good (`_after_fork_in_child`): its destructor never runs
   there, and its memory is the child's until it exits. Sessions the child makes itself are its own.
2. At interpreter exit, a daemon thread still generating was killed inside a graph call, in C++
   code: "terminate called without an active exception" and SIGABRT (6 of 10 runs of an app that
   quit while a thread generated). At exit (`atexit`) the exiting thread is recorded, then the lock
   around session creation (`new_session`) and each engine's lock (held around every graph call)
   are taken and released, waiting up to EXIT_WAIT_S in all for a call in flight. From then on the
   exiting thread (later atexit handlers, a __del__ run by the final garbage collection) still loads
   and generates (not a __del__ run as the modules are torn down, after that collection: imports
   fail then, `sys.meta_path` being gone, and generating raises ImportError, even on a model that
   generated before: a hostile round); any other thread is ended at its next call, under the lock
   and before ONNX Runtime (`check_thread`, which each graph call and session creation asks), by a
   SystemExit: its `finally` blocks run (a model's context it held is released), `except Exception`
   does not catch it, and threading reports nothing. Such threads were parked for good on the lock exit kept, which hung the process
   for ever when an atexit handler that runs after ours (one registered before the first load)
   joined that thread or generated on a context it held (a hostile round).
   This makes such an abort rare, not impossible: a review saw 1-2 in 25 exits with four
   daemon threads each starting generations in a loop, and 1 in 10 with a daemon thread loading and
   dropping models in a loop (a session freed, or an IO binding made, outside these locks); a call
   longer than EXIT_WAIT_S is still cut.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time
import weakref
from typing import Callable, TypeVar

EXIT_WAIT_S = 10.0  # how long exit waits for graph calls in flight (a prefill call on a slow board: seconds)

T = TypeVar("T")
_GUARD = threading.Lock()  # the registries below (a session made while exit or a fork reads them)
_SESSIONS: "weakref.WeakSet[object]" = weakref.WeakSet()
_ENGINES: "weakref.WeakSet[object]" = weakref.WeakSet()
_KEPT: list[object] = []  # the inherited sessions, in the child
_CREATING = threading.Lock()  # held while ONNX Runtime makes a session


def new_session(make: Callable[[], T]) -> T:
    """`make()` (which makes an ONNX Runtime InferenceSession) run under the lock exit takes, its
    session registered to be kept in a forked child; returns it."""
    with _CREATING:
        check_thread()
        session = make()
    with _GUARD:
        _SESSIONS.add(session)
    return session


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing): the
    memory of sessions just freed otherwise stays in the process's resident set, kept by the allocator
    for later use (`Model.close`)."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = sys.platform.startswith("linux") and ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError, TypeError):  # not glibc (musl); CDLL(None) is a TypeError on Windows
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None  # glibc's malloc_trim, once looked up (False: none here)


def hold_at_exit(engine: object) -> None:
    """Register an engine whose `lock` is held around each graph call."""
    with _GUARD:
        _ENGINES.add(engine)


THREAD_ENDED = "the interpreter is exiting: only the thread that runs its exit may use a model"


_exiting: int | None = None  # the thread running the interpreter's exit, once it has begun


def check_thread() -> None:
    """Under a graph call's lock, before ONNX Runtime: once exit has begun, SystemExit in any thread but
    the exiting one (SystemExit itself: threading reports any other exception, a subclass too)."""
    if _exiting is not None and threading.get_ident() != _exiting:
        raise SystemExit(THREAD_ENDED)


def _after_fork_in_child() -> None:
    global _GUARD, _CREATING
    _GUARD, _CREATING = threading.Lock(), threading.Lock()  # either may have been held by a thread that is gone
    for session in list(_SESSIONS):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(session))  # a reference no one holds: never freed here,
        _KEPT.append(session)  # not even as the interpreter finalizes (a list alone is cleared then)
    _SESSIONS.clear()


def _wait_for(lock, deadline: float) -> None:
    """Take and release `lock` (by `deadline`): the call it guarded has ended."""
    if isinstance(lock, type(threading.Lock())) and lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        lock.release()  # (a forked child's refusing stand-in is left alone; a call longer than the wait, cut)


def _hold_at_exit() -> None:
    global _exiting
    _exiting = threading.get_ident()
    deadline = time.monotonic() + EXIT_WAIT_S
    _wait_for(_CREATING, deadline)
    with _GUARD:
        engines = list(_ENGINES)
    for engine in engines:
        _wait_for(engine.lock, deadline)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_hold_at_exit)

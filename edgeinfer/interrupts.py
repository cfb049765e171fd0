"""`interrupts_held`: a Ctrl-C recorded, not raised, while a block changes state that must stay whole
(a lock's owner, a ring lent, the imports a command needs), then raised once the block ends.

Its own module, importing nothing but `_signal`, `sys` and `threading`, so that the entry point can
hold a Ctrl-C before the CLI's modules are imported: met inside an import, a KeyboardInterrupt can
be lost (raised in a weak reference's callback of the import machinery it is printed as "Exception
ignored" and the program runs on) or turned into an ImportError (numpy's compiled initialisation).
"""

from __future__ import annotations

import _signal
import sys
import threading


class interrupts_held:
    """`with interrupts_held() as held:` SIGINT is recorded, not raised, until the block ends; then the
    handler the program had is called with it (KeyboardInterrupt there, under Python's default).
    `held.pending()` says whether one came. Only the main thread gets KeyboardInterrupt: elsewhere, and
    where SIGINT is ignored or handled outside Python, it holds nothing back. The handler is swapped
    with `_signal`'s C functions: no Python code of the `signal` module runs (and checks for signals)
    in between."""

    __slots__ = ("_pending", "_old")

    def __init__(self):
        self._pending = False
        self._old = None

    def pending(self) -> bool:
        return self._pending

    def _record(self, signum, frame) -> None:
        self._pending = True

    def __enter__(self) -> "interrupts_held":
        if threading.current_thread() is threading.main_thread():
            old = _signal.getsignal(_signal.SIGINT)
            if callable(old) or old == _signal.SIG_DFL:
                self._old = old
                _signal.signal(_signal.SIGINT, self._record)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            old, self._old = self._old, None
            _signal.signal(_signal.SIGINT, old)
            if self._pending:
                self._pending = False
                if callable(old):  # its handler called as the signal would call it (KeyboardInterrupt here,
                    old(_signal.SIGINT, sys._getframe(1))  # the block's state whole; an enclosing block's
                    # record), not the signal raised again: that wrote the process's wakeup fd once more
                    # per block, and an asyncio, Qt or GLib app that reads it saw one Ctrl-C two or three
                    # times (its second meaning "force quit"; a hostile round)
                else:  # SIG_DFL: the default action
                    _signal.raise_signal(_signal.SIGINT)

"""`python -m edgeinfer` and the `edgeinfer` console script (`run`)."""

import _signal
import atexit
import os
import sys

from edgeinfer.interrupts import interrupts_held


def run() -> int:
    """The CLI as a program's entry point. Its modules are imported with a Ctrl-C held until they are
    whole (`edgeinfer.interrupts`: met inside an import it could be lost, and the command ran on);
    `cli.main` holds it over the rest of the imports it needs. Once main has returned, a Ctrl-C ends
    the process at once with main's exit status (a program that calls `run` and goes on keeps that
    handler): raised as the interpreter shut down (atexit handlers, weak references' callbacks) it
    printed "Exception ignored ... KeyboardInterrupt" after a complete output and could make rc 0
    into -2, and ignoring it would leave `serve` deaf while its worker threads finish. From the
    interpreter's exit hooks on (its threads joined), a Ctrl-C is ignored (`_ignore_interrupts`)."""
    try:
        with interrupts_held():
            from edgeinfer.cli import main
        rc = main()
    except KeyboardInterrupt:  # the line the CLI prints, not a traceback (also just before or after main's own)
        print("edgeinfer: interrupted", file=sys.stderr)
        rc = 130
    if _signal.getsignal(_signal.SIGINT) is not _signal.SIG_IGN:
        _signal.signal(_signal.SIGINT, lambda signum, frame: os._exit(rc))  # (stdout: flushed by main)
        atexit.register(_ignore_interrupts)  # (registered last, it runs first: the other exit hooks keep theirs)
    return rc


def _ignore_interrupts() -> None:
    """From the exit hooks on, a Ctrl-C is ignored: Python's finalization puts back the default
    handler of a signal that has a handler of Python's (not one that is ignored), and a Ctrl-C in
    the ~0.1 s of its teardown after that killed the process by SIGINT after a complete output (a
    hostile round: 12 of 30 tries near the end of a `generate`)."""
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(run())

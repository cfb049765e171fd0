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
    into -2, and ignoring it would leave `serve` deaf while its worker threads finish. After the
    interpreter's exit hooks, a Ctrl-C is ignored (`_ignore_interrupts`)."""
    try:
        with interrupts_held():
            from edgeinfer.cli import main
        rc = main()
    except KeyboardInterrupt:  # the line the CLI prints, not a traceback (also just before or after main's own)
        print("edgeinfer: interrupted", file=sys.stderr)
        rc = 130
    global _exit_handler
    if _signal.getsignal(_signal.SIGINT) is not _signal.SIG_IGN:
        _exit_handler = lambda signum, frame: os._exit(rc)  # noqa: E731  (stdout: flushed by main)
        _signal.signal(_signal.SIGINT, _exit_handler)
    return rc


_exit_handler = None  # the SIGINT handler `run` left, once main has returned


def _ignore_interrupts() -> None:
    """After the other exit hooks, a Ctrl-C is ignored, while `run`'s handler is still the one set:
    Python's finalization then puts back the default handler of a signal that has a handler of
    Python's (not one that is ignored), and a Ctrl-C in the ~0.1 s of its teardown killed the
    process by SIGINT after a complete output (a hostile round: 12 of 30 tries near the end of a
    `generate`). Registered as this module is imported, it runs after every exit hook registered
    since (exit hooks run last registered first): ONNX Runtime's wait for a graph call in flight,
    the daemon's log, a program's own, during which a Ctrl-C ends the process at once (a review);
    only a hook registered before this module was imported runs with it ignored."""
    if _exit_handler is not None and _signal.getsignal(_signal.SIGINT) is _exit_handler:
        _signal.signal(_signal.SIGINT, _signal.SIG_IGN)


atexit.register(_ignore_interrupts)


if __name__ == "__main__":
    sys.exit(run())

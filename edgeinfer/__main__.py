"""`python -m edgeinfer` and the `edgeinfer` console script (`run`)."""

import _signal
import sys

from edgeinfer.interrupts import interrupts_held


def run() -> int:
    """The CLI, its modules imported with a Ctrl-C held until they are whole (`edgeinfer.interrupts`:
    met inside an import it could be lost, and the command ran on); `cli.main` holds it over the
    rest of the imports it needs."""
    try:
        with interrupts_held():
            from edgeinfer.cli import main
    except KeyboardInterrupt:  # the line the CLI prints, not a traceback
        print("edgeinfer: interrupted", file=sys.stderr)
        return 130
    rc = main()
    # Done, its output written: a Ctrl-C as the interpreter shuts down (atexit handlers, weak references'
    # callbacks) printed "Exception ignored ... KeyboardInterrupt" and could turn rc 0 into -2 (a hostile round)
    if _signal.getsignal(_signal.SIGINT) is not _signal.SIG_IGN:
        _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    return rc


if __name__ == "__main__":
    sys.exit(run())

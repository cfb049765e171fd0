"""Running the small status commands the sensor readers use (`vcgencmd`, `nvpmodel`, `pmset`, ...).

A `CommandRunner` is `(argv, timeout_s) -> stdout or None`. It never raises: None stands for "no
answer" (the program is missing, exited nonzero, timed out, or printed something that is not UTF-8).

- `run_command`: the live runner (subprocess, the child killed on timeout).
- `RecordedCommands`: a runner for tests that answers from a dict of recorded outputs.
- `CommandGate`: what the readers call. It wraps a runner with two rules: a command that gave no
  answer is not run again for `retry_after_s` (so a hanging `vcgencmd` costs at most one timeout a
  minute), and a slow command's answer may be reused for `cache_s` seconds (`nvpmodel -q`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, Mapping, Optional, Sequence

CommandRunner = Callable[[Sequence[str], float], Optional[str]]

HANG = "<hang>"  # a RecordedCommands value meaning: the command hangs until its timeout
RETRY_AFTER_S = 60.0


def command_line(argv: Sequence[str]) -> str:
    """The key a command is recorded and remembered under: its words joined by one space."""
    return " ".join(argv)


def run_command(argv: Sequence[str], timeout_s: float) -> str | None:
    """Run `argv` (no shell, stdin closed) and return its stdout, or None when the program is
    missing or not executable, exits nonzero, runs past `timeout_s` or prints more than
    MAX_OUTPUT_BYTES (the child is killed), or prints non-UTF-8. Never raises."""
    try:  # a session of its own: on timeout its whole process group is killed (a wrapper script's children
        # outlived it: termux-* commands are shell scripts)
        child = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    deadline = time.monotonic() + timeout_s
    try:
        out = _read_bounded(child, deadline)
        if out is not None:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, OSError, ValueError):
        out = None
    finally:
        child.stdout.close()
    if out is None:
        _kill_group(child)
        return None
    if child.returncode != 0:
        return None
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        return None


MAX_OUTPUT_BYTES = 64 * 1024  # a status line is a few bytes, `dumpsys battery` about 1 KB; as sysfs reads are bounded


def _read_bounded(child: subprocess.Popen, deadline: float) -> bytes | None:
    """The child's stdout to its end, or None once it passes `deadline` or MAX_OUTPUT_BYTES (a command
    that printed without end held it all: `yes` as vcgencmd took 1.9 GB and 5 s past its 1 s timeout)."""
    if os.name == "nt":  # no select() on pipes: bounded in time only
        try:
            out, _ = child.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        return out if len(out) <= MAX_OUTPUT_BYTES else None
    import selectors

    fd, chunks, size = child.stdout.fileno(), [], 0
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            data = os.read(fd, 65536)
            if not data:
                return b"".join(chunks)
            size += len(data)
            if size > MAX_OUTPUT_BYTES:
                return None
            chunks.append(data)


def _kill_group(child: subprocess.Popen) -> None:
    """SIGKILL `child`'s process group (it leads one), then reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (OSError, AttributeError):  # gone already; or no process groups (Windows)
        child.kill()
    try:
        child.wait(timeout=1)  # (its stdout is closed: nothing to drain)
    except (subprocess.TimeoutExpired, OSError):
        pass


class RecordedCommands:
    """A `CommandRunner` for tests: answers from `outputs`, {command line: stdout}.

    A value of None, or a command line not in `outputs`, means "not installed" (returns None).
    The value `"<hang>"` means the command hangs: the call is recorded in `timed_out` and returns
    None at once, without sleeping. Every call is recorded in `calls` as (command line, timeout_s).
    """

    def __init__(self, outputs: Mapping[str, str | None]):
        self.outputs = dict(outputs)
        self.calls: list[tuple[str, float]] = []
        self.timed_out: list[str] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str | None:
        line = command_line(argv)
        self.calls.append((line, timeout_s))
        out = self.outputs.get(line)
        if out == HANG:
            self.timed_out.append(line)
            return None
        return out

    def count(self, line: str) -> int:
        """How many times the command `line` was run."""
        return sum(1 for called, _ in self.calls if called == line)


class CommandGate:
    """The readers' way to run a command: `run(argv, timeout_s, cache_s)`.

    - A command that answered None is not run again for `retry_after_s`; until then `run` returns
      None at once. `fail(argv)` puts a command that answered something useless (e.g. "Permission
      Denial") under the same rule.
    - An answer is reused, without running the command, for `cache_s` seconds after it came.
    `retry_in_s(argv)` says how long a failed command still waits (for the warning line); `answer`
    runs, warns and parses as every reader does.
    """

    def __init__(self, runner: CommandRunner, clock: Callable[[], float] = time.monotonic,
                 retry_after_s: float = RETRY_AFTER_S):
        self.runner = runner
        self.clock = clock
        self.retry_after_s = retry_after_s
        self._failed_at: dict[str, float] = {}
        self._cached: dict[str, tuple[float, str]] = {}

    def run(self, argv: Sequence[str], timeout_s: float, cache_s: float = 0.0) -> str | None:
        line, now = command_line(argv), self.clock()
        failed_at = self._failed_at.get(line)
        if failed_at is not None and now - failed_at < self.retry_after_s:
            return None
        cached = self._cached.get(line)
        if cached is not None and now - cached[0] < cache_s:
            return cached[1]
        try:
            out = self.runner(argv, timeout_s)
        except Exception:  # a runner must not raise; a broken one is treated as "no answer"
            out = None
        if out is None:
            self.fail(argv)
            return None
        self._failed_at.pop(line, None)
        self._cached[line] = (now, out)
        return out

    def answer(self, argv: Sequence[str], timeout_s: float, warn: Callable[[str], None], cache_s: float = 0.0,
               parse: Callable[[str], object] | None = None):
        """`run`, saying through `warn` when there is no answer. With `parse`: the parsed answer, and an
        answer it cannot read (None) is warned about and put under the retry rule (`fail`)."""
        line = command_line(argv)
        out = self.run(argv, timeout_s, cache_s)
        if out is None:
            warn(f"{line}: no answer (missing, failed or timed out); retry in {self.retry_in_s(argv):.0f} s")
            return None
        if parse is None:
            return out
        value = parse(out)
        if value is None:
            warn(f"{line}: unexpected output {out.strip()[:32]!r}")
            self.fail(argv)
        return value

    def fail(self, argv: Sequence[str]) -> None:
        """Do not run `argv` again for `retry_after_s` (and forget its cached answer)."""
        line = command_line(argv)
        self._failed_at[line] = self.clock()
        self._cached.pop(line, None)

    def retry_in_s(self, argv: Sequence[str]) -> float:
        """Seconds until a failed command may run again (0 when it may run now)."""
        failed_at = self._failed_at.get(command_line(argv))
        if failed_at is None:
            return 0.0
        return max(0.0, self.retry_after_s - (self.clock() - failed_at))

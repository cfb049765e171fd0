"""The daemon's log: one line per request and the server's notes, in text or JSON, written to
standard error by a thread of its own (`BackgroundLog`), so that a log that cannot keep up costs
lines, not service. `setup_logging` points the server's, the power controller's and uvicorn's
loggers at it; `json_warning` and `text_warning` send Python's warnings the same way."""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time


class JSONLines(logging.Formatter):
    """--log-format json: a request's line (already a JSON object) with "time" put first, any other
    line (a prompt with --log-prompts, the drain on SIGTERM, the power controller's notes) as {"time",
    "level", "logger", "message"}: every line one JSON object, each with its time (seconds since the
    epoch; a request's line had none: a soak)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if message.startswith("{"):
            rest = message[1:].lstrip()
            return f'{{"time": {round(record.created, 3)}' + ("}" if rest.startswith("}") else ", " + rest)
        return json.dumps({"time": round(record.created, 3), "level": record.levelname.lower(),
                           "logger": record.name, "message": message})


class TextLines(logging.Formatter):
    """--log-format text: the server's lines after a time stamp; the start-up lines (`plain`), the power
    controller's notes (their own "edgeinfer power:") and uvicorn's warnings as they are."""

    def __init__(self):
        super().__init__("%(asctime)s edgeinfer %(message)s")
        self.as_is = logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "plain", False) or record.name != "edgeinfer.server":
            return self.as_is.format(record)
        return super().format(record)


class BackgroundLog(logging.Handler):
    """The daemon's log lines, written to `target` by a thread of their own: the thread that logs (the
    event loop, for every request's line) only queues the line, so a log that cannot keep up costs
    lines, not service (standard error a pipe nobody read: once it filled, every request and /health
    hung, and SIGTERM with them; a review). At most `capacity` lines wait; past that a line is dropped
    and counted (`dropped`). `flush` waits up to FLUSH_S for the lines queued (logging flushes its
    handlers at exit: the last lines are written if the log can take them)."""

    FLUSH_S = 2.0

    def __init__(self, target: logging.Handler, capacity: int = 10_000):
        super().__init__()
        self.target, self.capacity, self.dropped = target, capacity, 0
        self.start()

    def start(self) -> None:
        """An empty queue and a thread that writes it (again in a forked child, which has no thread of
        its parent's: lines the parent had queued are the parent's to write)."""
        self.lines = queue.Queue(self.capacity)
        threading.Thread(target=self._write, name="edgeinfer-log", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None  # its arguments as they are now
            self.lines.put_nowait(record)
        except Exception:  # the queue full, or a line that does not format: dropped (`handleError` would
            self.dropped += 1  # write to standard error from this thread, which may be what cannot keep up)

    def _write(self) -> None:
        while True:
            record = self.lines.get()
            try:
                self.target.handle(record)  # (a write that fails is the target's handleError: dropped)
            finally:
                self.lines.task_done()

    def flush(self) -> None:
        deadline = time.monotonic() + self.FLUSH_S
        while self.lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)


_background: BackgroundLog | None = None  # the process's one log thread (`setup_logging`)
_background_lock = threading.Lock()


def _log_again_in_child() -> None:
    """After fork() in the child: the log's thread was the parent's; start the child's own."""
    global _background_lock
    _background_lock = threading.Lock()  # (it may have been held by another thread of the parent)
    if _background is not None:
        _background.start()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_log_again_in_child)


def setup_logging(fmt: str) -> None:
    """The server's log (its lines, the power controller's, uvicorn's warnings) to standard error, in
    `fmt`, through the process's one `BackgroundLog`: the first call starts its thread, a later one
    (an application serving again in the same process) waits for the lines queued (as `flush` does)
    and points it at standard error as it is now, in the new format, rather than leave an idle thread
    behind for each `serve`. Its `dropped` counts from the first call. As text, the power controller's
    and uvicorn's lines keep their levels (warnings), as they were printed before they went through
    it."""
    global _background
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JSONLines() if fmt == "json" else TextLines())
    with _background_lock:
        if _background is None:
            _background = BackgroundLog(stream)
        else:
            _background.flush()
            _background.target = stream
        handler = _background
    for name in ("edgeinfer.server", "edgeinfer.power", "uvicorn"):  # (`uvicorn_server` then leaves uvicorn's
        logger = logging.getLogger(name)  # loggers alone: log_config=None)
        logger.handlers[:] = [handler]
        logger.propagate = False
        if name == "edgeinfer.server" or (fmt == "json" and name == "edgeinfer.power"):
            logger.setLevel(logging.INFO)


def json_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` under --log-format json: a warning met while the model loads (threads past
    the cores, a CUDA fallback) as a JSON line, not the CLI's plain "edgeinfer: warning: ..." (a review)."""
    logging.getLogger("edgeinfer.server").warning("%s", message)


def text_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` under --log-format text: the CLI's "edgeinfer: warning: ..." line, written
    through the server's log (`BackgroundLog`) like every other line."""
    logging.getLogger("edgeinfer.server").warning("edgeinfer: warning: %s", message, extra={"plain": True})

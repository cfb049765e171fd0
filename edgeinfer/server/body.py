"""A request's body: read within its limits on the event loop (`read_body`), its bytes counted against
the server's `BodyBudget` as they arrive, parsed as JSON in the tokenizing thread (`parse_json`), so
that the bodies a burst brings are held as their bytes, at most the budget's, and only one at a
time becomes Python objects.

Why parsing waits for that thread: JSON's objects cost many times their text (a 1 MiB list of empty
objects is 17 MiB of dicts; 29,000 one-letter chat messages, 8 MiB), and a burst of such bodies, all
parsed as they arrived while the tokenizing thread took them one by one, took the bundled model's
service from 81 to 725 MiB with 40 requests of the first kind (257 MiB of the second; its unit:
145M), and without bound with more.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from starlette.requests import ClientDisconnect, Request

from edgeinfer.server.protocol import APIError

BODY_READ_S = 30.0  # the most a request body may take to arrive (a 1 MiB body at 35 kB/s)
DRAIN_CHECK_S = 0.25  # how often a body still arriving looks whether the server began to drain


class BodyBudget:
    """The bytes of request bodies the server holds before their requests are admitted or refused, at
    most `capacity_bytes` (slots + queue bodies of max_body_bytes: what the systemd unit counts).
    Bytes are counted as they arrive, not as Content-Length declares them, so a slow upload holds
    what it sent (counting whole requests from the start, slots + queue stalled uploads of ten bytes
    turned every other request away for 30 s: a review). Used from the event loop only."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0

    def hold(self) -> "BodyHold":
        return BodyHold(self)


class BodyHold:
    """One request's share of a BodyBudget: `take(n)` as its bytes arrive (APIError 429, with `over`
    set, when they would pass the capacity), all given back on leaving the `with` block."""

    def __init__(self, budget: BodyBudget):
        self.budget, self.held_bytes, self.over = budget, 0, False

    def take(self, n: int) -> None:
        if self.budget.held_bytes + n > self.budget.capacity_bytes:
            self.over = True
            raise APIError(429, f"the server holds as many request bodies as it takes "
                                f"({self.budget.capacity_bytes} bytes); retry shortly", type="rate_limit_error",
                           code="queue_full")
        self.budget.held_bytes += n
        self.held_bytes += n

    def __enter__(self) -> "BodyHold":
        return self

    def __exit__(self, *exc) -> None:
        self.budget.held_bytes -= self.held_bytes
        self.held_bytes = 0


async def read_body(request: Request, limit: int, draining: Callable[[], bool], hold: BodyHold) -> bytearray:
    """The body's bytes, at most `limit` (413 past it, before reading where Content-Length says so),
    each part taken from `hold` as it arrives (429 past the budget); 415 for a compressed body, 408
    past BODY_READ_S, 503 once `draining()` (SIGTERM) while it still arrives, 499 when the client
    leaves meanwhile: each an APIError."""
    coding = request.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):  # a gzip body was read as JSON and refused as "not valid JSON"
        raise APIError(415, f"Content-Encoding {coding[:40]!r} is not supported: send the body uncompressed",
                       code="unsupported_content_encoding")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}", code="body_too_large")
    body = bytearray()

    async def read() -> None:
        async for part in request.stream():
            if len(body) + len(part) > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")
            hold.take(len(part))
            body.extend(part)

    reading = asyncio.ensure_future(read())
    deadline = time.monotonic() + BODY_READ_S  # a client that declares more than it sends would hold on for ever
    try:
        while not reading.done():
            await asyncio.wait({reading}, timeout=DRAIN_CHECK_S)
            if draining() and not reading.done():  # SIGTERM: a body still coming is not served, and
                raise APIError(503, "the server is shutting down; retry on another instance or later",
                               type="server_error", code="shutting_down")  # not cut off with a traceback later
            if time.monotonic() > deadline and not reading.done():
                raise APIError(408, f"the request body did not arrive within {BODY_READ_S:g} s",
                               code="request_timeout")
        reading.result()
    except ClientDisconnect:  # nobody will read the answer; not a server error
        raise APIError(499, "the client went away while sending its body", code="client_closed") from None
    finally:
        reading.cancel()
    return body


def drop(body: bytearray) -> None:
    """Empty a body whose request was given up while it waited for the tokenizing thread: the
    executor's queue keeps the call, and so the body, until that thread reaches it (bodies of
    clients that left piled up there past the budget: a review). One the thread is reading now is
    left to it."""
    try:
        body.clear()
    except BufferError:
        pass


def parse_json(body: bytes | bytearray):
    """The body as JSON (any value: the protocol checks its shape), or a 400 APIError."""
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None

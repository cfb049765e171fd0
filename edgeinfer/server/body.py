"""A request's body: read within its limits on the event loop (`read_body`), parsed as JSON in the
tokenizing thread (`parse_json`), so that the bodies a burst brings are held as their bytes and only
one at a time becomes Python objects.

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


async def read_body(request: Request, limit: int, draining: Callable[[], bool]) -> bytearray:
    """The body's bytes, at most `limit` (413 past it, before reading where Content-Length says so);
    415 for a compressed body, 408 past BODY_READ_S, 503 once `draining()` (SIGTERM) while it still
    arrives, 499 when the client leaves meanwhile: each an APIError."""
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
            body.extend(part)
            if len(body) > limit:
                raise APIError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")

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


def parse_json(body: bytes | bytearray):
    """The body as JSON (any value: the protocol checks its shape), or a 400 APIError."""
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None

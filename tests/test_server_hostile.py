"""Hostile tests for the daemon (`edgeinfer serve`): a careless or hostile client against a real
server on a free loopback port (the `Running` helper of test_server.py).

Each test reproduces one defect found by attacking the server, and passes once that defect is
fixed; its docstring gives the expected and the actual behaviour. None is marked xfail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import edgeinfer
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.server.config import ServeConfig
from edgeinfer.server.run import AFTER_DRAIN_S
from test_server import KEY, Running

MODEL = "stories260K-int8"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _shaped(resp: httpx.Response) -> bool:
    """An OpenAI-shaped error body: {"error": {"message", "type", "param", "code"}}."""
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}


def _raw(body: dict, path: str = "/v1/completions") -> bytes:
    b = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(b)}\r\n\r\n").encode() + b


def _health(r) -> dict:
    return httpx.get(r.url + "/health", timeout=5).json()


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


@pytest.fixture(scope="module")
def model():
    return edgeinfer.load()


@pytest.fixture(scope="module")
def srv(model):
    r = Running(ServeConfig(api_key=KEY, slots=2, queue=2, max_tokens_limit=64, max_body_bytes=20_000), model=model)
    yield r
    r.stop()


@pytest.fixture
def one_slot(model):
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=20_000, max_prompt_tokens=200_000), model=model)
    yield r  # (prompts far past the ring: long prefills to interrupt)
    r.stop()


# --- bad input that reaches the 500 handler -----------------------------------------------------------

def _settle() -> None:
    """Let the server thread finish logging a traceback before this thread fails a test: Python
    3.11's traceback formatting calls ast.parse, whose module state two threads must not share
    (a race there is pytest's INTERNALERROR "AST constructor recursion depth mismatch")."""
    time.sleep(0.3)


def _assert_400_and_still_serving(srv, resp):
    ok = httpx.post(srv.url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    _settle()
    assert resp.status_code == 400 and _shaped(resp), (resp.status_code, resp.text[:200])
    assert ok.status_code == 200


def test_deeply_nested_json_is_a_400_not_a_500(srv):
    """A 10 kB body of nested arrays (or objects), far under max_body_bytes. Expected: 400 "not valid
    JSON" like any other unparsable body. Actual: json.loads raises RecursionError, which read_json
    does not catch: 500 "internal server error" and two tracebacks in the log per request."""
    for body in (b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000):
        resp = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, content=body)
        _assert_400_and_still_serving(srv, resp)


def test_integer_past_pythons_digit_limit_is_a_400_not_a_500(srv):
    """`"seed": 999...9` with 5000 digits (5 kB). Expected: 400 (invalid JSON or seed out of range).
    Actual: json.loads raises a plain ValueError ("Exceeds the limit (4300 digits) for integer string
    conversion"), not a JSONDecodeError, so read_json lets it through: 500 and a traceback."""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "x"}], "seed": %s}' % (MODEL, "9" * 5000))
    resp = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, content=body.encode())
    _assert_400_and_still_serving(srv, resp)


@pytest.mark.parametrize("raw_model", [b'"\\ud800x"', b'"\xed\xa0\x80"'])
def test_unknown_model_with_a_lone_surrogate_is_a_404_not_a_500(srv, raw_model):
    """`"model": "\\ud800x"` (a JSON escape), or the same code point as raw bytes (json.loads decodes
    bytes with surrogatepass). Expected: OpenAI's 404 model_not_found (or a 400). Actual: the 404's
    message embeds the raw name, JSONResponse cannot encode the lone surrogate as UTF-8, and the
    UnicodeEncodeError becomes a 500 "internal server error" with a traceback."""
    body = b'{"model": ' + raw_model + b', "prompt": "hi", "max_tokens": 2}'
    resp = httpx.post(srv.url + "/v1/completions", headers=AUTH, content=body)
    _settle()
    assert resp.status_code in (400, 404) and _shaped(resp), (resp.status_code, resp.text[:200])


@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions/"), ("POST", "/v1/completions/"),
                                         ("GET", "/v1/models/"), ("GET", "/health/")])
def test_a_trailing_slash_is_a_404_naming_the_route_not_an_empty_307(srv, method, path):
    """curl -X POST .../v1/chat/completions/ got Starlette's 307 with an empty body, which a client that
    does not follow a POST's redirect (httpx, the openai client) shows as a bare error. Expected:
    OpenAI's error shape, naming the route without the slash."""
    resp = httpx.request(method, srv.url + path, headers=AUTH, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 404 and _shaped(resp), (resp.status_code, resp.text[:200])
    assert f"without the trailing slash: {path.rstrip('/')}" in resp.json()["error"]["message"]


def test_a_request_target_in_absolute_form_is_served_as_its_path(srv):
    """`POST http://127.0.0.1:PORT/v1/completions HTTP/1.1` (the absolute form, which a server must
    accept: RFC 9112 3.2.2; some proxies forward it) was a 404: uvicorn's h11 gives the whole URL as
    the path. Now it is the route its path names; the key is still asked for."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "temperature": 0}
    for target, key, want in [(f"http://127.0.0.1:{srv.port}/v1/completions", True, 200),
                              (f"HTTP://127.0.0.1:{srv.port}/v1/completions", False, 401),
                              (f"http://127.0.0.1:{srv.port}/v1/nothing", True, 404)]:
        head, _, payload = _raw(body, target).partition(b"\r\n\r\n")
        extra = f"Authorization: Bearer {KEY}\r\n" if key else ""
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(head + f"\r\n{extra}Connection: close\r\n\r\n".encode() + payload)
            reply = b""
            while more := s.recv(1 << 16):
                reply += more
        status = int(reply.split(b" ", 2)[1])
        assert status == want, reply[:300]
        if want == 200:
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def test_an_absolute_target_without_raw_path_keeps_its_path():
    """A review: with no raw_path in the scope (an ASGI server other than uvicorn, a direct call), the
    fallback cut the already cut path again: "http://h/v1/chat/completions" gave raw_path b"/completions"."""
    import asyncio

    from edgeinfer.server.app import _Gate, _origin_form

    seen = {}

    async def app(scope, receive, send):
        seen.update(path=scope["path"], raw=scope["raw_path"])

    server = type("S", (), {"draining": False, "forked_busy": False, "authorized": lambda self, r: True,
                            "config": type("C", (), {"api_key": KEY})()})()
    for scope in ({"path": "http://h/v1/chat/completions"},
                  {"path": "http://h/v1/chat/completions", "raw_path": b"http://h/v1/chat/completions"}):
        asyncio.run(_Gate(app, server)({"type": "http", "headers": [], **scope}, None, None))
        assert seen == {"path": "/v1/chat/completions", "raw": b"/v1/chat/completions"}
    assert [_origin_form(t) for t in ("http://h", "http://h/", "https://h:1/v1//x", b"http://h/a%20b")] == \
        ["/", "/", "/v1//x", b"/a%20b"]


def test_405_carries_an_allow_header(srv):
    """GET /v1/chat/completions. Expected: 405 with `Allow: POST` (RFC 9110 15.5.6: a 405 MUST carry
    Allow; Starlette's own 405 does). Actual: the app's HTTPException handler rebuilds the response
    and drops exc.headers, so there is no Allow header."""
    resp = httpx.get(srv.url + "/v1/chat/completions", headers=AUTH)
    assert resp.status_code == 405 and _shaped(resp)
    assert "POST" in resp.headers.get("allow", ""), dict(resp.headers)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_client_gone_mid_body_is_not_logged_as_an_internal_error(srv):
    """A client sends the headers (Content-Length: 400) and part of the body, then closes. Expected:
    the request is dropped quietly (at most one info line / a 499 in the metrics). Actual:
    starlette's ClientDisconnect escapes read_json, reaches the catch-all handler: "internal error"
    with a traceback from edgeinfer.server plus "Exception in ASGI application" with another from
    uvicorn, for every such connection (a cheap way to flood the log)."""
    handler = _Records()
    loggers = [logging.getLogger("edgeinfer.server"), logging.getLogger("uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"model\": \"st")
            time.sleep(0.05)
            s.close()
        time.sleep(1.5)  # every traceback logged (see _settle) before the verdict
        assert not handler.records, [r.getMessage()[:100] for r in handler.records]
        assert _health(srv)["slots_busy"] == 0
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def test_a_body_that_never_arrives_is_answered_408_and_its_connection_closed(srv, monkeypatch):
    """A client declares Content-Length: 400, sends 10 bytes and waits with the connection open (a
    slow-loris): the server answers 408 when the body is late, instead of holding it for ever."""
    import edgeinfer.server.body as body

    monkeypatch.setattr(body, "BODY_READ_S", 0.5)
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"model\": \"st")
        s.settimeout(10)
        t0 = time.monotonic()
        reply = b""
        while b"request_timeout" not in reply:
            part = s.recv(4096)
            if not part:
                break
            reply += part
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:300]
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
    assert _health(srv)["slots_busy"] == 0


def test_connections_that_never_finish_a_request_head_are_closed(srv, monkeypatch):
    """Connections that sent nothing, half a head, or a head one byte at a time were held for ever
    (uvicorn times out only after a response): enough of them ran the daemon out of file
    descriptors and /health stopped answering. Each is now closed when its head is late, however it
    trickles, and so is one still trickling a body the server already refused (413); a client that
    sends its next head in time on a kept-alive connection, a request whose body is still coming (it
    has the body's own timeout) and /health are untouched."""
    import edgeinfer.server.run as run

    monkeypatch.setattr(run, "HEAD_READ_S", 1.0)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\n")
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    idle, half, trickle, slow, early = (socket.create_connection(("127.0.0.1", srv.port)) for _ in range(5))
    keep = None
    try:
        half.sendall(head[:40])
        body = json.dumps({"model": "stories260K-int8", "prompt": "Once", "max_tokens": 4}).encode()
        slow.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))  # the head in time, the body late
        early.sendall(head + b"Content-Length: 99999999\r\n\r\n")  # refused at once (413), then trickled
        t0 = time.monotonic()
        with pytest.raises(OSError):  # the server closed it: a byte sent after that fails
            for i in range(15):  # a byte every 0.2 s: 3 s of a head that never ends
                trickle.sendall(head[i:i + 1])
                time.sleep(0.2)
        assert time.monotonic() - t0 < 2.5
        with pytest.raises(OSError):  # the rest of a body already answered 413, trickled: closed too
            for _ in range(15):
                early.sendall(b"x")
                time.sleep(0.2)
        for s in (idle, half):
            s.settimeout(5)
            assert s.recv(4096) == b"", "the server closes it"
        assert time.monotonic() - t0 < 6
        keep = socket.create_connection(("127.0.0.1", srv.port))
        keep.settimeout(5)
        for i in range(4):  # 4 heads 0.6 s apart: 2.4 s in all, each in time after the last response
            keep.sendall(health)
            reply = b""
            while not reply.rstrip().endswith(b"}"):
                part = keep.recv(65536)
                assert part, f"the kept-alive connection was closed after {i} replies"
                reply += part
            assert reply.startswith(b"HTTP/1.1 200")
            time.sleep(0.6)
        slow.sendall(body)  # seconds after its head: a request in progress has the body's own timeout (30 s)
        slow.settimeout(10)
        assert slow.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for s in (idle, half, trickle, slow, early, keep):
            if s is not None:
                s.close()


def test_an_early_413_closes_its_connection_once_answered(srv):
    """A body declared too large is refused before it is read, so the connection cannot carry another
    request: the answer says Connection: close and the server closes it then, rather than leaving a
    client still uploading to be cut off at the head deadline (30 s later) before it reads the 413."""
    s = socket.create_connection(("127.0.0.1", srv.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 99999999\r\n\r\n{")
        s.settimeout(10)
        t0, reply = time.monotonic(), b""
        while True:
            part = s.recv(65536)
            if not part:
                break
            reply += part
        assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
        assert time.monotonic() - t0 < 5  # closed once answered, not at a deadline
    finally:
        s.close()


def test_cors_preflight_is_not_refused_for_want_of_an_api_key(model):
    """A server with an API key and cors_origins (a browser app calling it). The browser's preflight
    (OPTIONS with Origin and Access-Control-Request-Method, never an Authorization header) must be
    answered by the CORS middleware. Actual: the _Gate middleware is added outside CORSMiddleware,
    so the preflight is a 401 without any Access-Control-* header, and the browser never sends the
    real request: CORS cannot work together with a key."""
    r = Running(ServeConfig(api_key=KEY, slots=1, queue=1, cors_origins=("http://app.example",)), model=model)
    try:
        pre = httpx.options(r.url + "/v1/chat/completions",
                            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                     "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200, (pre.status_code, pre.text[:200])
        assert pre.headers.get("access-control-allow-origin") == "http://app.example"
        real = httpx.post(r.url + "/v1/completions",
                          json={"model": "stories260K-int8", "prompt": "Hi", "max_tokens": 2},
                          headers={"Origin": "http://app.example", "Authorization": f"Bearer {KEY}"})
        exposed = {h.strip().lower() for h in real.headers.get("access-control-expose-headers", "").split(",")}
        assert {"retry-after", "x-edgeinfer-dropped-tokens"} <= exposed  # a page's script may read them (a hostile
        submit = r.server.tokenize_pool.submit  # round: a 503's Retry-After was hidden from a web client)
        r.server.tokenize_pool.submit = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug"))
        try:  # a bug's 500 reaches the page too (a review: it had no CORS headers, a network error to a script)
            bug = httpx.post(r.url + "/v1/completions", json={"model": "stories260K-int8", "prompt": "Hi"},
                             headers={"Origin": "http://app.example", "Authorization": f"Bearer {KEY}"})
        finally:
            r.server.tokenize_pool.submit = submit
        assert bug.status_code == 500 and bug.json()["error"]["type"] == "server_error"
        assert bug.headers.get("access-control-allow-origin") == "http://app.example"
        from edgeinfer.server import answer

        log_line = answer.Reply._log
        answer.Reply._log = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug in the log line"))
        try:  # a bug after the reply's own count: one request, one count (a review: a 200 and a 500)
            late = httpx.post(r.url + "/v1/completions", json={"model": "stories260K-int8", "prompt": "Hi",
                                                               "max_tokens": 2},
                              headers={"Authorization": f"Bearer {KEY}"})
        finally:
            answer.Reply._log = log_line
        assert late.status_code == 500
        metrics = httpx.get(r.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert 'edgeinfer_requests_total{endpoint="completions",status="500"} 2.0' in metrics  # (counted nowhere)
        assert 'edgeinfer_requests_total{endpoint="completions",status="200"} 1.0' in metrics  # the first request
    finally:
        r.stop()


# --- clients that go away: slots and queue places that are not freed ----------------------------------

def test_non_streamed_request_is_cancelled_when_its_client_disconnects(one_slot):
    """A non-streamed completion (max_tokens 10000, ignore_eos: ~7 s here) whose client closes
    the connection after 0.3 s (what a client timeout does). Expected: the job is cancelled within
    about one token and the slot freed (the module docstring and _next_or_disconnect promise it).
    Actual: _next_or_disconnect checks request.is_disconnected() only when no token came for 0.25 s;
    tokens come faster than that, so the check never runs and the slot stays busy until all 10000
    tokens are generated for nobody (with a client that retries on timeout, ghosts pile up)."""
    s = socket.create_connection(("127.0.0.1", one_slot.port))
    s.sendall(_raw({"model": MODEL, "prompt": "Once", "max_tokens": 10_000, "ignore_eos": True}))
    assert _wait(lambda: _health(one_slot)["slots_busy"] == 1, 5)
    time.sleep(0.3)
    s.close()
    t0 = time.monotonic()
    freed = _wait(lambda: _health(one_slot)["slots_busy"] == 0, 1.5)
    assert freed, f"slot still busy {time.monotonic() - t0:.1f} s after the client left"


def test_disconnect_while_queued_frees_the_queue_place(one_slot):
    """slots=1, queue=1: A streams (long), B is queued, B's client closes. Expected: B leaves the
    queue (queue_depth 0) and a new request C is queued rather than refused. Actual: while queued
    the handler awaits the job's first event and watches nothing, and the scheduler's Cancelled path
    is never triggered: B keeps its queue place until A ends (then prefills and generates a token for
    nobody), /health shows queue_depth 1, and C gets 429 queue_full."""
    a = socket.create_connection(("127.0.0.1", one_slot.port))
    a.sendall(_raw({"model": MODEL, "prompt": "Once", "max_tokens": 20_000, "ignore_eos": True, "stream": True}))
    a.recv(4096)
    b = socket.create_connection(("127.0.0.1", one_slot.port))
    b.sendall(_raw({"model": MODEL, "prompt": "Once", "max_tokens": 5, "stream": True}))
    c = None
    try:
        assert _wait(lambda: _health(one_slot)["queue_depth"] == 1, 5)
        b.close()
        left = _wait(lambda: _health(one_slot)["queue_depth"] == 0, 1.5)
        c = socket.create_connection(("127.0.0.1", one_slot.port))
        c.settimeout(0.7)
        c.sendall(_raw({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}))
        try:
            head = c.recv(4096)
        except socket.timeout:
            head = b""  # queued: no answer yet, as expected
        assert left, f"queue place still held after its client left: {_health(one_slot)}"
        assert not head.startswith(b"HTTP/1.1 429"), head[:200]
    finally:
        a.close()
        if c is not None:
            c.close()
        _wait(lambda: _health(one_slot)["slots_busy"] == 0 and _health(one_slot)["queue_depth"] == 0, 10)


def test_disconnect_during_a_long_prefill_frees_the_slot(one_slot):
    """A streamed completion with a 60 000-token prompt (120 kB, under the 1 MiB body limit), whose
    client closes once the slot is busy. Expected: the slot is freed promptly (the doc: "cancelled
    within one token"). Actual: until the first token the handler watches nothing, and prefill never
    looks at `cancelled`: the slot stays busy for the whole prefill (~8 s here for a 260K-parameter
    model; a 1 MiB prompt held it 68 s, and on a real model on a Pi it would be hours), and the
    request is only dropped after its first token."""
    s = socket.create_connection(("127.0.0.1", one_slot.port))
    s.sendall(_raw({"model": MODEL, "prompt": "a " * 60_000, "max_tokens": 5, "stream": True}))
    assert _wait(lambda: _health(one_slot)["slots_busy"] == 1, 5)
    s.close()
    t0 = time.monotonic()
    freed = _wait(lambda: _health(one_slot)["slots_busy"] == 0, 1.5)
    assert freed, f"slot still busy {time.monotonic() - t0:.1f} s after the client left"


# --- prefix reuse changes answers: a request's reply depends on what the slot held ---------------------

@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.5},
                                     {"presence_penalty": 1.5}])
def test_same_request_twice_gives_the_same_greedy_reply_with_penalties(model, penalty):
    """The same greedy request twice on a one-slot server, with a penalty. Expected: the same text both
    times, equal to the in-process model's (the second only reports cached_tokens). Actual: the second
    request reuses the slot's prefix, and Generation builds the Sampler's penalty history from the
    fed suffix only (`Sampler(..., feed)`), so the penalties no longer see the prompt: another reply.
    A reply thus depends on what an earlier request (anyone's) left in the slot."""
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=64), model=model)
    prompt = ("Once upon a time there was a little girl named Lily. She liked to play with her ball in the "
              "park. One day she saw a big dog. The dog ran")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **penalty}
    try:
        first = httpx.post(r.url + "/v1/completions", json=body, timeout=30).json()
        second = httpx.post(r.url + "/v1/completions", json=body, timeout=30).json()
    finally:
        r.stop()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the path under test
    openai_rule = {} if "repetition_penalty" in penalty else dict(penalize_prompt=False, penalty_last_n=40)
    want = edgeinfer.load().generate(prompt, max_new_tokens=40, temperature=0, ignore_eos=True, **penalty,
                                     **openai_rule).text  # (OpenAI's penalties count the reply alone)
    assert first["choices"][0]["text"] == want
    assert second["choices"][0]["text"] == want


def test_truncate_with_a_reused_prefix_drops_the_oldest_tokens_not_the_newest():
    """overflow=truncate, capacity 64, one slot. Request P (30 tokens, fits) leaves P in the slot; then X
    = P + 29 more tokens, max_tokens 30 (does not fit: 25 tokens must go). Expected (docs: "the
    oldest prompt tokens (after the sinks) are dropped"): the reply equals X served on a fresh slot.
    Actual: fit_prompt runs on the suffix after the reused prefix, so the whole old prefix is kept
    and the *newest* tokens are dropped (only the last 4 of the 29 new ones stay): a different reply,
    continuing text the client meant to be forgotten."""
    served = edgeinfer.load(capacity_tokens=64, overflow="truncate")
    fresh = edgeinfer.load(capacity_tokens=64, overflow="truncate")
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=64, overflow="truncate"), model=served)
    p = "Once upon a time there was a little girl named Lily. She liked to play with her ball in the park."
    x = p + " One day she saw a big dog. The dog was very friendly and wagged its tail. Lily"
    try:
        httpx.post(r.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0})
        got = httpx.post(r.url + "/v1/completions", timeout=30,
                         json={"model": MODEL, "prompt": x, "max_tokens": 30, "temperature": 0,
                               "ignore_eos": True}).json()
    finally:
        r.stop()
    want = fresh.generate(x, max_new_tokens=30, temperature=0, ignore_eos=True)
    assert got["usage"]["dropped_tokens"] == want.usage.dropped_tokens
    assert got["choices"][0]["text"] == want.text


# --- shutdown -----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc) -> None:
    """A server process started by `_start_process` gone, whatever a test left it doing."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stderr.close()


def _body_to_end(s: socket.socket, timeout_s: float) -> bytes:
    """What the server sends on `s` until its chunked body ends (failing if it closes before)."""
    s.settimeout(timeout_s)
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        more = s.recv(1 << 16)
        assert more, f"the server closed without ending the body: {data[-300:]!r}"
        data += more
    return data


def _start_process(*extra: str, preexec_fn=None):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "serve", "--port", str(port), "--slots", "1",
                             "--queue", "2", "--max-tokens-limit", "20000", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, port, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
        time.sleep(0.1)


def test_second_sigterm_exits_promptly_even_during_a_long_prefill():
    """`edgeinfer serve` busy prefilling a 150 000-token prompt; SIGTERM, then SIGTERM again.
    Expected (run.py, docs: "a second signal stops at once"): the process exits within a second or
    two. Actual: uvicorn stops, but the worker thread is in a prefill that never checks
    `cancelled`, and the interpreter joins the ThreadPoolExecutor's threads at exit: the process
    lives until the prefill ends (~20 s here; hours for a real model on a
    Pi, until systemd's SIGKILL)."""
    proc, port, url = _start_process("--grace-s", "1", "--max-prompt-tokens", "200000")
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(_raw({"model": MODEL, "prompt": "a " * 150_000, "max_tokens": 5}))
        assert _wait(lambda: httpx.get(url + "/health").json()["slots_busy"] == 1, 10)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        assert proc.poll() is not None, f"still running {time.monotonic() - t0:.1f} s after the second SIGTERM"
    finally:
        s.close()
        _stop(proc)


def test_second_sigterm_answers_queued_requests_openai_shaped():
    """One request streams, one non-streamed request is queued; SIGTERM twice (stop at once). Expected:
    the queued request gets an OpenAI-shaped error (503 shutting_down), or at worst its connection is
    closed. Actual: uvicorn cancels the handler awaiting the job's first event; the CancelledError
    escapes the app, uvicorn logs "Exception in ASGI application" with a traceback and answers its
    own text/plain "500 Internal Server Error"."""
    proc, port, url = _start_process("--grace-s", "30")
    a = socket.create_connection(("127.0.0.1", port))
    b = socket.create_connection(("127.0.0.1", port))
    try:
        a.sendall(_raw({"model": MODEL, "prompt": "Once", "max_tokens": 20_000, "ignore_eos": True, "stream": True}))
        a.recv(4096)
        b.sendall(_raw({"model": MODEL, "prompt": "Once", "max_tokens": 20}))
        assert _wait(lambda: httpx.get(url + "/health").json()["queue_depth"] == 1, 5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        b.settimeout(5)
        data = b""
        while True:
            try:
                d = b.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not d:
                break
            data += d
        if data:
            head, _, body = data.partition(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0]
            assert b" 500 " not in status, data[:300]
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}
        assert "Exception in ASGI application" not in proc.stderr.read()
    finally:
        a.close()
        b.close()
        _stop(proc)


def test_a_freed_slot_goes_to_the_waiting_request_admitted_first():
    """The queue is first come, first served: waiters were woken all at once and the quickest took
    the slot, so under load a request could be overtaken again and again (served seventh of nine).
    Here the waiters reach `take` in the reverse of their admission; one withdraws before it gets
    there and one is cancelled while it waits: neither holds up the line."""
    import threading

    from edgeinfer.server.scheduler import Cancelled, Scheduler

    sched = Scheduler(edgeinfer.load(capacity_tokens=64), slots=1, queue=10)
    slot, _ = sched.take(sched.admit(), [1, 2], threading.Event(), 4)
    gone = sched.admit()  # admitted, then never queued (withdrawn)
    order, cancelled, threads = [], {}, []

    def wait(ticket: int, i: int) -> None:
        try:
            s, _ = sched.take(ticket, [1, 2], cancelled[i], 4)
        except Cancelled:
            order.append(("cancelled", i))
            return
        order.append(i)
        time.sleep(0.01)  # holds the slot a moment: every other waiter wakes meanwhile
        sched.give_back(s)

    for i in range(8):
        cancelled[i] = threading.Event()
        threads.append(threading.Thread(target=wait, args=(sched.admit(), i)))
    for t in reversed(threads):
        t.start()
        time.sleep(0.01)
    sched.withdraw(gone)
    cancelled[2].set()
    time.sleep(0.3)  # every waiter has reached take; 2 has given up its place
    sched.give_back(slot)
    for t in threads:
        t.join(10)
    assert order == [("cancelled", 2), 0, 1, 3, 4, 5, 6, 7]
    assert sched.waiting == 0 and not sched._line and sched.busy == 0


def _completion_tokens_total(r) -> float:
    text = httpx.get(r.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("edgeinfer_completion_tokens_total ")))


def test_tokens_of_a_stream_the_client_left_count_as_generated(srv):
    """edgeinfer_completion_tokens counted only requests that finished: the tokens of a stream its
    client left (499) or a shutdown cut (503) were work the device did and no counter showed."""
    before = _completion_tokens_total(srv)
    stream = srv.client().completions.create(model="stories260K-int8", prompt="Once upon a time", max_tokens=64,
                                             stream=True, extra_body={"ignore_eos": True})
    got = 0
    try:
        for chunk in stream:
            got += 1
            if got == 12:
                break
    finally:
        stream.close()
    assert _wait(lambda: _health(srv)["slots_busy"] == 0, 10)
    assert _wait(lambda: _completion_tokens_total(srv) - before >= 12, 10), _completion_tokens_total(srv) - before


def test_a_failure_while_taking_a_slot_gives_the_slot_and_the_place_back(monkeypatch):
    """The review's case: reuse() raising inside take() had taken the slot off the free list for
    good (and the request's worker ended with no answer); with the first-come line, a ticket that
    never left would stall every later request. The slot and the place come back; the error reaches
    the request."""
    import threading

    import edgeinfer.server.scheduler as sch

    sched = sch.Scheduler(edgeinfer.load(capacity_tokens=64), slots=1, queue=4)

    def broken(*a, **k):
        raise RuntimeError("broken reuse")

    monkeypatch.setattr(sch, "reuse", broken)
    with pytest.raises(RuntimeError, match="broken reuse"):
        sched.take(sched.admit(), [1, 2, 3], threading.Event(), 4)
    assert sched.busy == 0 and sched.waiting == 0 and not sched._line
    monkeypatch.undo()
    slot, kept = sched.take(sched.admit(), [1, 2, 3], threading.Event(), 4)  # the next request is served
    assert sched.busy == 1 and kept == 0


def test_a_request_whose_slot_cannot_be_taken_is_answered_and_the_next_is_served(srv, monkeypatch):
    """End to end: a failure inside take() (the review's broken reuse) reaches its client as a 500,
    streamed or not, and the next request gets its slot (before, the worker ended with no answer and
    the client waited for ever)."""
    import openai

    import edgeinfer.server.scheduler as sch

    def broken(*a, **k):
        raise RuntimeError("broken reuse")

    monkeypatch.setattr(sch, "reuse", broken)
    client = srv.client(timeout=20)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="stories260K-int8", prompt="Once", max_tokens=4)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="stories260K-int8", prompt="Once", max_tokens=4, stream=True)
    monkeypatch.undo()
    c = client.completions.create(model="stories260K-int8", prompt="Once", max_tokens=4)
    assert c.usage.completion_tokens == 4 and _health(srv)["slots_busy"] == 0


def test_a_request_read_as_the_drain_begins_is_refused_not_admitted_and_cut_off(one_slot):
    """A helper found that a request whose body was read just as SIGTERM came was admitted after the
    drain had counted 0 in flight, so uvicorn cut it off when it stopped: a text/plain 500, or a
    stream ended mid-reply. The drain now closes the scheduler under the lock admit takes, and a
    request after that gets the OpenAI-shaped 503."""
    sched = one_slot.server.scheduler
    assert sched.close() == 0  # as the drain does first; the app itself is not draining yet
    try:
        r = httpx.post(one_slot.url + "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    finally:
        sched.closed = False


def test_a_stalled_reader_holds_a_stop_for_the_grace_period_once_not_twice():
    """A helper found that a client that stops reading a stream made SIGTERM take 2 x grace_s (the
    drain waited it, then uvicorn waited it again): 60 s at the default 30, past the unit's
    TimeoutStopSec of 45, so systemd killed the server."""
    proc, port, url = _start_process("--grace-s", "8", "--power", "balanced", "--max-tokens-per-s", "400")
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.connect(("127.0.0.1", port))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20_000,
                "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}  # big events: sends block
        s.sendall(_raw(body, "/v1/chat/completions"))
        s.recv(2048)  # the head and a little of the stream; then this client stops reading
        time.sleep(3)  # paced: still generating at the signal, and the server's sends are blocked
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 8 + AFTER_DRAIN_S + 2, time.monotonic() - t0  # (was 2 x 8 s + 0.2)
    finally:
        s.close()
        _stop(proc)


def test_a_client_that_leaves_while_sending_its_body_is_counted_as_gone_not_as_a_bad_request(one_slot):
    """A helper found it counted as status 400, a client error, where leaving at any later point is 499."""
    def count(status: str) -> float:
        text = httpx.get(one_slot.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("edgeinfer_requests_total{") and f'status="{status}"' in line)

    before_499, before_400 = count("499"), count("400")
    host, port = one_slot.url[7:].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\"")
        time.sleep(0.3)
    assert _wait(lambda: count("499") == before_499 + 1, 10)
    assert count("400") == before_400


class _BigPrompts:
    """A server (one slot) whose tokenization of the prompt "BIG" blocks until `release` is set, and
    TOKENIZE_THREADS + 1 clients sending it at once: `entered` names the threads that began
    tokenizing one, `answers` holds the responses."""

    def __init__(self, model, monkeypatch):
        import threading

        from edgeinfer.server.app import TOKENIZE_THREADS

        real, self.release, self.entered, lock = model.encode_prompt, threading.Event(), [], threading.Lock()
        self.encoded = []  # every prompt the tokenizing thread began

        def encode_prompt(prompt):
            self.encoded.append(prompt)
            if prompt == "BIG":
                with lock:
                    self.entered.append(threading.current_thread().name)
                self.release.wait(60)
            return real(prompt)

        monkeypatch.setattr(model, "encode_prompt", encode_prompt)
        self.r = Running(ServeConfig(slots=1, queue=4, max_tokens_limit=64), model=model)
        self.answers = []
        self.threads = [threading.Thread(target=self._big, daemon=True) for _ in range(TOKENIZE_THREADS + 1)]
        for t in self.threads:
            t.start()

    def _big(self) -> None:
        self.answers.append(httpx.post(self.r.url + "/v1/completions", timeout=90,
                                       json={"model": MODEL, "prompt": "BIG", "max_tokens": 2}))

    def join(self, timeout_s: float) -> None:
        for t in self.threads:
            t.join(timeout_s)

    def stop(self) -> None:
        self.release.set()
        self.join(60)
        self.r.stop()


def test_a_prompt_being_tokenized_does_not_hold_up_the_event_loop(model, monkeypatch):
    """Tokenization ran on the event loop before admission: N concurrent ~760 KB prompts stalled a
    running stream's events and /health by 0.7 s (N=1) to 4.3 s (N=8). Now it runs in a pool of
    TOKENIZE_THREADS threads. Deterministic: a prompt "BIG" blocks its tokenization until released;
    meanwhile /health, /v1/models and /metrics answer, and a second BIG waits for a tokenizing thread
    (no more tokenize at once however many bodies arrive); once released, both are served."""
    from edgeinfer.server.app import TOKENIZE_THREADS

    big = _BigPrompts(model, monkeypatch)
    url, entered = big.r.url, big.entered
    try:
        assert _wait(lambda: len(entered) == TOKENIZE_THREADS, 20)
        health = httpx.get(url + "/health", timeout=10)  # before: a ReadTimeout (the loop waited in encode)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        time.sleep(0.3)  # an unbounded pool would have let the last BIG in by now (a slow machine: a false pass only)
        assert len(entered) == TOKENIZE_THREADS
    finally:
        big.stop()
    assert [a.status_code for a in big.answers] == [200] * (TOKENIZE_THREADS + 1)
    assert len(entered) == TOKENIZE_THREADS + 1
    assert all(name.startswith("edgeinfer-tokenize") for name in entered)


def test_requests_waiting_to_be_tokenized_at_sigterm_are_answered_503_not_cut_off(model, monkeypatch):
    """A hostile round: with tokenizing in its own thread, SIGTERM found 19 of 30 large requests
    waiting for it; the drain counted only admitted requests, ended, and uvicorn cut those off with
    a text/plain 500 and a CancelledError traceback each. Now a request waiting for (or in) the
    tokenizing thread when the drain begins is answered the OpenAI-shaped 503 at once."""
    from edgeinfer.server.app import TOKENIZE_THREADS

    big = _BigPrompts(model, monkeypatch)  # one in the tokenizing thread, one waiting for it
    try:
        assert _wait(lambda: len(big.entered) == TOKENIZE_THREADS, 20)
        time.sleep(0.3)  # the last one is waiting in line for the thread
        big.r.server.draining = True  # what SIGTERM sets (run.DrainingServer.handle_exit)
        big.join(30)
    finally:
        big.stop()
    assert [a.status_code for a in big.answers] == [503] * (TOKENIZE_THREADS + 1)
    assert all(a.json()["error"]["code"] == "shutting_down" for a in big.answers)


def _count(r, status: str) -> float:
    text = httpx.get(r.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("edgeinfer_requests_total{") and f'status="{status}"' in line)


def test_a_client_that_leaves_while_waiting_to_be_tokenized_is_never_tokenized(model, monkeypatch):
    """A hostile round: a request whose client had gone while it waited for the tokenizing thread was
    still tokenized when its turn came (a backlog of abandoned large bodies cost the server the
    whole tokenizing time). Now the wait watches the client: the request is counted 499 and its
    prompt never reaches the tokenizer."""
    from edgeinfer.server.app import TOKENIZE_THREADS

    big = _BigPrompts(model, monkeypatch)  # TOKENIZE_THREADS in the thread, one waiting for it
    try:
        assert _wait(lambda: len(big.entered) == TOKENIZE_THREADS, 20)
        before = _count(big.r, "499")
        host, port = big.r.url[7:].rsplit(":", 1)
        body = json.dumps({"model": MODEL, "prompt": "LEFT", "max_tokens": 2}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.5)  # read whole, now in line behind the BIGs
        assert _wait(lambda: _count(big.r, "499") == before + 1, 10)  # before: only after the BIGs
    finally:
        big.stop()
    assert [a.status_code for a in big.answers] == [200] * (TOKENIZE_THREADS + 1)
    assert "LEFT" not in big.encoded


def test_a_full_server_turns_a_request_away_before_tokenizing_it(model, monkeypatch):
    """A hostile round: the queue-full check ran only after tokenizing, so under a backlog every
    request was encoded (and waited its turn for the tokenizing thread) before its 429. Now a
    request is refused at once when the slots and the queue are full, and never tokenized."""
    seen, real = [], model.encode_prompt
    monkeypatch.setattr(model, "encode_prompt", lambda prompt: (seen.append(prompt), real(prompt))[1])
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=64), model=model)
    sched = r.server.scheduler
    tickets = [sched.admit(), sched.admit()]  # the slot's place and the queue's: what two requests hold
    try:
        resp = httpx.post(r.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "AWAY", "max_tokens": 2})
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
        assert resp.headers["Retry-After"] == "1"
        assert "AWAY" not in seen
    finally:
        for t in tickets:
            sched.withdraw(t)
    try:  # the places given back: served again
        resp = httpx.post(r.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "BACK", "max_tokens": 2})
        assert resp.status_code == 200 and "BACK" in seen
    finally:
        r.stop()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
])
def test_a_prompt_or_bias_the_model_cannot_take_is_a_400_naming_its_field(srv, path, body, param):
    """A hostile round: these were 400s with `param: null` (the model's own checks, past the protocol's):
    ids past the vocabulary, a lone surrogate. Every bad field is a 400 whose param names it."""
    resp = httpx.post(srv.url + path, headers=AUTH, timeout=30, content=json.dumps({"model": MODEL, "max_tokens": 2, **body}))
    _assert_400_and_still_serving(srv, resp)
    err = resp.json()["error"]
    assert err["param"] == param and ("vocabulary" in err["message"] or "UTF-8" in err["message"])


@contextlib.contextmanager
def _server_log():
    """The daemon's log lines (INFO and up) while the block runs, as a list of messages."""
    records: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    lg, handler = logging.getLogger("edgeinfer.server"), Lines(logging.INFO)
    level = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(handler)
    try:
        yield records
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)


def test_every_refused_request_has_its_log_line(srv):
    """The docs' audit: the log was "one line per request" only for requests that generated; a 404
    model, a 400 field, a 401 key or a 404 route wrote nothing, so an operator reading the journal
    saw no trace of refused clients. Now each has a line: status, path and why."""
    with _server_log() as records:
        url = srv.url
        assert httpx.post(url + "/v1/completions", headers=AUTH, json={"model": "x", "prompt": "Hi"}).status_code == 404
        assert httpx.post(url + "/v1/chat/completions", headers=AUTH, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**6}).status_code == 400
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code == 401
        assert httpx.get(url + "/v1/nowhere", headers=AUTH).status_code == 404
        assert httpx.post(url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                          ).status_code == 200
        _wait(lambda: len(records) >= 5, 5)
    want = ["path=/v1/completions status=404 error=model_not_found",
            "path=/v1/chat/completions status=400 error=max_tokens",
            "path=/v1/completions status=401 error=invalid_api_key",
            "path=/v1/nowhere status=404 error=not_found",
            "path=/v1/completions status=200 prompt_tokens="]
    for w in want:
        assert sum(w in line for line in records) == 1, (w, records)


def test_a_full_scheduler_that_is_closing_is_not_called_full(model):
    """A review: `Scheduler.full` did not look at `closed`, so a request whose body finished as the
    drain began, on a busy server, got 429 "retry shortly" before `admit` could say 503 "retry on
    another instance". While closing, `full` is False and `admit` raises Closed."""
    from edgeinfer.server.scheduler import Closed, Scheduler

    sched = Scheduler(model, slots=1, queue=1)
    tickets = [sched.admit(), sched.admit()]
    assert sched.full
    sched.close()
    assert not sched.full
    with pytest.raises(Closed):
        sched.admit()
    for t in tickets:
        sched.withdraw(t)


def test_a_client_cannot_forge_a_log_line(srv):
    """The final review: a refused request's path, decoded by uvicorn, went into the text log as it
    was: "/x%0Amethod=POST path=/v1/chat/completions status=200" wrote a second, forged line, before
    any key check. A value with a newline, a space, "=" or a quote is written as a JSON string."""
    with _server_log() as records:
        resp = httpx.get(srv.url + "/x%0Amethod=POST%20path=/v1/chat/completions%20status=200")
        assert resp.status_code == 401
        _wait(lambda: records, 5)
    (line,) = [r for r in records if "status=401" in r]
    assert "\n" not in line and line.startswith('method=GET path="/x\\nmethod=POST path=/v1/chat/completions status=200"')


def test_a_held_byte_s_text_is_not_counted_again_in_the_next_token_s_logprobs(srv):
    """A hostile round: a lone lead byte held back (it never makes a character) came out with the
    next token's text, and that token's logprob entry took the whole piece as its text, so the
    entries' bytes held the byte and its U+FFFD both ('��a' for '�a'). Each entry keeps its own bytes."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Lily had a ball."}], "max_tokens": 10,
            "temperature": 2, "seed": 1, "ignore_eos": True, "logit_bias": {"229": 95, "100": 100},
            "logprobs": True, "top_logprobs": 2}
    resp = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, json=body, timeout=30)
    choice = resp.json()["choices"][0]
    text, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert "\ufffd" in text and "a" in text  # the scenario: lead bytes then plain tokens
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined.decode("utf-8", errors="replace") == text and len(entries) == 10


def test_legacy_offsets_of_lone_lead_bytes_count_each_replacement_character(srv):
    """A hostile round: a lone lead byte was held as the start of a character, so the token after it
    had its offset, and the two then counted at once: [16, 16, 18, 18, 20] for '�����'."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logit_bias": {"229": 100}, "logprobs": 0}
    choice = httpx.post(srv.url + "/v1/completions", headers=AUTH, json=body, timeout=30).json()["choices"][0]
    assert choice["text"] == "\ufffd" * 5 and choice["logprobs"]["text_offset"] == [16, 17, 18, 19, 20]


@pytest.mark.parametrize("path, extra", [("/v1/chat/completions", {"logprobs": True}),
                                         ("/v1/completions", {"logprobs": 0})])
def test_tokens_held_into_a_stop_string_have_no_logprob_entries(srv, path, extra):
    """A hostile round: bytes the detokenizer held (a lone lead byte never makes a character) had
    their entries sent at once, so at a stop string made of their text the reply was "" with five
    entries (legacy offsets [16, 16, 18, 18, 20] for an empty text). Such entries now wait for the
    piece that lets their text out, and go with the stop string's."""
    prompt = {"messages": [{"role": "user", "content": "Lily had a ball."}]} if "chat" in path else {"prompt": "Once"}
    body = {"model": MODEL, **prompt, "max_tokens": 5, "temperature": 0, "stop": "\ufffd",
            "logit_bias": {"229": 100}, **extra}
    choice = httpx.post(srv.url + path, headers=AUTH, json=body, timeout=30).json()["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    entries = choice["logprobs"]["content"] if "chat" in path else choice["logprobs"]["tokens"]
    assert (text, choice["finish_reason"], entries) == ("", "stop", [])


def test_idle_connections_past_the_cap_give_way_to_new_ones(monkeypatch, model_for_cap):
    """1,100 idle connections ran a daemon with 1024 file descriptors out of them: accept() failed in a
    loop that logged 27 MB in 10 s, and /health stopped answering for as long as they stayed (an ops
    review). Connections are now capped below the open-files limit (raised to the hard limit at start):
    past the cap the oldest connection without a request in progress is closed, so /health and a
    request still get through beside a flood of idle ones, and a request in progress is never the one
    closed."""
    import edgeinfer.server.run as run

    monkeypatch.setattr(run, "connection_cap", lambda: 8)
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=64), model=model_for_cap)
    socks = []
    try:
        streaming = socket.create_connection(("127.0.0.1", r.port))  # a request in progress, opened first
        body = json.dumps({"model": "stories260K-int8", "prompt": "Once", "max_tokens": 64, "stream": True,
                           "ignore_eos": True}).encode()
        streaming.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        streaming.settimeout(10)
        assert streaming.recv(4096).startswith(b"HTTP/1.1 200")
        for _ in range(40):  # five times the cap, idle
            socks.append(socket.create_connection(("127.0.0.1", r.port)))
        for _ in range(3):
            assert _health(r)["status"] == "ok"
        c = r.client(key=None).completions.create(model="stories260K-int8", prompt="Hi", max_tokens=2)
        assert c.usage.completion_tokens == 2
        closed = 0
        for s in socks:
            s.settimeout(2)
            with contextlib.suppress(OSError):
                closed += s.recv(1) == b""
        assert closed >= len(socks) - 8  # the idle ones gave way
        rest = b""
        while b"data: [DONE]" not in rest:  # the stream opened first was not closed
            part = streaming.recv(65536)
            assert part, "the request in progress was closed"
            rest += part
    finally:
        for s in socks:
            s.close()
        r.stop()


def test_the_open_files_limit_is_raised_and_caps_the_connections():
    import resource

    import edgeinfer.server.run as run

    cap = run.connection_cap()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY
    assert 1 <= cap <= run.MAX_CONNECTIONS and (soft == resource.RLIM_INFINITY or cap <= soft - run.FD_RESERVE
                                                 or cap <= (soft - run.open_files() - run.LOOP_FDS) // 2)


@pytest.mark.parametrize("soft, in_use, cap", [(1024, 20, 745), (64, 20, 20), (300, 20, 138), (16, 8, 2),
                                                (16, 10, None)])
def test_the_connection_cap_counts_the_files_already_open(monkeypatch, soft, in_use, cap):
    """Under `ulimit -n 16` the cap's floor of 8 ignored the ~10 files the server already had open:
    every accept() then failed (35,000 a second, 1.3 cores), /health went unanswered while 40 idle
    connections were open, and a SIGTERM wrote 25 MB of tracebacks (a hostile round). The cap is now
    what is left after the open files (half of it under a small limit), and a limit that leaves no
    room is refused at start."""
    import resource

    import edgeinfer.server.run as run

    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, soft))
    monkeypatch.setattr(run, "open_files", lambda: in_use)
    if cap is None:
        with pytest.raises(InvalidArgumentError, match=r"the open-files limit \(16\) leaves no room for connections: "
                                                       r"10 files are open already; raise it"):
            run.connection_cap()
    else:
        assert run.connection_cap() == cap


def test_open_files_counts_this_processs_descriptors():
    import edgeinfer.server.run as run

    before = run.open_files()
    with open(__file__) as a, open(__file__) as b:
        assert run.open_files() == before + 2 and a and b


@pytest.fixture(scope="module")
def model_for_cap():
    return edgeinfer.load()


def test_web_pages_cannot_use_a_keyless_loopback_server(model_for_cap):
    """Without a key (loopback only), a page in the device's browser could post a text/plain "simple"
    request from any origin (no preflight: it ran a generation), and a DNS-rebinding page (its own name
    now resolving to 127.0.0.1) could read the reply (an ops review). Both are 403 now; a loopback
    origin, a listed cors-origin and clients that send no Origin (the openai client, curl) are served."""
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=8, cors_origins=("http://app.example",)),
                model=model_for_cap)
    body = json.dumps({"model": "stories260K-int8", "prompt": "Once", "max_tokens": 2})
    url = r.url + "/v1/completions"
    try:
        page = httpx.post(url, content=body, headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert page.status_code == 403 and page.json()["error"]["code"] == "origin_not_allowed"
        rebind = httpx.post(url, content=body, headers={"Host": f"rebind.evil.example:{r.port}"})
        assert rebind.status_code == 403 and rebind.json()["error"]["code"] == "host_not_allowed"
        for origin in ("http://localhost:3000", "http://127.0.0.1:8000", "http://app.example", None):
            headers = {"Content-Type": "application/json"} | ({"Origin": origin} if origin else {})
            assert httpx.post(url, content=body, headers=headers).status_code == 200, origin
        assert httpx.post(url, content=body, headers={"Host": f"localhost:{r.port}"}).status_code == 200
        assert r.client(key=None).completions.create(model="stories260K-int8", prompt="Hi",
                                                     max_tokens=2).usage.completion_tokens == 2
    finally:
        r.stop()
    keyed = Running(ServeConfig(api_key=KEY, slots=1, queue=1, max_tokens_limit=8), model=model_for_cap)
    try:  # with a key, a page cannot send it without a preflight that fails: no Host or Origin rule
        ok = httpx.post(keyed.url + "/v1/completions", content=body,
                        headers={"Authorization": f"Bearer {KEY}", "Host": "proxy.example"})
        assert ok.status_code == 200
    finally:
        keyed.stop()


@pytest.fixture
def small_buffers(model):
    """one_slot, its connections' send buffers small (4 KiB, not Linux's autotuned up to 4 MiB): a client
    that stops reading stalls the server in a fraction of a second rather than after 15 s of tokens."""
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=20_000), model=model, send_buffer_bytes=4096)
    yield r
    r.stop()


@pytest.mark.parametrize("rule", ["time", "count"])
def test_a_stream_nobody_reads_is_cancelled_and_frees_its_slot(small_buffers, monkeypatch, rule):
    """Hostile round: a client that stopped reading had every token wait in the server (7 MB/s with
    top logprobs, 81 -> 455 MB for four such clients), its slot held for as long as it kept the
    connection, and its close merged the backlog into one event on the event loop (/health 5.7 s).
    Now it is cancelled as a client that left, once its tokens wait STALLED_S or MAX_UNREAD_CHUNKS
    of them pile up (here made small)."""
    from edgeinfer.server import scheduler

    if rule == "time":  # (each rule alone; 2 s: the busy slot is seen before the rule frees it on a loaded box,
        monkeypatch.setattr(scheduler, "STALLED_S", 2.0)  # where 0.5 s went by between two /health calls once)
        monkeypatch.setattr(scheduler, "MAX_UNREAD_CHUNKS", 10 ** 9)
    else:
        monkeypatch.setattr(scheduler, "STALLED_S", 10 ** 9)
        monkeypatch.setattr(scheduler, "MAX_UNREAD_CHUNKS", 300)
        monkeypatch.setattr(scheduler, "STALLED_COUNT_S", 2.0)
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 20_000, "stream": True, "ignore_eos": True,
                       "logprobs": 5}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", small_buffers.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert _wait(lambda: _health(small_buffers)["slots_busy"] == 1, 10)
        assert _wait(lambda: _health(small_buffers)["slots_busy"] == 0, 60)  # freed while the client still holds on
        data = _body_to_end(s, 30)
    finally:
        s.close()
    assert b"the client stopped reading" in data and b"client_stalled" in data and data.count(b'"text"') < 20_000
    ok = httpx.post(small_buffers.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_sighup_drains_as_sigterm_does():
    """Hostile round: closing the terminal (or the ssh session) of a server started by hand sends
    SIGHUP, which killed it at once: rc -1, no log line, its stream cut with no error and no [DONE]."""
    proc, port, url = _start_process("--grace-s", "0.5",  # (under nohup, SIGHUP is ignored on purpose: a server
                                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # runs on)
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(_raw({"model": MODEL, "prompt": "Once", "max_tokens": 20_000, "ignore_eos": True, "stream": True}))
        s.recv(4096)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=20) == 0
        data = _body_to_end(s, 5)
        assert b"shutting_down" in data and b"data: [DONE]" in data
        assert "draining" in proc.stderr.read()
    finally:
        s.close()
        _stop(proc)


def test_a_stream_that_waited_in_the_queue_or_speculated_is_not_taken_for_a_stalled_one(monkeypatch, model):
    """The review of the rule above: its clock started when the job was made, so a request queued
    longer than STALLED_S was cancelled as soon as two chunks waited at once, which speculation's
    several chunks a step made almost certain (2-3 of 4 such requests, streamed or whole)."""
    from edgeinfer.server import scheduler

    monkeypatch.setattr(scheduler, "STALLED_S", 1.0)
    r = Running(ServeConfig(slots=1, queue=3, max_tokens_limit=6000, speculative="ngram"), model=model)
    try:
        client = r.client()
        blocker = threading.Thread(target=lambda: client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6000, extra_body={"ignore_eos": True}), daemon=True)
        blocker.start()
        assert _wait(lambda: _health(r)["slots_busy"] == 1, 10)
        t0 = time.monotonic()
        stream = client.completions.create(model=MODEL, prompt="Once upon a time, Lily", max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        whole = client.completions.create(model=MODEL, prompt="Tom had a red ball", max_tokens=300,
                                          extra_body={"ignore_eos": True})
        blocker.join(60)
    finally:
        r.stop()
    assert time.monotonic() - t0 > 1.0  # the stream did wait past STALLED_S for the blocker
    assert chunks[-1].choices[0].finish_reason == "length" and whole.choices[0].finish_reason == "length"


def test_sighup_ignored_at_start_stays_ignored():
    """Under `nohup` SIGHUP is ignored: the server must not take it over and stop at logout."""
    proc, port, url = _start_process(preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and httpx.get(url + "/health").status_code == 200
    finally:
        _stop(proc)


def test_a_burst_of_bodies_holds_no_more_of_their_bytes_than_its_budget(model):
    """Every body was read and parsed as JSON on arrival, then waited for the one tokenizing thread,
    so a burst held one parsed body per client: 40 concurrent bodies of about 1 MiB took the bundled
    model's service from 81 to 725 MiB (a prompt of 240,000 empty objects, 17 MiB each as Python
    objects; 29,000 one-letter chat messages: 257 MiB; its unit: 145M), and more clients took more.
    Now bodies are parsed in the tokenizing thread, one at a time, and the bytes of bodies not yet
    admitted are held to slots + queue bodies of max-body-bytes, counted as they arrive: past that, a
    429 (its connection then closed). Uploads that stall hold what they sent and no place, so a
    small request still gets through beside them (a review: counting whole requests from the start,
    two stalled uploads of ten bytes turned every other request away for 30 s)."""
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=8, max_body_bytes=100_000), model=model)
    budget, stalled = r.server.bodies, []
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 95000\r\n\r\n")
    try:
        for _ in range(2):  # 180,000 of the budget's 200,000 bytes, held by uploads that stall
            stalled.append(socket.create_connection(("127.0.0.1", r.port)))
            stalled[-1].sendall(head + b" " * 90_000)
        assert _wait(lambda: budget.held_bytes == 180_000, 10), budget.held_bytes
        ok = httpx.post(r.url + "/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and budget.held_bytes == 180_000
        over = httpx.post(r.url + "/v1/completions", timeout=60, headers={"Content-Type": "application/json"},
                          content=json.dumps({"model": MODEL, "prompt": "x" * 30_000}).encode())
        assert over.status_code == 429 and over.headers.get("connection") == "close" and _shaped(over)
        assert over.json()["error"]["code"] == "queue_full" and over.headers.get("retry-after") == "1"
        assert budget.held_bytes == 180_000
        for s in stalled:
            s.close()
        assert _wait(lambda: budget.held_bytes == 0, 10), budget.held_bytes
    finally:
        for s in stalled:
            s.close()
        r.stop()


def test_a_burst_of_small_bodies_is_turned_away_before_it_is_tokenized(model, monkeypatch):
    """With the bodies' bytes the only bound, a burst of small requests all waited for the tokenizing
    thread and were each parsed, rendered and tokenized before their 429 (a review: 150 chats of 900
    bytes, 152 `_prepare` calls, and a request after them waited 0.43 s). Those preparing count
    against the places with those admitted: here, the tokenizing thread held on the first request, one
    more waits and four are answered 429 at once, unprepared."""
    from edgeinfer.server.app import Server

    entered, release, calls = threading.Event(), threading.Event(), []
    prepare = Server._prepare

    def held(self, raw, chat):
        calls.append(1)
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return prepare(self, raw, chat)

    monkeypatch.setattr(Server, "_prepare", held)
    r = Running(ServeConfig(slots=1, queue=1, max_tokens_limit=8), model=model)
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        answers: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            answers[i] = httpx.post(r.url + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=post, args=(0,))]
        threads[0].start()
        assert entered.wait(20)
        threads += [threading.Thread(target=post, args=(i,)) for i in range(1, 6)]
        for t in threads[1:]:
            t.start()
        assert _wait(lambda: len(answers) == 4, 20), answers  # while the first is still held
        assert all(a.status_code == 429 and a.json()["error"]["code"] == "queue_full" for a in answers.values())
        assert r.server.preparing == 2 and len(calls) == 1
        release.set()
        for t in threads:
            t.join(30)
        assert sorted(a.status_code for a in answers.values()) == [200, 200, 429, 429, 429, 429]
        assert len(calls) == 2 and r.server.preparing == 0 and r.server.bodies.held_bytes == 0
    finally:
        release.set()
        r.stop()

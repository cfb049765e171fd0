"""Load test for `edgeinfer serve`, over HTTP only, on this machine only.

    python scripts/load_test.py --url http://127.0.0.1:8080 --requests 200 --concurrency 16
        [--api-key K] [--stream] [--max-tokens 32] [--timeout-s 300] [--out FILE] [--server-pid PID]
    python scripts/load_test.py --self-test        # checks the SSE parser on hand-written streams; starts nothing

Contract:
- Loopback only: a --url whose host is not 127.0.0.1, localhost or ::1 is refused (exit 2); proxies
  from the environment are ignored, so the requests cannot leave the machine.
- Bounded: at most --requests requests (<= 100,000), --concurrency threads (<= 256); no request
  starts after --timeout-s seconds, and one still running then is cut and counted as a timeout.
- Each request is a chat completion (POST /v1/chat/completions) with a short varied prompt. Streamed
  requests (--stream) ask `stream_options: {"include_usage": true}`; every SSE event is parsed by
  this script's own parser (not the openai client) and every chunk's shape checked
  (`StreamValidator`); a non-streamed response must be a valid `chat.completion` with usage.
- Outcomes: ok; rate_limited (429 with Retry-After: fine); http_error (any other status, or an
  error object sent in place of a chunk: the server's way to fail a stream already answered 200);
  malformed (a response or stream that breaks the protocol, including a 429 without Retry-After);
  timeout; exception (connection refused, reset, ...); not_started (the time limit came first).
- Reports JSON (stdout, and --out FILE): counts by outcome, TTFT p50/p90/p99 ms (first content chunk
  for streams; the whole response otherwise), total p50/p99 ms, completion tokens/s over the wall
  time (usage of ok requests), up to 10 example failures, and the server's RSS before/after/peak
  when --server-pid is given (psutil).
- Exit 0 when every request is ok or rate_limited; 1 otherwise; 2 for bad arguments.

Uses only httpx (and psutil for --server-pid); imports nothing from edgeinfer.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 256
OUTCOMES = ("ok", "rate_limited", "http_error", "malformed", "timeout", "exception", "not_started")
FAILURES = ("http_error", "malformed", "timeout", "exception", "not_started")
FINISH_REASONS = ("stop", "length", "content_filter", "tool_calls", "function_call")
SUBJECTS = ("a cat", "a red ball", "the sea", "a small robot", "Lily's garden", "a dragon", "the moon",
            "a lost shoe", "Ben's kite", "a rainy day", "an old tree", "a birthday cake")
FORMS = ("Tell a short story about {}.", "Write two sentences about {}.", "Once upon a time there was {}.",
         "What happened to {} one day?")


class MalformedStream(Exception):
    """The bytes received break the SSE framing or the chat.completion.chunk protocol."""


class ErrorEvent(MalformedStream):
    """The server sent an OpenAI error object ({"error": {...}}) where a chunk or response was due:
    well-formed, but a failed request (counted as http_error, not malformed)."""


# ---------------------------------------------------------------------------------------------
# SSE framing


class SSEParser:
    """Incremental Server-Sent Events parser (the WHATWG rules this protocol uses).

    `feed(bytes)` returns the data payload of every event completed by those bytes (several
    `data:` lines joined by "\\n"; one space after the colon removed); events without data (comments,
    keep-alives) give nothing. Lines end in \\n, \\r\\n or \\r, and may be split anywhere across
    feeds, UTF-8 characters included. `close()` returns the events a final \\r completed and raises
    MalformedStream if the stream stopped inside an event (a line or event not terminated by its
    blank line); bytes that are not UTF-8 raise it at once."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._buf = ""
        self._data: list[str] | None = None

    def feed(self, chunk: bytes) -> list[str]:
        try:
            self._buf += self._decoder.decode(chunk)
        except UnicodeDecodeError as e:
            raise MalformedStream(f"not UTF-8: {e}") from None
        return self._events(final=False)

    def _events(self, final: bool) -> list[str]:
        events = []
        while True:
            i = min((j for j in (self._buf.find("\r"), self._buf.find("\n")) if j >= 0), default=-1)
            if i < 0:
                break
            if self._buf[i] == "\r" and i == len(self._buf) - 1 and not final:
                break  # a \r at the end: wait to see whether \n follows
            end = i + 2 if self._buf.startswith("\r\n", i) else i + 1
            line, self._buf = self._buf[:i], self._buf[end:]
            if line == "":
                if self._data is not None:
                    events.append("\n".join(self._data))
                self._data = None
                continue
            if line.startswith(":"):
                continue  # a comment
            name, _, value = line.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data = (self._data or []) + [value]
            # event:, id:, retry: and unknown fields are allowed and ignored
        return events

    def close(self) -> list[str]:
        """End of stream: returns the events a final \\r completes (held back to see whether \\n
        followed); MalformedStream if the stream stopped inside a line, an event or a character."""
        try:
            self._buf += self._decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise MalformedStream(f"stream ended inside a UTF-8 character: {e}") from None
        events = self._events(final=True)
        if self._buf or self._data is not None:
            raise MalformedStream("stream ended inside an event (no blank line after it)")
        return events


# ---------------------------------------------------------------------------------------------
# The chat.completion.chunk protocol


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_usage(usage, where: str) -> dict:
    """`usage` must hold non-negative integers prompt_tokens, completion_tokens, total_tokens
    (dropped_tokens, when present, too). Returns it; MalformedStream otherwise."""
    if not isinstance(usage, dict):
        raise MalformedStream(f"{where}: usage is not an object: {usage!r}")
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if not _is_int(usage.get(k)) or usage[k] < 0:
            raise MalformedStream(f"{where}: usage.{k} is not a non-negative integer: {usage.get(k)!r}")
    if "dropped_tokens" in usage and (not _is_int(usage["dropped_tokens"]) or usage["dropped_tokens"] < 0):
        raise MalformedStream(f"{where}: usage.dropped_tokens is not a non-negative integer")
    return usage


def _check_common(obj, kind: str, where: str) -> None:
    if not isinstance(obj, dict):
        raise MalformedStream(f"{where}: not a JSON object")
    if "error" in obj:
        raise ErrorEvent(f"{where}: error object: {str(obj['error'])[:200]}")
    if obj.get("object") != kind:
        raise MalformedStream(f"{where}: object is {obj.get('object')!r}, expected {kind!r}")
    if not isinstance(obj.get("id"), str) or not obj["id"]:
        raise MalformedStream(f"{where}: no id")
    if not _is_int(obj.get("created")):
        raise MalformedStream(f"{where}: created is not an integer")
    if not isinstance(obj.get("model"), str):
        raise MalformedStream(f"{where}: model is not a string")
    if not isinstance(obj.get("choices"), list):
        raise MalformedStream(f"{where}: choices is not a list")


def _check_finish(reason, where: str) -> None:
    if reason is not None and reason not in FINISH_REASONS:
        raise MalformedStream(f"{where}: finish_reason {reason!r} is not one of {', '.join(FINISH_REASONS)}")


@dataclass
class StreamResult:
    """What one valid stream carried."""

    chunks: int = 0
    content: str = ""
    finish_reasons: dict = field(default_factory=dict)  # choice index -> finish_reason
    usage: dict | None = None


class StreamValidator:
    """Validates one streamed chat completion as it arrives.

    `feed(bytes)` returns how many chunks with non-empty `delta.content` those bytes completed (the
    caller times the first); it raises MalformedStream at the first violation: a payload that is
    not JSON, an error object, a chunk whose `object` is not chat.completion.chunk, without
    id/created/model, whose `choices` is not a list of {index, delta: {role?, content?},
    finish_reason}, a second finish_reason for one choice, content after it, bad usage, anything
    after `data: [DONE]`. `close()` (after the last byte) raises if the framing is cut, `[DONE]` never
    came, a choice never finished, or usage was expected (`expect_usage`: stream_options
    include_usage was asked) and never sent; else returns the StreamResult."""

    def __init__(self, expect_usage: bool = False) -> None:
        self.expect_usage = expect_usage
        self.result = StreamResult()
        self.done = False
        self._sse = SSEParser()
        self._ids: set[str] = set()

    def feed(self, data: bytes) -> int:
        return self._payloads(self._sse.feed(data))

    def _payloads(self, payloads: list[str]) -> int:
        content_chunks = 0
        for payload in payloads:
            if self.done:
                raise MalformedStream(f"data after [DONE]: {payload[:80]!r}")
            if payload.strip() == "[DONE]":
                self.done = True
                continue
            content_chunks += self._chunk(payload)
        return content_chunks

    def _chunk(self, payload: str) -> int:
        r = self.result
        where = f"chunk {r.chunks}"
        try:
            obj = json.loads(payload)
        except ValueError:
            raise MalformedStream(f"{where}: not JSON: {payload[:80]!r}") from None
        _check_common(obj, "chat.completion.chunk", where)
        r.chunks += 1
        self._ids.add(obj["id"])
        if len(self._ids) > 1:
            raise MalformedStream(f"{where}: id changed within the stream")
        if obj.get("usage") is not None:
            if r.usage is not None:
                raise MalformedStream(f"{where}: usage sent twice")
            r.usage = check_usage(obj["usage"], where)
        elif not obj["choices"]:
            raise MalformedStream(f"{where}: no choices and no usage")
        n = 0
        for c in obj["choices"]:
            if not isinstance(c, dict) or not _is_int(c.get("index")):
                raise MalformedStream(f"{where}: a choice without an integer index")
            delta = c.get("delta")
            if not isinstance(delta, dict):
                raise MalformedStream(f"{where}: choice {c['index']} has no delta object")
            if "role" in delta and delta["role"] is not None and delta["role"] != "assistant":
                raise MalformedStream(f"{where}: delta.role is {delta['role']!r}")
            text = delta.get("content")
            if text is not None and not isinstance(text, str):
                raise MalformedStream(f"{where}: delta.content is not a string or null")
            reason = c.get("finish_reason")
            _check_finish(reason, where)
            if c["index"] in r.finish_reasons and (text or reason is not None):
                raise MalformedStream(f"{where}: choice {c['index']} continued after its finish_reason")
            if text:
                r.content += text
                n = 1
            if reason is not None:
                r.finish_reasons[c["index"]] = reason
        return n

    def close(self) -> StreamResult:
        self._payloads(self._sse.close())
        if not self.done:
            raise MalformedStream("stream ended without data: [DONE]")
        if not self.result.finish_reasons:
            raise MalformedStream("no chunk carried a finish_reason")
        if self.expect_usage and self.result.usage is None:
            raise MalformedStream("stream_options.include_usage was asked but no chunk carried usage")
        return self.result


def validate_stream(pieces, expect_usage: bool = False) -> StreamResult:
    """Validate a whole stream given as an iterable of byte pieces (split anywhere)."""
    v = StreamValidator(expect_usage)
    for p in pieces:
        v.feed(p)
    return v.close()


def validate_completion(obj) -> dict:
    """A non-streamed response: a chat.completion with at least one choice whose message is
    {role: assistant, content: str}, a finish_reason, and usage. Returns usage; MalformedStream otherwise."""
    _check_common(obj, "chat.completion", "response")
    if not obj["choices"]:
        raise MalformedStream("response: no choices")
    for c in obj["choices"]:
        msg = c.get("message") if isinstance(c, dict) else None
        if not isinstance(msg, dict) or msg.get("role") != "assistant" or not isinstance(msg.get("content"), str):
            raise MalformedStream(f"response: choice without an assistant message with string content: {c!r}"[:200])
        if c.get("finish_reason") is None:
            raise MalformedStream("response: choice without finish_reason")
        _check_finish(c["finish_reason"], "response")
    return check_usage(obj.get("usage"), "response")


# ---------------------------------------------------------------------------------------------
# The load test


@dataclass
class Outcome:
    kind: str
    ttft_s: float | None = None
    total_s: float | None = None
    completion_tokens: int = 0
    detail: str = ""


def check_url(url: str) -> str:
    """The base URL without a trailing slash, if it is http(s) on a loopback host; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--url must be http:// or https://, got {url!r}")
    if parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"--url must point at this machine ({', '.join(LOOPBACK_HOSTS)}), got host {parts.hostname!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise ValueError(f"--url has a bad port: {e}") from None
    return url.rstrip("/")


def prompt_for(i: int) -> str:
    return FORMS[i % len(FORMS)].format(SUBJECTS[(i // len(FORMS)) % len(SUBJECTS)]) + f" ({i})"


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class LoadTest:
    def __init__(self, args: argparse.Namespace, base: str) -> None:
        import httpx

        self.httpx = httpx
        self.args = args
        self.base = base
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.deadline = time.monotonic() + args.timeout_s
        self.local = threading.local()
        self.model = args.model
        self.clients = []
        self.lock = threading.Lock()

    def client(self):
        """This thread's client (one connection per worker; environment proxies ignored)."""
        c = getattr(self.local, "client", None)
        if c is None:
            c = self.local.client = self.httpx.Client(trust_env=False, headers=self.headers)
            with self.lock:
                self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def discover_model(self) -> str:
        """The first id of GET /v1/models, or "default" if that fails (the request's outcome will tell)."""
        try:
            r = self.client().get(f"{self.base}/v1/models", timeout=10)
            return r.json()["data"][0]["id"]
        except Exception:  # noqa: BLE001 - best effort
            return "default"

    def one(self, i: int) -> Outcome:
        left = self.deadline - time.monotonic()
        if left <= 0:
            return Outcome("not_started")
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt_for(i)}],
                "max_tokens": self.args.max_tokens, "temperature": 0.8, "seed": i}
        if self.args.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        timeout = self.httpx.Timeout(min(left, self.args.request_timeout_s))
        t0 = time.monotonic()
        try:
            with self.client().stream("POST", f"{self.base}/v1/chat/completions", json=body, timeout=timeout) as r:
                if r.status_code == 429:
                    r.read()
                    if "retry-after" not in r.headers:
                        return Outcome("malformed", detail="429 without Retry-After")
                    return Outcome("rate_limited")
                if r.status_code != 200:
                    return Outcome("http_error", detail=f"HTTP {r.status_code}: {r.read()[:200]!r}")
                if self.args.stream:
                    return self._stream(r, t0)
                raw = r.read()
                total = time.monotonic() - t0
                usage = validate_completion(json.loads(raw))
                return Outcome("ok", ttft_s=total, total_s=total, completion_tokens=usage["completion_tokens"])
        except ErrorEvent as e:
            return Outcome("http_error", detail=str(e))
        except MalformedStream as e:
            return Outcome("malformed", detail=str(e))
        except ValueError as e:  # the non-streamed body was not JSON
            return Outcome("malformed", detail=f"response is not JSON: {e}")
        except TimeoutError as e:
            return Outcome("timeout", detail=str(e))
        except self.httpx.TimeoutException as e:
            return Outcome("timeout", detail=f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - every other failure is an outcome, not a crash
            return Outcome("exception", detail=f"{type(e).__name__}: {e}")

    def _stream(self, r, t0: float) -> Outcome:
        ctype = r.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            raise MalformedStream(f"content-type is {ctype!r}, not text/event-stream")
        v = StreamValidator(expect_usage=True)
        ttft = None
        for piece in r.iter_bytes():
            if v.feed(piece) and ttft is None:
                ttft = time.monotonic() - t0
            if time.monotonic() > self.deadline:
                raise TimeoutError("the load test's time limit passed during the stream")
        res = v.close()
        total = time.monotonic() - t0
        return Outcome("ok", ttft_s=ttft if ttft is not None else total, total_s=total,
                       completion_tokens=res.usage["completion_tokens"])


def rss_sampler(pid: int | None):
    """(before_bytes, stop() -> (after_bytes, peak_bytes)) for process `pid`; Nones without a pid."""
    if pid is None:
        return None, lambda: (None, None)
    import psutil

    proc = psutil.Process(pid)
    before = proc.memory_info().rss
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.25):
            try:
                peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                return

    t = threading.Thread(target=sample, daemon=True)
    t.start()

    def finish():
        stop.set()
        t.join()
        try:
            after = proc.memory_info().rss
        except psutil.Error:
            after = None
        return after, max(peak[0], after or 0)

    return before, finish


def run(args: argparse.Namespace, base: str) -> dict:
    lt = LoadTest(args, base)
    if lt.model is None:
        lt.model = lt.discover_model()
    rss_before, rss_finish = rss_sampler(args.server_pid)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            outcomes = list(pool.map(lt.one, range(args.requests)))
        wall = time.monotonic() - t0
    finally:
        lt.close()
    rss_after, rss_peak = rss_finish()

    counts = {k: 0 for k in OUTCOMES}
    for o in outcomes:
        counts[o.kind] += 1
    ok = [o for o in outcomes if o.kind == "ok"]
    ttft = [o.ttft_s * 1000 for o in ok]
    total = [o.total_s * 1000 for o in ok]
    tokens = sum(o.completion_tokens for o in ok)

    def ms(v):
        return None if v is None else round(v, 1)

    mib = (lambda b: None if b is None else round(b / (1 << 20), 1))
    return {
        "url": base, "model": lt.model, "stream": args.stream, "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "counts": counts,
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p90": ms(percentile(ttft, 90)), "p99": ms(percentile(ttft, 99))},
        "total_ms": {"p50": ms(percentile(total, 50)), "p99": ms(percentile(total, 99))},
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "completion_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "server_rss_mib": ({"before": mib(rss_before), "after": mib(rss_after), "peak": mib(rss_peak)}
                           if args.server_pid is not None else None),
        "failure_examples": [f"{o.kind}: {o.detail}" for o in outcomes if o.kind in FAILURES and o.detail][:10],
        "passed": not any(counts[k] for k in FAILURES),
    }


# ---------------------------------------------------------------------------------------------
# Self-test


def _sse(*events: str, done: bool = True, eol: str = "\n") -> bytes:
    out = "".join(f"data: {e}{eol}{eol}" for e in events)
    return (out + (f"data: [DONE]{eol}{eol}" if done else "")).encode()


def _chunk(content=None, finish=None, role=None, usage=None, choices=True) -> str:
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj, ensure_ascii=False)


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
GOOD_STREAM = _sse(_chunk(role="assistant", content=""), _chunk("Once"), _chunk(" upon é"),
                   _chunk(finish="length"), _chunk(usage=USAGE, choices=False))
BAD_STREAMS = {
    "missing [DONE]": _sse(_chunk("a"), _chunk(finish="stop"), done=False),
    "bad JSON": _sse(_chunk("a"), '{"id": "x", ', _chunk(finish="stop")),
    "wrong object": _sse(_chunk("a").replace("chat.completion.chunk", "chat.completion"), _chunk(finish="stop")),
    "no delta": _sse(_chunk("a").replace('"delta"', '"message"'), _chunk(finish="stop")),
    "choices not a list": _sse(_chunk("a").replace('"choices": [', '"choices": {"x": [').replace("]", "]}"),
                               _chunk(finish="stop")),
    "data after [DONE]": _sse(_chunk("a"), _chunk(finish="stop")) + _sse(_chunk("b"), done=False),
    "cut mid-event": _sse(_chunk("a"), _chunk(finish="stop"))[:-1],
    "no finish_reason": _sse(_chunk("a")),
    "error object": _sse(_chunk("a"), '{"error": {"message": "boom"}}'),
    "not UTF-8": _sse(_chunk("a"), _chunk(finish="stop")).replace(b'"a"', b'"\xff"'),
}


def self_test() -> int:
    """Check the parser on GOOD_STREAM (whole, split at every byte, CRLF) and on BAD_STREAMS; 0 if all as expected."""
    failures = []
    try:
        r = validate_stream([GOOD_STREAM], expect_usage=True)
        assert r.content == "Once upon é" and r.usage == USAGE and r.finish_reasons == {0: "length"}, r
        for i in range(len(GOOD_STREAM) + 1):
            assert validate_stream([GOOD_STREAM[:i], GOOD_STREAM[i:]], True).content == "Once upon é"
        assert validate_stream([bytes([b]) for b in GOOD_STREAM.replace(b"\n", b"\r\n")], True).chunks == 5
    except (MalformedStream, AssertionError) as e:
        failures.append(f"good stream refused: {e!r}")
    for name, data in BAD_STREAMS.items():
        try:
            validate_stream([data])
            failures.append(f"bad stream accepted: {name}")
        except MalformedStream:
            pass
    for f in failures:
        print("FAIL", f)
    print(f"self-test: {1 + len(BAD_STREAMS) - len(failures)}/{1 + len(BAD_STREAMS)} cases as expected")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the daemon's base URL, e.g. http://127.0.0.1:8080 (loopback only)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    ap.add_argument("--model", help="the request's model field (default: the first of GET /v1/models)")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="the whole test's time limit")
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="one request's network timeout")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--server-pid", type=int, help="report this process's RSS before/after/peak (psutil)")
    ap.add_argument("--self-test", action="store_true", help="check the SSE parser on hand-written streams; no HTTP")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    if not args.url:
        ap.error("--url is required (or --self-test)")
    try:
        base = check_url(args.url)
    except ValueError as e:
        ap.error(str(e))
    if not 1 <= args.requests <= MAX_REQUESTS:
        ap.error(f"--requests must be in [1, {MAX_REQUESTS}]")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        ap.error(f"--concurrency must be in [1, {MAX_CONCURRENCY}]")
    if args.max_tokens < 1 or not 0 < args.timeout_s <= 86400 or args.request_timeout_s <= 0:
        ap.error("--max-tokens, --timeout-s and --request-timeout-s must be positive (--timeout-s at most a day)")
    report = run(args, base)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

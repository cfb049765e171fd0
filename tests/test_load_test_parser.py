"""scripts/load_test.py: its SSE parser and chunk validator on hand-written streams, its loopback
guard, and one short run against a fake OpenAI-style server (Starlette + uvicorn on 127.0.0.1)."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load_test.py"


def _load():
    spec = importlib.util.spec_from_file_location("edgeinfer_load_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


lt = _load()
USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def chunk(content=None, finish=None, usage=None, choices=True, **extra) -> str:
    """One chat.completion.chunk payload; choices: True (one choice from content/finish), False
    (none), or the value to put there as it is."""
    if choices is True:
        choices = [{"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}]
    elif choices is False:
        choices = []
    obj = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
           "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    obj.update(extra)
    return json.dumps(obj, ensure_ascii=False)


def sse(*payloads: str, eol: str = "\n") -> bytes:
    return "".join(f"data: {p}{eol}{eol}" for p in payloads).encode()


GOOD = sse(chunk("Hé"), chunk("llo ✓"), chunk(finish="stop"), chunk(usage=USAGE, choices=False), "[DONE]")


# ---- the SSE framing ---------------------------------------------------------------------------

def test_sse_events_split_at_every_byte_boundary():
    whole = lt.SSEParser()
    want = whole.feed(GOOD)
    whole.close()
    assert len(want) == 5 and want[-1] == "[DONE]"
    for i in range(len(GOOD) + 1):
        for j in range(i, len(GOOD) + 1, 7):
            p = lt.SSEParser()
            got = p.feed(GOOD[:i]) + p.feed(GOOD[i:j]) + p.feed(GOOD[j:])
            p.close()
            assert got == want, (i, j)


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_sse_line_endings_one_byte_at_a_time(eol):
    data = sse(chunk("a"), chunk(finish="stop"), "[DONE]", eol=eol)
    p = lt.SSEParser()
    got = [e for b in data for e in p.feed(bytes([b]))] + p.close()
    assert got == [chunk("a"), chunk(finish="stop"), "[DONE]"]


def test_sse_comments_fields_and_multiline_data():
    p = lt.SSEParser()
    got = p.feed(b": keep-alive\n\nevent: message\nid: 7\nretry: 100\ndata: {\"a\":\ndata:1}\n\ndata:[DONE]\n\n")
    p.close()
    assert got == ['{"a":\n1}', "[DONE]"]


@pytest.mark.parametrize("tail", [b"data: [DONE]\n", b"data: [DONE]", b"data: {", b"\xc3"])
def test_sse_cut_inside_an_event_or_character(tail):
    p = lt.SSEParser()
    p.feed(tail)
    with pytest.raises(lt.MalformedStream):
        p.close()


# ---- the chunk protocol ------------------------------------------------------------------------

def test_good_stream_whole_and_split():
    r = lt.validate_stream([GOOD], expect_usage=True)
    assert (r.content, r.finish_reasons, r.usage, r.chunks) == ("Héllo ✓", {0: "stop"}, USAGE, 4)
    for i in range(len(GOOD) + 1):  # splits inside multi-byte characters included
        assert lt.validate_stream([GOOD[:i], GOOD[i:]], expect_usage=True).content == "Héllo ✓"


def test_feed_counts_content_chunks_for_ttft():
    v = lt.StreamValidator()
    assert v.feed(sse(chunk(""), chunk(finish=None))) == 0  # role/empty chunks are not content
    assert v.feed(sse(chunk("a"))[:-1]) == 0  # the event is not complete yet
    assert v.feed(b"\n") == 1


def test_usage_null_in_intermediate_chunks_is_fine():
    data = sse(chunk("a", usage=None), chunk(finish="length"), chunk(usage=USAGE, choices=False), "[DONE]")
    assert lt.validate_stream([data], expect_usage=True).usage == USAGE


BAD = {
    "missing [DONE]": sse(chunk("a"), chunk(finish="stop")),
    "bad JSON": sse(chunk("a"), '{"id": "chatcmpl-x", "object"', chunk(finish="stop"), "[DONE]"),
    "data after [DONE]": sse(chunk("a"), chunk(finish="stop"), "[DONE]", chunk("b")),
    "two [DONE]": sse(chunk("a"), chunk(finish="stop"), "[DONE]", "[DONE]"),
    "cut before the blank line": sse(chunk("a"), chunk(finish="stop"), "[DONE]")[:-1],
    "wrong object": sse(chunk("a", object="chat.completion"), chunk(finish="stop"), "[DONE]"),
    "no id": sse(chunk("a", id=None), chunk(finish="stop"), "[DONE]"),
    "id changes": sse(chunk("a"), chunk(finish="stop", id="other"), "[DONE]"),
    "choices not a list": sse(chunk("a", choices={"0": {}}), chunk(finish="stop"), "[DONE]"),
    "no delta": sse(chunk("a", choices=[{"index": 0, "finish_reason": None}]), chunk(finish="stop"), "[DONE]"),
    "content not a string": sse(chunk(5), chunk(finish="stop"), "[DONE]"),
    "unknown finish_reason": sse(chunk("a"), chunk(finish="done"), "[DONE]"),
    "content after finish": sse(chunk("a", finish="stop"), chunk("b"), "[DONE]"),
    "no finish_reason": sse(chunk("a"), "[DONE]"),
    "error object": sse(chunk("a"), '{"error": {"message": "boom"}}', "[DONE]"),
    "a JSON array": sse("[1, 2]", "[DONE]"),
    "bad usage": sse(chunk("a"), chunk(finish="stop"), chunk(usage={"prompt_tokens": 1}, choices=False), "[DONE]"),
    "empty chunk": sse(chunk("a"), chunk(finish="stop"), chunk(choices=False), "[DONE]"),
    "not UTF-8": sse(chunk("a"), chunk(finish="stop"), "[DONE]").replace(b'"a"', b'"\xff"'),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_streams_refused(name):
    with pytest.raises(lt.MalformedStream):
        lt.validate_stream([BAD[name]])


def test_usage_missing_when_asked():
    data = sse(chunk("a"), chunk(finish="stop"), "[DONE]")
    lt.validate_stream([data])
    with pytest.raises(lt.MalformedStream, match="include_usage"):
        lt.validate_stream([data], expect_usage=True)


def test_non_streamed_completion():
    good = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
            "usage": dict(USAGE, dropped_tokens=0)}
    assert lt.validate_completion(good)["completion_tokens"] == 2
    for bad in ({**good, "usage": None}, {**good, "object": "text_completion"}, {**good, "choices": []},
                {**good, "choices": [{"index": 0, "message": {"role": "assistant"}, "finish_reason": "stop"}]},
                {**good, "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}}]}):
        with pytest.raises(lt.MalformedStream):
            lt.validate_completion(bad)


def test_script_self_test_passes():
    assert lt.self_test() == 0


# ---- guards and the whole run ------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://localhost:1/", "http://[::1]:8080",
                                 "https://127.0.0.1"])
def test_loopback_urls_accepted(url):
    assert not lt.check_url(url).endswith("/")


@pytest.mark.parametrize("url", ["http://10.0.0.2:8080", "http://0.0.0.0:8080", "http://127.0.0.2:8080",
                                 "http://example.com", "ftp://127.0.0.1", "http://localhost.evil.com",
                                 "http://127.0.0.1@evil.com/", "127.0.0.1:8080"])
def test_other_urls_refused(url):
    with pytest.raises(ValueError):
        lt.check_url(url)
    with pytest.raises(SystemExit) as e:
        lt.main(["--url", url, "--requests", "1"])
    assert e.value.code == 2


def test_percentile():
    assert lt.percentile([], 50) is None
    assert lt.percentile([5.0], 99) == 5.0
    assert lt.percentile([1, 2, 3, 4], 50) == 2.5
    assert lt.percentile(list(range(101)), 90) == 90


@pytest.fixture(scope="module")
def fake_server():
    """A fake daemon on 127.0.0.1: mode "good" answers every 4th request 429 (with Retry-After),
    streams valid chunks otherwise; mode "bad" drops [DONE] from streams; mode "error" sends an
    error object after the first chunk (as edgeinfer serve does when generation fails mid-stream)."""
    import asyncio

    starlette = pytest.importorskip("starlette.applications")
    uvicorn = pytest.importorskip("uvicorn")
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state = {"mode": "good", "n": 0, "lock": threading.Lock()}

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        with state["lock"]:
            state["n"] += 1
            n = state["n"]
        if n % 4 == 0:
            return Response("busy", status_code=429, headers={"Retry-After": "1"})
        if request.headers.get("authorization") != "Bearer k-12345678":
            return JSONResponse({"error": {"message": "no"}}, status_code=401)
        words = ["Once", " upon", " a", " time"][: body["max_tokens"]]
        usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
        if not body.get("stream"):
            return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "fake",
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                                              "finish_reason": "length"}], "usage": usage})

        async def events():
            for w in words:
                yield f"data: {chunk(w)}\n\n"
                if state["mode"] == "slow":
                    await asyncio.sleep(0.4)
                if state["mode"] == "error":
                    yield 'data: {"error": {"message": "generation failed", "type": "server_error"}}\n\n'
                    yield "data: [DONE]\n\n"
                    return
            yield f"data: {chunk(finish='length')}\n\n"
            yield f"data: {chunk(usage=usage, choices=False)}\n\n"
            if state["mode"] == "good":
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = starlette.Starlette(routes=[Route("/v1/models", models),
                                      Route("/v1/chat/completions", chat, methods=["POST"])])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY on TCP by number
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    t.join(10)
    sock.close()


@pytest.mark.parametrize("stream", [False, True])
def test_run_against_fake_server(fake_server, tmp_path, capsys, stream):
    url, state = fake_server
    state["mode"], state["n"] = "good", 0
    out = tmp_path / "r.json"
    argv = ["--url", url, "--requests", "20", "--concurrency", "4", "--api-key", "k-12345678",
            "--max-tokens", "3", "--timeout-s", "60", "--out", str(out)] + (["--stream"] if stream else [])
    assert lt.main(argv) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["model"] == "fake" and report["passed"]
    assert report["counts"]["ok"] == 15 and report["counts"]["rate_limited"] == 5
    assert report["completion_tokens"] == 45 and report["completion_tokens_per_s"] > 0
    assert report["ttft_ms"]["p50"] <= report["total_ms"]["p99"]


def test_run_counts_malformed_streams_and_errors(fake_server, tmp_path, capsys):
    url, state = fake_server
    state["mode"], state["n"] = "bad", 0
    assert lt.main(["--url", url, "--requests", "8", "--concurrency", "2", "--api-key", "k-12345678",
                    "--stream", "--timeout-s", "60"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["counts"]["malformed"] == 6 and report["counts"]["rate_limited"] == 2
    assert any("[DONE]" in f for f in report["failure_examples"])
    state["mode"], state["n"] = "error", 0
    assert lt.main(["--url", url, "--requests", "3", "--concurrency", "1", "--api-key", "k-12345678", "--stream"]) == 1
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert counts["http_error"] == 3 and counts["malformed"] == 0
    state["mode"], state["n"] = "good", 0
    assert lt.main(["--url", url, "--requests", "3", "--concurrency", "1", "--api-key", "wrong-key"]) == 1
    assert json.loads(capsys.readouterr().out)["counts"]["http_error"] == 3


def test_run_is_bounded_in_time(fake_server, capsys):
    url, state = fake_server
    state["mode"], state["n"] = "slow", 0
    t0 = time.monotonic()
    assert lt.main(["--url", url, "--requests", "50", "--concurrency", "2", "--api-key", "k-12345678",
                    "--stream", "--max-tokens", "4", "--timeout-s", "1"]) == 1
    assert time.monotonic() - t0 < 5
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert counts["timeout"] >= 1 and counts["not_started"] >= 40 and counts["malformed"] == 0

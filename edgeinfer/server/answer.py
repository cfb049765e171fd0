"""One generation request's answer, whole or streamed: `Reply` (the state of a single response),
and the JSON response type every answer uses. The request's admission and routes are `app`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgeinfer.errors import EdgeInferError, ModelClosedError, ModelFormatError
from edgeinfer.overflow import ContextOverflowError
from edgeinfer.server import replies
from edgeinfer.server.protocol import APIError
from edgeinfer.server.scheduler import Cancelled, Job

if TYPE_CHECKING:
    from edgeinfer.server.app import Server

log = logging.getLogger("edgeinfer.server")
DROPPED_HEADER = "X-Edgeinfer-Dropped-Tokens"
MAX_CHUNKS_PER_EVENT = 256  # a stream that fell behind catches up in events of at most this many tokens


class JSON(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed from a request cannot break the encoding."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    if e.status in (408, 413, 415):  # the body was not read to its end: the connection cannot carry another request,
        headers = {**(headers or {}), "Connection": "close"}  # so it closes once the answer is out (as nginx does)
    if e.status == 415:  # the codings it takes (RFC 9110, 15.5.16)
        headers = {**headers, "Accept-Encoding": "identity"}
    return JSON(e.body(), status_code=e.status, headers=headers)


def overflow_error(exc: ContextOverflowError, param: str) -> APIError:
    """The 400 of a prompt that does not fit under --overflow error (the library's remedy named load's
    arguments, not the server's flags)."""
    return APIError(400, f"{exc.counts} (the server runs with --overflow error: send a shorter prompt, or its "
                         "operator may use --overflow shift or truncate, or a larger --capacity)", param=param,
                    code="context_length_exceeded")


def new_reply_id(chat: bool) -> str:
    """A response's id, as OpenAI's: chatcmpl-... or cmpl-..."""
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


class Reply:
    """One generation request's answer, whole or streamed (state of a single response)."""

    def __init__(self, server: "Server", req, chat: bool, prompt: list[int], job: Job, t0: float, endpoint: str,
                 reply_id: str | None = None):
        """reply_id: the response's id (chatcmpl-..., cmpl-...; None: a new one), in its log line too."""
        self.server, self.req, self.chat, self.prompt, self.job, self.t0 = server, req, chat, prompt, job, t0
        self.endpoint = endpoint
        self.id = reply_id or new_reply_id(chat)
        self.created = int(time.time())
        self.model_id = server.model_id
        self.ttft_s: float | None = None
        self.tok = server.model.tokenizer
        # legacy logprobs' text_offset counts from the prompt's start (a prompt of ids: its decoded text)
        start = 0 if chat or req.logprobs is None else \
            len(req.prompt) if isinstance(req.prompt, str) else len(self.tok.decode(list(req.prompt)))
        self._offsets = replies.TextOffsets(start)
        wanted = bool(req.logprobs) if chat else req.logprobs is not None
        # logprobs go out with the text their tokens add (a stop string's: never); none asked: no gate, no cost
        self._gate = replies.LogprobGate() if wanted else None
        self._first_entry = True  # the reply's first token's entry is still to come

    def failed(self, exc: BaseException, tokens: int = 0) -> Response:
        """The error answer to a request that did not finish, after generating `tokens`."""
        if isinstance(exc, APIError):  # the job's own refusal (`Job.refusal`), as it would have been at once
            err = exc
        elif isinstance(exc, Cancelled):  # the client left (nobody reads this) or the server is stopping
            err = APIError(503, "the server is shutting down", type="server_error", code="shutting_down") \
                if self.server.draining else APIError(499, "the client closed the request", code="client_closed")
        else:
            err = self._failure(exc)
        self.server.metrics.request(self.endpoint, err.status)
        self.server.metrics.cut(tokens)
        self._log(err.status, tokens)
        return error_response(err, {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None)

    def _failure(self, exc: BaseException) -> APIError:
        """The error of a request that failed in its steps (not cancelled)."""
        if isinstance(exc, ContextOverflowError):
            return overflow_error(exc, "messages" if self.chat else "prompt")
        if isinstance(exc, ModelFormatError):  # the model's own fault (non-finite logits): not the request's
            log.error("generation failed: %s", exc)
            return APIError(500, str(exc), type="server_error")
        if isinstance(exc, ModelClosedError):  # the app that embeds the server closed its model
            return APIError(503, str(exc), type="server_error", code="model_closed")
        if isinstance(exc, EdgeInferError):
            return APIError(400, str(exc))
        log.error("generation failed: %r", exc)
        return APIError(500, "generation failed", type="server_error")

    def _usage(self, completion, cached: int) -> dict:
        u = completion.usage
        return replies.usage(len(self.prompt), u.completion_tokens, cached, u.dropped_tokens)

    def _token_logprobs(self, chunk) -> list[dict] | None:
        if chunk.logprob is None or chunk.token_id is None:
            return None
        top = [(self.tok.token_text(i), lp) for i, lp in chunk.top_logprobs]
        text = self.tok.token_text(chunk.token_id)
        first, self._first_entry = self._first_entry, False
        if isinstance(text, str) and chunk.piece and chunk.piece != text and (first or text.endswith(chunk.piece)):
            text = chunk.piece  # what it added to this reply: a first token's space dropped, or the text of a
            # character the prompt began (whole or never made); a later piece that holds text held back before
            # it (bytes of a character never made) keeps the token's own text: those bytes have their entries
        return [replies.token_logprob(text, chunk.logprob, top)]

    def _log(self, status: int, completion_tokens: int) -> None:
        total_ms = (time.perf_counter() - self.t0) * 1e3
        ttft = round(self.ttft_s * 1e3, 1) if self.ttft_s is not None else None  # a number (JSON: null when none)
        log_request(self.server.config.log_format, {
            "id": self.id, "method": "POST", "path": f"/v1/{'chat/' if self.chat else ''}completions",
            "status": status, "prompt_tokens": len(self.prompt), "completion_tokens": completion_tokens, "ttft_ms": ttft,
            "total_ms": round(total_ms, 1)})

    def _finish_metrics(self, completion, cached: int, status: int = 200) -> None:
        m = self.server.metrics
        m.finished(completion, len(self.prompt), cached, self.ttft_s, time.perf_counter() - self.t0)
        self._log(status, completion.usage.completion_tokens)
        m.request(self.endpoint, status)  # last (a review): a bug before it is counted once, as the 500 it answers

    async def whole(self, first) -> Response:
        chunks, event = [], first
        while event[0] == "chunk":
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.t0
            chunks.append(event[1])
            event = await self.job.next_event()
        if event[0] == "error":
            return self.failed(event[1], sum(c.token_id is not None for c in chunks))
        _, completion, cached = event
        usage = self._usage(completion, cached)
        reason = replies.finish_reason(completion.finish_reason)
        lps = self._logprobs(self._released(chunks) + self._held_back(completion))
        if self.chat:
            body = replies.chat_response(id=self.id, created=self.created, model=self.model_id, text=completion.text,
                                          finish_reason=reason, usage=usage, logprobs=lps)
        else:
            body = replies.completion_response(id=self.id, created=self.created, model=self.model_id,
                                                text=completion.text, finish_reason=reason, usage=usage, logprobs=lps)
        response = JSON(body, headers={DROPPED_HEADER: str(completion.usage.dropped_tokens)})
        self._finish_metrics(completion, cached)  # last: a bug before it is the request's one count, as a 500
        return response

    def _released(self, chunks) -> list[dict]:
        """The logprob entries that go out with these chunks' text (`LogprobGate`)."""
        if self._gate is None:
            return []
        out = []
        for c in chunks:
            entries = self._token_logprobs(c)
            out += self._gate.feed(c.text, entries[0] if entries else None, c.piece)
        return out

    def _held_back(self, completion) -> list[dict]:
        """The logprob entries still waiting when the reply ends (`LogprobGate.finish`)."""
        return self._gate.finish(completion.finish_reason == "stop") if self._gate is not None else []

    def _logprobs(self, entries: list[dict]):
        """The reply's logprobs field for these entries: chat's list, or legacy completions' dict
        (offsets from the prompt's start, going on across the events of a stream); None unless asked."""
        if self.chat:
            return entries if self.req.logprobs else None
        if self.req.logprobs is None:
            return None
        return replies.completion_logprobs(entries, text_offset=self._offsets)

    async def stream(self, first):
        """SSE events as OpenAI sends them; the job is cancelled if the client goes away."""
        event, status, completion, tokens = first, 200, None, 0  # tokens: those sent, for the log of a cut stream
        try:
            if self.chat:
                yield self._event(replies.chat_chunk(id=self.id, created=self.created, model=self.model_id,
                                                     delta={"role": "assistant", "content": ""}))
            while event[0] == "chunk":
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.t0
                chunks, event = [event[1]], None
                while len(chunks) < MAX_CHUNKS_PER_EVENT:  # the client fell behind: what is ready as one event,
                    event = self.job.ready_event()  # in bounded pieces (a backlog of 50,000 merged at once held
                    if event is None or event[0] != "chunk":  # the event loop for 5.7 s)
                        break
                    chunks.append(event[1])
                    event = None
                tokens += sum(c.token_id is not None for c in chunks)  # before the yield: a client that
                text, entries = "".join(c.text for c in chunks), self._released(chunks)  # leaves there still
                if text or entries:  # counts them
                    yield self._event(self._chunk_body(text, entries))
                if event is None and not self.job.events.empty():
                    await asyncio.sleep(0)  # a turn for the others (a send to a closed client does not wait)
                if event is None:
                    event = await self.job.next_event()
            if event[0] == "error":
                if isinstance(event[1], Cancelled):  # the grace period ended, the client left (nobody reads) or
                    stalled = self.job.stalled  # stopped reading (`Job._stalled`: it may read this later)
                    err = APIError(503, str(event[1]), type="server_error",
                                   code="client_stalled" if stalled else "shutting_down")
                    status = 503 if self.server.draining and not stalled else 499
                else:
                    err = self._failure(event[1])
                    status = err.status
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            _, completion, cached = event
            reason = replies.finish_reason(completion.finish_reason)
            if entries := self._held_back(completion):
                yield self._event(self._chunk_body("", entries))
            if self.chat:
                yield self._event(replies.chat_chunk(id=self.id, created=self.created, model=self.model_id,
                                                     delta={}, finish_reason=reason))
            else:
                yield self._event(replies.completion_chunk(id=self.id, created=self.created, model=self.model_id,
                                                           text="", finish_reason=reason))
            if self.req.include_usage:
                usage = self._usage(completion, cached)
                build = replies.chat_chunk if self.chat else replies.completion_chunk
                extra = {"delta": {}} if self.chat else {"text": ""}
                body = build(id=self.id, created=self.created, model=self.model_id, usage=usage, **extra)
                yield _sse(body)
            yield "data: [DONE]\n\n"
        except Exception:  # a bug mid-stream: counted and logged as a 500, not as a client that left (a review)
            status = 500
            raise
        finally:  # also when the client disconnects: the generator is closed or cancelled here
            self.job.cancel()
            if completion is not None:
                self._finish_metrics(completion, event[2], status)
            else:  # cut short: by the client (499, nobody reads), the server stopping (503) or a failure
                self.server.metrics.request(self.endpoint, 499 if status == 200 else status)
                self.server.metrics.cut(tokens)
                self._log(499 if status == 200 else status, tokens)

    def _event(self, chunk: dict) -> str:
        """A chunk before the last as an SSE event: with include_usage it carries "usage": null (OpenAI:
        "All other chunks will also include a usage field, but with a null value")."""
        return _sse({**chunk, "usage": None} if self.req.include_usage else chunk)

    def _chunk_body(self, text: str, entries: list[dict]) -> dict:
        """One SSE event: the text of one or more consecutive chunks and the logprob entries released with it."""
        if self.chat:
            return replies.chat_chunk(id=self.id, created=self.created, model=self.model_id,
                                       delta={"content": text}, logprobs=self._logprobs(entries))
        return replies.completion_chunk(id=self.id, created=self.created, model=self.model_id, text=text,
                                         logprobs=self._logprobs(entries))


def log_request(log_format: str, fields: dict) -> None:
    """One request's log line: key=value pairs, or a JSON object (`log_format` "json"). A text value
    with a space, "=", a quote or anything unprintable (a client's path: "%0A" is a newline once
    decoded, which would start a forged line in the journal) is written as a JSON string."""
    if log_format == "json":
        log.info(json.dumps(fields))
    else:
        log.info(" ".join(f"{k}={_plain(v)}" for k, v in fields.items()))


def _plain(v) -> str:
    if v is None:
        return "-"
    s = str(v)
    return s if s.isprintable() and not any(c in s for c in ' ="\\') else json.dumps(s)


async def cancel_on_disconnect(request: Request, job: Job, every_s: float = 0.1) -> None:
    """Cancel `job` as soon as the client disconnects (queued, prefilling or generating a whole reply)."""
    while not await request.is_disconnected():
        await asyncio.sleep(every_s)
    job.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

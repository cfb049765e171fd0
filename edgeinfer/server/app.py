"""The daemon's HTTP side: a Starlette app speaking OpenAI's API over the slot scheduler.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Every error is OpenAI-shaped ({"error": {"message", "type", "param", "code"}}) with its status:
400 bad request, 401 bad or missing key, 404 unknown route or model, 405, 408 body too slow, 413 body too large,
429 queue full (with Retry-After), 503 shutting down or a background request (header
x-edgeinfer-priority) the power plan refuses (with Retry-After), 500 a bug (logged, the server goes on).

Request path: the body is read (at most max_body_bytes) and parsed (`protocol`), the prompt is
tokenized, a place is reserved (`Scheduler.admit`, else 429 at once), and a `Job` runs in a worker
thread; its chunks come back through an asyncio queue. A streamed reply waits for the first event
before answering, so a refused prompt is still a plain 400; the stream then stops when the client
goes away (the job is cancelled within one token and its slot freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgeinfer.errors import EdgeInferError, ModelFormatError
from edgeinfer.overflow import ContextOverflowError
from edgeinfer.server import protocol, replies
from edgeinfer.server.config import ServeConfig
from edgeinfer.server.metrics import Metrics
from edgeinfer.server.protocol import APIError
from edgeinfer.server.scheduler import Cancelled, Closed, Job, QueueFull, Scheduler

log = logging.getLogger("edgeinfer.server")
BODY_READ_S = 30.0  # the most a request body may take to arrive (a 1 MiB body at 35 kB/s)
DRAIN_CHECK_S = 0.25  # how often a body still arriving looks whether the server began to drain
DROPPED_HEADER = "X-Edgeinfer-Dropped-Tokens"


class JSON(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed from a request cannot break the encoding."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    if e.status in (408, 413):  # the body was not read to its end: the connection cannot carry another request,
        headers = {**(headers or {}), "Connection": "close"}  # so it closes once the answer is out (as nginx does)
    return JSON(e.body(), status_code=e.status, headers=headers)


PRIORITY_HEADER = "x-edgeinfer-priority"  # interactive (default) | background


class Server:
    """The app's state: model, scheduler, metrics, settings; `app` is the ASGI application."""

    def __init__(self, model, config: ServeConfig):
        self.model, self.config = model, config
        self.model_id = model.folder.name
        self.created = int(time.time())
        self.scheduler = Scheduler(model, config.slots, config.queue)
        self.metrics = Metrics(self.scheduler, model.power)
        self.pool = ThreadPoolExecutor(max_workers=config.slots + config.queue, thread_name_prefix="edgeinfer-job")
        self.draining = False
        self._key = config.api_key.encode() if config.api_key else None
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_route, methods=["GET"])]
        cors = [Middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])] if config.cors_origins else []
        self.app = Starlette(routes=routes, middleware=cors + [Middleware(_Gate, server=self)],  # first = outermost
                             exception_handlers={HTTPException: self._http_error, Exception: self._bug})

    # ---- plumbing -------------------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: " + ("no such route" if exc.status_code == 404 else exc.detail)
        return error_response(APIError(exc.status_code, msg, code=code), headers=exc.headers)  # 405: Allow

    async def _bug(self, request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", type="server_error"))

    def authorized(self, request: Request) -> bool:
        if self._key is None:
            return True
        given = request.headers.get("authorization", "")  # decoded as latin-1: the raw bytes back below
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self._key)

    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
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
                if self.draining and not reading.done():  # SIGTERM: a body still coming is not served, and
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
        try:
            return json.loads(body)
        except RecursionError:
            raise APIError(400, "the body is not valid JSON: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's digit limit
            raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None

    def _check_priority(self, request: Request) -> None:
        """A request marked background (PRIORITY_HEADER) is refused with 503 and Retry-After while the
        power plan admits no background work; interactive requests (the default) always run, paced."""
        value = request.headers.get(PRIORITY_HEADER, "interactive").strip().lower()
        if value not in ("interactive", "background"):
            raise APIError(400, f"{PRIORITY_HEADER} must be interactive or background, got {value[:40]!r}",
                           param=PRIORITY_HEADER)
        power = self.model.power
        if value == "background" and power is not None and not power.admits_background():
            plan = power.plan
            raise APIError(503, f"background work is refused now by the power plan: {plan.reason}; retry later",
                           type="server_error", code="power_background_refused",
                           retry_after_s=max(5, int(power.policy.hold_s * 2)))

    # ---- routes -------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSON(replies.models_list(self.model_id, self.created))

    async def health(self, request: Request) -> Response:
        s, power = self.scheduler, self.model.power_state()
        return JSON({"status": "draining" if self.draining else "ok", "model": self.model_id,
                     "slots_busy": s.busy, "slots_total": len(s.slots), "queue_depth": max(0, s.waiting),
                     # the readings describe the device: only for callers holding the key (when one is set)
                     "power": power.as_dict() if power is not None and self.authorized(request) else None})

    async def metrics_route(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        try:
            self._check_priority(request)
            body = await self.read_json(request)
            limit = self.config.max_tokens_limit
            if chat:
                req = protocol.parse_chat(body, model_id=self.model_id, max_tokens_limit=limit)
                prompt = self.model.encode_chat(list(req.messages))
                logprobs = req.top_logprobs if req.logprobs else None
            else:
                req = protocol.parse_completion(body, model_id=self.model_id, max_tokens_limit=limit)
                prompt = self.model.encode_prompt(req.prompt if isinstance(req.prompt, str) else list(req.prompt))
                logprobs = req.logprobs
            try:
                ticket = self.scheduler.admit()
            except Closed:
                raise APIError(503, "the server is shutting down; retry on another instance or later",
                               type="server_error", code="shutting_down") from None
            except QueueFull:
                raise APIError(429, f"the server is busy: {len(self.scheduler.slots)} slots and a queue of "
                                    f"{self.config.queue} are full; retry shortly", type="rate_limit_error",
                               code="queue_full") from None
        except APIError as e:
            self.metrics.request(endpoint, e.status)
            headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return error_response(e, headers)
        except ModelFormatError as e:  # the model's own (a chat template that does not parse): not the client's
            log.error("cannot prepare the prompt: %s", e)
            self.metrics.request(endpoint, 500)
            return error_response(APIError(500, str(e), type="server_error"))
        except EdgeInferError as e:  # the prompt itself (vocabulary, empty, a template's raise_exception)
            self.metrics.request(endpoint, 400)
            return error_response(APIError(400, str(e)))
        try:  # from admit to a queued job: nothing may keep the ticket, or its place holds the line for ever
            if self.config.log_prompts:
                log.info("prompt %s", json.dumps(self.model.tokenizer.decode(prompt)))
            options = req.options
            if self.config.speculative != "off":
                options = dataclasses.replace(options, speculative=self.config.speculative)
            job = Job(self.scheduler, ticket, prompt, options, logprobs, asyncio.get_running_loop())
            self.pool.submit(job.run)
        except BaseException:  # never queued (the pool shut down, a failure): its place is given up
            self.scheduler.withdraw(ticket)
            raise
        reply = _Reply(self, req, chat, prompt, job, t0, endpoint)
        watch = asyncio.ensure_future(_cancel_on_disconnect(request, job))
        try:
            first = await job.events.get()
            if first[0] == "error":
                return reply.failed(first[1])
            if req.stream:  # from here Starlette's StreamingResponse watches the client
                watch.cancel()
                return StreamingResponse(reply.stream(first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await reply.whole(first)
        finally:
            watch.cancel()


class _Reply:
    """One generation request's answer, whole or streamed (state of a single response)."""

    def __init__(self, server: Server, req, chat: bool, prompt: list[int], job: Job, t0: float, endpoint: str):
        self.server, self.req, self.chat, self.prompt, self.job, self.t0 = server, req, chat, prompt, job, t0
        self.endpoint = endpoint
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model_id = server.model_id
        self.ttft_s: float | None = None
        self.tok = server.model.tokenizer
        self._offsets = replies.TextOffsets(len(req.prompt) if not chat and isinstance(req.prompt, str) else 0)
        self._gate = replies.LogprobGate()  # logprobs go out with the text their tokens add (a stop string's: never)

    def failed(self, exc: BaseException, tokens: int = 0) -> Response:
        """The error answer to a request that did not finish, after generating `tokens`."""
        if isinstance(exc, Cancelled):  # the client left (nobody reads this) or the server is stopping
            err = APIError(503, "the server is shutting down", type="server_error", code="shutting_down") \
                if self.server.draining else APIError(499, "the client closed the request", code="client_closed")
        elif isinstance(exc, ContextOverflowError):
            err = APIError(400, str(exc), param="messages" if self.chat else "prompt", code="context_length_exceeded")
        elif isinstance(exc, ModelFormatError):  # the model's own fault (non-finite logits): not the request's
            log.error("generation failed: %s", exc)
            err = APIError(500, str(exc), type="server_error")
        elif isinstance(exc, EdgeInferError):
            err = APIError(400, str(exc))
        else:
            log.error("generation failed: %r", exc)
            err = APIError(500, "generation failed", type="server_error")
        self.server.metrics.request(self.endpoint, err.status)
        self.server.metrics.cut(tokens)
        self._log(err.status, tokens)
        return error_response(err)

    def _usage(self, completion, cached: int) -> dict:
        u = completion.usage
        return replies.usage(len(self.prompt), u.completion_tokens, cached, u.dropped_tokens)

    def _token_logprobs(self, chunk) -> list[dict] | None:
        if chunk.logprob is None or chunk.token_id is None:
            return None
        top = [(self.tok.token_text(i), lp) for i, lp in chunk.top_logprobs]
        text = self.tok.token_text(chunk.token_id)
        if isinstance(text, str) and chunk.piece and chunk.piece != text:  # what it added to this reply: a first
            text = chunk.piece  # token's space dropped, a character the prompt began completed (byte tokens: exact)
        return [replies.token_logprob(text, chunk.logprob, top)]

    def _log(self, status: int, completion_tokens: int) -> None:
        total_ms = (time.perf_counter() - self.t0) * 1e3
        ttft = f"{self.ttft_s * 1e3:.1f}" if self.ttft_s is not None else "-"
        fields = {"method": "POST", "path": f"/v1/{'chat/' if self.chat else ''}completions", "status": status,
                  "prompt_tokens": len(self.prompt), "completion_tokens": completion_tokens, "ttft_ms": ttft,
                  "total_ms": round(total_ms, 1)}
        if self.server.config.log_format == "json":
            log.info(json.dumps(fields))
        else:
            log.info(" ".join(f"{k}={v}" for k, v in fields.items()))

    def _finish_metrics(self, completion, cached: int, status: int = 200) -> None:
        m = self.server.metrics
        m.request(self.endpoint, status)
        m.finished(completion, len(self.prompt), cached, self.ttft_s, time.perf_counter() - self.t0)
        self._log(status, completion.usage.completion_tokens)

    async def whole(self, first) -> Response:
        chunks, event = [], first
        while event[0] == "chunk":
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.t0
            chunks.append(event[1])
            event = await self.job.events.get()
        if event[0] == "error":
            return self.failed(event[1], sum(c.token_id is not None for c in chunks))
        _, completion, cached = event
        usage = self._usage(completion, cached)
        reason = replies.finish_reason(completion.finish_reason)
        lps = self._logprobs(self._released(chunks) + self._gate.finish(completion.finish_reason == "stop"))
        if self.chat:
            body = replies.chat_response(id=self.id, created=self.created, model=self.model_id, text=completion.text,
                                          finish_reason=reason, usage=usage, logprobs=lps)
        else:
            body = replies.completion_response(id=self.id, created=self.created, model=self.model_id,
                                                text=completion.text, finish_reason=reason, usage=usage, logprobs=lps)
        self._finish_metrics(completion, cached)
        return JSON(body, headers={DROPPED_HEADER: str(completion.usage.dropped_tokens)})

    def _released(self, chunks) -> list[dict]:
        """The logprob entries that go out with these chunks' text (`LogprobGate`)."""
        out = []
        for c in chunks:
            entries = self._token_logprobs(c)
            out += self._gate.feed(c.text, entries[0] if entries else None, c.piece)
        return out

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
                yield _sse(replies.chat_chunk(id=self.id, created=self.created, model=self.model_id,
                                               delta={"role": "assistant", "content": ""}))
            while event[0] == "chunk":
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.t0
                chunks, event = [event[1]], None
                while not self.job.events.empty():  # the client fell behind: send what is ready as one event
                    event = self.job.events.get_nowait()
                    if event[0] != "chunk":
                        break
                    chunks.append(event[1])
                    event = None
                tokens += sum(c.token_id is not None for c in chunks)  # before the yield: a client that
                text, entries = "".join(c.text for c in chunks), self._released(chunks)  # leaves there still
                if text or entries:  # counts them
                    yield _sse(self._chunk_body(text, entries))
                if event is None:
                    event = await self.job.events.get()
            if event[0] == "error":
                if isinstance(event[1], Cancelled):  # the grace period ended (or the client left: nobody reads)
                    err = APIError(503, str(event[1]), type="server_error", code="shutting_down")
                    status = 503 if self.server.draining else 499
                else:
                    status = 400 if isinstance(event[1], EdgeInferError) and \
                        not isinstance(event[1], ModelFormatError) else 500
                    err = APIError(status, str(event[1]) or "generation failed", type="server_error")
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            _, completion, cached = event
            reason = replies.finish_reason(completion.finish_reason)
            if entries := self._gate.finish(completion.finish_reason == "stop"):
                yield _sse(self._chunk_body("", entries))
            if self.chat:
                yield _sse(replies.chat_chunk(id=self.id, created=self.created, model=self.model_id, delta={},
                                               finish_reason=reason))
            else:
                yield _sse(replies.completion_chunk(id=self.id, created=self.created, model=self.model_id, text="",
                                                     finish_reason=reason))
            if self.req.include_usage:
                usage = self._usage(completion, cached)
                build = replies.chat_chunk if self.chat else replies.completion_chunk
                extra = {"delta": {}} if self.chat else {"text": ""}
                body = build(id=self.id, created=self.created, model=self.model_id, usage=usage, **extra)
                yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects: the generator is closed or cancelled here
            self.job.cancel()
            if completion is not None:
                self._finish_metrics(completion, event[2], status)
            else:  # cut short: by the client (499, nobody reads), the server stopping (503) or a failure
                self.server.metrics.request(self.endpoint, 499 if status == 200 else status)
                self.server.metrics.cut(tokens)
                self._log(499 if status == 200 else status, tokens)

    def _chunk_body(self, text: str, entries: list[dict]) -> dict:
        """One SSE event: the text of one or more consecutive chunks and the logprob entries released with it."""
        if self.chat:
            return replies.chat_chunk(id=self.id, created=self.created, model=self.model_id,
                                       delta={"content": text}, logprobs=self._logprobs(entries))
        return replies.completion_chunk(id=self.id, created=self.created, model=self.model_id, text=text,
                                         logprobs=self._logprobs(entries))


async def _cancel_on_disconnect(request: Request, job: Job, every_s: float = 0.1) -> None:
    """Cancel `job` as soon as the client disconnects (queued, prefilling or generating a whole reply)."""
    while not await request.is_disconnected():
        await asyncio.sleep(every_s)
    job.cancel()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Gate:
    """ASGI middleware in front of every route: 503 while draining, 401 without the key (except /health)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        err = None
        if self.server.draining and path != "/health":
            err = APIError(503, "the server is shutting down; retry on another instance or later",
                           type="server_error", code="shutting_down")
        elif path != "/health" and not self.server.authorized(Request(scope)):
            err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if err is None:
            return await self.app(scope, receive, send)
        self.server.metrics.request("other", err.status)
        return await error_response(err)(scope, receive, send)

"""The daemon's HTTP side: a Starlette app speaking OpenAI's API over the slot scheduler.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics.
Every error is OpenAI-shaped ({"error": {"message", "type", "param", "code"}}) with its status:
400 bad request, 401 bad or missing key, 403 a web page's request without a key (a foreign Origin or Host),
404 unknown route or model, 405, 408 body too slow, 413 body too large, 415 a compressed body,
429 queue full (with Retry-After), 499 (logged and counted only) the client left, 503 shutting down or a background request (header
x-edgeinfer-priority) the power plan refuses (with Retry-After) or a process forked while the server was answering
requests (`Server.forked`), 500 a bug (logged, the server goes on).

Request path: a request that could not be admitted now is answered 429 before its body is read;
the rest have their body read (at most max_body_bytes, `body.py`), its bytes counted as they arrive
against a budget of slots + queue bodies (429 past it); a request for which no place is left,
counting those admitted and those preparing, is answered 429 at once; the rest are parsed as JSON
and by `protocol`, and tokenized, in the tokenizing thread pool, not on the event loop (a large
prompt takes most of a second: other streams and /health go on meanwhile); TOKENIZE_THREADS at
once, the others wait their turn holding only their body's bytes, so a burst of large bodies cannot
take more than that many cores, nor more memory than the budget's bytes and one body parsed, before
admission, and one whose client leaves meanwhile is dropped untokenized (its body emptied). Then a
place is reserved (`Scheduler.admit`, else 429 at once), and a `Job` runs in a worker thread; its
chunks come back through an asyncio queue. A streamed reply waits for the first event before
answering, so a refused prompt is still a plain 400; the stream then stops when the client goes
away (the job is cancelled within one token and its slot freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from edgeinfer.errors import EdgeInferError, InvalidArgumentError, ModelFormatError
from edgeinfer.server import protocol, replies
from edgeinfer.server.body import DRAIN_CHECK_S, BodyBudget, drop, parse_json, read_body
from edgeinfer.server.config import PROMPT_RINGS, ServeConfig, is_loopback
from edgeinfer.server.metrics import Metrics
from edgeinfer.server.protocol import APIError
from edgeinfer.overflow import ContextOverflowError, refuse_longer_than_ring
from edgeinfer.server.answer import (DROPPED_HEADER, JSON, Reply, cancel_on_disconnect, error_response, log_request,
                                     new_reply_id, overflow_error)
from edgeinfer.server.scheduler import Closed, Job, QueueFull, Scheduler

log = logging.getLogger("edgeinfer.server")


PRIORITY_HEADER = "x-edgeinfer-priority"  # interactive (default) | background
TOKENIZE_THREADS = 1  # requests parsed and tokenized at once: at most one core goes to it (measured, 4 bodies
# of 578 KB on SmolLM2's tokenizer.json: /health answered within 0.82 s before the wrapper's encode released
# the GIL, within 0.03 s after)


class Server:
    """The app's state: model, scheduler, metrics, settings; `app` is the ASGI application."""

    def __init__(self, model, config: ServeConfig):
        self.model, self.config = model, config
        self.model_id = os.path.basename(os.path.abspath(model.folder))  # (`-m .` was the id "", and its
        # folder's name a 404; links are not followed: a `current` link repointed at each update keeps its id)
        self.max_prompt_tokens = config.max_prompt_tokens or PROMPT_RINGS * model.capacity_tokens
        self.created = int(time.time())
        self.scheduler = Scheduler(model, config.slots, config.queue)
        self.metrics = Metrics(self.scheduler, model.power)
        self.pool, self.tokenize_pool = self._new_pools()
        self.draining = False
        self.forked_busy = False  # `forked`: this process forked while other threads answered requests
        self.bodies = BodyBudget(config.body_budget_bytes)  # the bytes of bodies read, parsed or tokenized,
        # not yet admitted (`_generate`): a burst holds that many, not a body per client
        self.places = config.slots + config.queue
        self.preparing = 0  # requests whose whole body waits for or is in the tokenizing thread: with those
        # admitted, at most `places` (a burst of small bodies was all parsed and tokenized before its 429s: a review)
        self._key = config.api_key.encode() if config.api_key else None
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model_card, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_route, methods=["GET"])]
        cors = [Middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After", DROPPED_HEADER])] \
            if config.cors_origins else []  # (a page's script reads no other header than those CORS lists)
        self.app = Starlette(routes=routes, middleware=cors + [Middleware(_Gate, server=self)],  # first = outermost
                             exception_handlers={HTTPException: self._http_error, Exception: self._bug})
        self.app.router.redirect_slashes = False  # Starlette's 307 for "/v1/completions/" has an empty body, which
        # clients that do not follow a POST's redirect show as a bare error: our 404 names the route instead
        self._paths = {r.path for r in routes if "{" not in r.path}
        _SERVERS.add(self)

    def _new_pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        return (ThreadPoolExecutor(max_workers=self.config.slots + self.config.queue, thread_name_prefix="edgeinfer-job"),
                ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="edgeinfer-tokenize"))

    def forked(self) -> None:
        """In a child that fork() made (an app that builds the server and forks its workers, as a
        prefork web server does): the pools' threads stayed in the parent, and an executor that has
        run a job keeps that idle thread's place, so the child's first request waited for ever for a
        thread that is not there (a hostile round); the child gets pools of its own, and metrics of
        its own (their locks: another thread may have held one at the fork; the counts start again,
        as any new process's). A server that was answering requests in other threads at the fork (a
        slot taken, a request queued, being tokenized, or its body being read) holds slots, locks and
        body bytes for threads the child lacks: every request but /health is then refused with 503
        `forked_busy` (build the server again in the child, or fork while it is idle); an idle one
        renews the scheduler's locks (`Scheduler.after_fork_idle`)."""
        self.pool, self.tokenize_pool = self._new_pools()
        self.metrics = Metrics(self.scheduler, self.model.power)
        s = self.scheduler
        self.forked_busy = bool(s.busy or s.waiting or s.jobs or self.preparing or self.bodies.held_bytes)
        if not self.forked_busy:
            s.after_fork_idle()

    # ---- plumbing -------------------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: " + ("no such route" if exc.status_code == 404 else exc.detail)
        meant = request.url.path.rstrip("/")
        if exc.status_code == 404 and meant != request.url.path and meant in self._paths:
            msg += f" (without the trailing slash: {meant})"
        self.log_refusal(request.method, request.url.path, exc.status_code, code)
        return error_response(APIError(exc.status_code, msg, code=code), headers=exc.headers)  # 405: Allow

    def _refused(self, request: Request, endpoint: str, err: APIError, t0: float, unread: bool = False) -> Response:
        """A completion request answered with `err` before it was admitted: counted, logged, answered
        (`unread`: its body was not read, so its connection closes after the answer, as for a 413)."""
        self.metrics.request(endpoint, err.status)
        self.log_refusal(request.method, request.url.path, err.status, err.code or err.param, t0)
        headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else {}
        return error_response(err, {**headers, "Connection": "close"} if unread else headers or None)

    def log_refusal(self, method: str, path: str, status: int, why: str | None, t0: float | None = None) -> None:
        """The log line of a request refused before generating (a generated reply logs its own)."""
        fields = {"method": method, "path": path[:200], "status": status, "error": why or "-"}
        if t0 is not None:
            fields["total_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        log_request(self.config.log_format, fields)

    async def _bug(self, request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", type="server_error"))

    def authorized(self, request: Request) -> bool:
        if self._key is None:
            return True
        given = request.headers.get("authorization", "")  # decoded as latin-1: the raw bytes back below
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self._key)

    def _check_priority(self, request: Request) -> bool:
        """Whether the request is marked background (PRIORITY_HEADER); such a one is refused with 503 and
        Retry-After while the power plan admits no background work, here and again when it reaches its
        slot (`_background_refused`); interactive requests (the default) always run, paced."""
        value = request.headers.get(PRIORITY_HEADER, "interactive").strip().lower()
        if value not in ("interactive", "background"):
            raise APIError(400, f"{PRIORITY_HEADER} must be interactive or background, got {value[:40]!r}",
                           param=PRIORITY_HEADER)
        refused = self._background_refused() if value == "background" else None
        if refused is not None:
            raise refused
        return value == "background"

    def _background_refused(self) -> APIError | None:
        """The 503 for background work while the power plan refuses it; None while it admits it."""
        power = self.model.power
        if power is None or power.admits_background():
            return None
        return APIError(503, f"background work is refused now by the power plan: {power.plan.reason}; retry later",
                        type="server_error", code="power_background_refused",
                        retry_after_s=max(5, int(power.policy.hold_s * 2)))

    # ---- routes -------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSON(replies.models_list(self.model_id, self.created))

    def foreign_page(self, request: Request) -> APIError | None:
        """Without an API key (loopback only), a 403 for what a web page in this device's browser sends:
        an Origin that is not a loopback one nor in cors-origins (a page elsewhere posting a "simple"
        request, which needs no preflight: it ran a generation, unread), or a Host that is not a loopback
        name (DNS rebinding: a page whose name now points at 127.0.0.1 reads the reply). Clients that
        are not browsers send no Origin and the Host they connected to."""
        origin = request.headers.get("origin")
        if origin is not None and origin not in self.config.cors_origins and not _loopback_url(origin):
            return APIError(403, f"requests from web pages of {origin[:100]!r} are refused (not in cors-origins)",
                            code="origin_not_allowed")
        host = request.headers.get("host")
        if host is not None and not _loopback_url("http://" + host):
            return APIError(403, f"Host {host[:100]!r} is not this server's loopback name (without an API key the "
                                 "server answers only for localhost, 127.0.0.1 and [::1])", code="host_not_allowed")
        return None

    async def model_card(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model's card, or OpenAI's 404 for any other id."""
        asked = request.path_params["model"]
        if not asked:  # "/v1/models/": the list's route with a slash, not a model called ""
            raise HTTPException(404)
        if asked != self.model_id:
            err = APIError(404, f"The model '{asked[:200]}' does not exist", param="model", code="model_not_found")
            self.log_refusal(request.method, request.url.path, err.status, err.code)
            return error_response(err)
        return JSON(replies.model_card(self.model_id, self.created))

    async def health(self, request: Request) -> Response:
        s, power = self.scheduler, self.model.power_state()
        return JSON({"status": "draining" if self.draining else "closed" if self.model.closed
                     else "forked_busy" if self.forked_busy else "ok",
                     "model": self.model_id,
                     "provider": self.model.session.provider,  # the one ONNX Runtime really runs on
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

    def _prepare(self, raw: bytearray, chat: bool) -> tuple:
        """The parsed request, its prompt's token ids, its logprobs setting and a chat's generation cue
        (`Scheduler.cue_for`: a template rendered twice, here rather than on the loop), of the body's
        bytes (parsed here: `body.py` says why). Runs in `tokenize_pool`, off the event loop. Safe
        from several threads at once: `Model.encode_*`, the tokenizer wrapper and both back ends only
        read what loading set (SentencePiece's encoder is const; `tokenizers`' is Sync), and a
        compiled Jinja template renders each call in a fresh context. Both back ends release the GIL
        while they encode (`tokenizers` in its `encode_batch`, which the wrapper uses). Raises what
        those raise (APIError, EdgeInferError), as when it ran on the loop."""
        limit = self.config.max_tokens_limit
        body = parse_json(raw)
        if chat:
            req = protocol.parse_chat(body, model_id=self.model_id, max_tokens_limit=limit)
        else:
            req = protocol.parse_completion(body, model_id=self.model_id, max_tokens_limit=limit)
        try:
            req.options.sampling.check_vocabulary(self.model.manifest.arch.vocab_size)
        except InvalidArgumentError as e:
            raise APIError(400, str(e), param="logit_bias") from None
        param = "messages" if chat else "prompt"
        try:  # what the prompt's text or ids themselves break (vocabulary, UTF-8, the template's own checks)
            if chat:
                prompt = self.model.encode_chat(list(req.messages), req.template_variables)
            else:
                prompt = self.model.encode_prompt(req.prompt if isinstance(req.prompt, str) else list(req.prompt))
        except InvalidArgumentError as e:
            raise APIError(400, str(e), param=param) from None
        # OpenAI's context_length_exceeded: a 400 naming the lengths, the tighter limit first. Under --overflow
        # error a prompt longer than the ring is refused here: in its slot it was refused after the slot was
        # emptied for it (a review)
        ring = self.model.capacity_tokens if self.model.overflow == "error" else None
        if ring is not None and ring <= self.max_prompt_tokens:
            self._refuse_longer_than_ring(prompt, param)
        if len(prompt) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt is {len(prompt)} tokens; this server takes at most "
                                f"{self.max_prompt_tokens} (max-prompt-tokens)", param=param,
                           code="context_length_exceeded")
        if ring is not None:
            self._refuse_longer_than_ring(prompt, param)
        cue = self.scheduler.cue_for(req.template_variables) if chat else None
        return req, prompt, (req.top_logprobs if req.logprobs else None) if chat else req.logprobs, cue

    def _refuse_longer_than_ring(self, prompt: list[int], param: str) -> None:
        try:
            refuse_longer_than_ring(prompt, self.model.capacity_tokens)
        except ContextOverflowError as e:
            raise overflow_error(e, param) from None

    async def _prepared(self, request: Request, raw: bytearray, chat: bool) -> tuple:
        """`_prepare` in the tokenizing thread, for a request that could be admitted now (`_generate`
        counts those admitted and those preparing against the places; else 429 at once, before any
        tokenizing: a busy server turns away a backlog without encoding it).
        While it waits for that thread (or is in it), a request is given up when the client leaves
        (499: it is never tokenized, or its tokenization finishes unread) or when SIGTERM begins the
        drain (503 at once, as for a body still arriving: the drain counts only admitted requests,
        and uvicorn would cut the rest off with a traceback when it stops)."""
        waiting = asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self._prepare, raw, chat)
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=DRAIN_CHECK_S)
            if waiting.done():
                break
            if self.draining:
                waiting.cancel()
                drop(raw)
                raise APIError(503, "the server is shutting down; retry on another instance or later",
                               type="server_error", code="shutting_down")
            if await request.is_disconnected():
                waiting.cancel()
                drop(raw)
                raise APIError(499, "the client closed the request", code="client_closed")
        try:
            return waiting.result()
        finally:  # a refusal's traceback holds this frame: through `waiting` it held the refusal itself, a cycle
            waiting = None  # that kept `_prepare`'s frame (a 1 MiB prompt's 449,305 ids, its body) until the
            # cycle collector ran: ten 1 MiB prompts refused one after another took the bundled model's
            # service from 88 to 252 MiB (a review), where one took it to 134

    def _queue_full(self) -> APIError:
        n, q = len(self.scheduler.slots), self.config.queue
        return APIError(429, f"the server is busy: its {n} slot{'s' if n != 1 else ''} and its queue of {q} "
                             f"request{'s' if q != 1 else ''} are full; retry shortly", type="rate_limit_error",
                        code="queue_full")

    async def _generate(self, request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        hold = self.bodies.hold()
        try:
            background = self._check_priority(request)
            if self.scheduler.full:  # before its body is read (it is not read at all)
                return self._refused(request, endpoint, self._queue_full(), t0, unread=True)
            with hold:
                raw = await read_body(request, self.config.max_body_bytes, lambda: self.draining, hold)
                if self.preparing + self.scheduler.in_flight >= self.places:
                    raise self._queue_full()  # (after the body: an upload that stalls holds no place)
                self.preparing += 1
                try:
                    req, prompt, logprobs, cue = await self._prepared(request, raw, chat)
                    del raw
                    try:
                        ticket = self.scheduler.admit()
                    except Closed:
                        raise APIError(503, "the server is shutting down; retry on another instance or later",
                                       type="server_error", code="shutting_down") from None
                    except QueueFull:
                        raise self._queue_full() from None
                finally:
                    self.preparing -= 1
        except APIError as e:
            return self._refused(request, endpoint, e, t0, unread=hold.over)
        except ModelFormatError as e:  # the model's own (a chat template that does not parse): not the client's
            log.error("cannot prepare the prompt: %s", e)
            return self._refused(request, endpoint, APIError(500, str(e), type="server_error"), t0)
        except EdgeInferError as e:  # the prompt itself (vocabulary, empty, a template's raise_exception)
            return self._refused(request, endpoint, APIError(400, str(e)), t0)
        try:  # from admit to a queued job: nothing may keep the ticket, or its place holds the line for ever
            reply_id = new_reply_id(chat)
            if self.config.log_prompts:  # the reply's id, as its request line has it (requests overlap)
                log_request(self.config.log_format, {"id": reply_id, "prompt": self.model.tokenizer.decode(prompt)})
            options = req.options
            if self.config.speculative != "off":
                options = dataclasses.replace(options, speculative=self.config.speculative)
            job = Job(self.scheduler, ticket, prompt, options, logprobs, asyncio.get_running_loop(),
                      streamed=req.stream, refusal=self._background_refused if background else None,
                      cue=cue)
            self.pool.submit(job.run)
        except BaseException:  # never queued (the pool shut down, a failure): its place is given up
            self.scheduler.withdraw(ticket)
            raise
        reply = Reply(self, req, chat, prompt, job, t0, endpoint, reply_id)
        watch = asyncio.ensure_future(cancel_on_disconnect(request, job))
        try:
            first = await job.next_event()
            if first[0] == "error":
                return reply.failed(first[1])
            if req.stream:  # from here Starlette's StreamingResponse watches the client
                watch.cancel()
                return StreamingResponse(reply.stream(first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await reply.whole(first)
        finally:
            watch.cancel()


def _loopback_url(url: str) -> bool:
    """Whether `url`'s host is a loopback name or address (`config.is_loopback`), or a name under
    .localhost (which browsers resolve to loopback themselves)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return False
    return host is not None and (is_loopback(host) or host.endswith(".localhost"))


class _Gate:
    """ASGI middleware in front of every route: 503 while draining or forked busy (`Server.forked`),
    401 without the key (except /health), 403 for a web page's request to a server without a key
    (`Server.foreign_page`)."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path[:8].lower().startswith(("http://", "https://")):  # the absolute form, which a server must accept
            raw = _origin_form(scope.get("raw_path") or path.encode())  # (RFC 9112 3.2.2; a proxy's form):
            path = _origin_form(path)  # uvicorn's h11 gives the whole URL as the path
            scope = {**scope, "path": path, "raw_path": raw}
        err = None
        if self.server.draining and path != "/health":
            err = APIError(503, "the server is shutting down; retry on another instance or later",
                           type="server_error", code="shutting_down")
        elif self.server.forked_busy and path != "/health":
            err = APIError(503, "this process was forked while the server answered requests in threads it does not "
                                "have: build the server again in this process, or fork while it is idle",
                           type="server_error", code="forked_busy")
        elif path != "/health" and not self.server.authorized(Request(scope)):
            err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        elif not self.server.config.api_key:
            err = self.server.foreign_page(Request(scope))
        if err is None:
            return await self._guarded(scope, receive, send, path)
        self.server.metrics.request("other", err.status)
        self.server.log_refusal(scope.get("method", "-"), path, err.status, err.code)
        return await error_response(err)(scope, receive, send)


    async def _guarded(self, scope, receive, send, path: str):
        """The route, a bug in it answered here with a 500 (inside the CORS middleware, so that a page's
        script reads it: Starlette's own handler answers outside it, with no CORS headers; a review)."""
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            return await self.app(scope, receive, watched)
        except Exception:
            if started:  # (the reply is under way: nothing to say but what the connection's end says)
                raise
            log.exception("internal error on %s %s", scope.get("method", "-"), path)
            endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path, "other")
            self.server.metrics.request(endpoint, 500)  # (a review: a bug's 500 was counted nowhere)
            self.server.log_refusal(scope.get("method", "-"), path, 500, "server_error")
            return await error_response(APIError(500, "internal server error", type="server_error"))(scope, receive,
                                                                                                      send)


_SERVERS: "weakref.WeakSet[Server]" = weakref.WeakSet()  # the process's servers, for `Server.forked`


def _after_fork_in_child() -> None:
    for server in list(_SERVERS):
        server.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _origin_form(target):
    """"/v1/models" of "http://host:port/v1/models" (str or bytes); "/" when it names no path."""
    sep = "/" if isinstance(target, str) else b"/"
    parts = target.split(sep, 3)
    return sep + (parts[3] if len(parts) == 4 else sep[:0])

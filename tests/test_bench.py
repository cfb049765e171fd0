"""`edgeinfer bench --json` on the bundled model: the keys the issue names, and sane values
(no timing thresholds: speed lives in benchmarks, not tests)."""

from __future__ import annotations

import json
import os
import platform

import onnxruntime

import edgeinfer
from edgeinfer.cli import main
from edgeinfer.model import default_model_path


def test_bench_json_keys_and_sane_values(capsys):
    assert main(["bench", "--json", "--prompt-tokens", "64", "--gen-tokens", "16", "--runs", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("load_s", "ttft_ms", "prefill_tok_s", "decode_tok_s", "peak_rss_mb", "cpu_s_per_token"):
        assert key in r, key
    assert r["load_s"] > 0 and 0 < r["peak_rss_mb"] < 24 * 1024
    for key in ("ttft_ms", "prefill_tok_s", "decode_tok_s", "cpu_s_per_token"):
        s = r[key]
        assert 0 <= s["min"] <= s["median"] <= s["max"], (key, s)
    assert r["decode_tok_s"]["min"] > 0 and r["ttft_ms"]["min"] > 0
    # CPU time to the microsecond: os.times() ticked every 10 ms, so the bundled model's ~0.1 ms tokens
    # read 0.0 (hostile round)
    assert 0 < r["cpu_s_per_token"]["min"] < 0.01
    assert r["prompt_tokens"] == 64 and r["gen_tokens"] == 16 and r["runs"] == 2 and r["quantization"] == "int8"
    # a saved result says what ran: the folder absolute, the versions (hostile round: -m as typed, none)
    assert r["model"] == os.path.abspath(default_model_path())
    assert r["versions"] == {"edgeinfer": edgeinfer.__version__, "onnxruntime": onnxruntime.__version__,
                             "python": platform.python_version()}


def test_bench_json_names_a_relative_model_folder_absolutely(capsys, monkeypatch):
    folder = default_model_path().resolve()
    monkeypatch.chdir(folder.parent)
    assert main(["bench", "--json", "-m", folder.name, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == os.path.join(os.getcwd(), folder.name)
    assert main(["bench", "-m", folder.name, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1"]) == 0
    assert " MiB, " in capsys.readouterr().out  # the peak is MiB (inspect's MB are 10^6 bytes)


def test_bench_rejects_bad_arguments(capsys):
    assert main(["bench", "--gen-tokens", "1"]) == 1
    assert "gen-tokens" in capsys.readouterr().err
    assert main(["bench", "--prompt-tokens", "1000000000"]) == 1  # was a 7.45 GiB allocation's traceback
    assert "at most 1048576" in capsys.readouterr().err
    assert main(["bench", "--capacity", "0"]) == 1  # was read as "not given"
    assert "--capacity must be at least 2" in capsys.readouterr().err
    assert main(["bench", "--capacity", "4"]) == 1  # it offered "fewer sinks", which bench cannot set
    err = capsys.readouterr().err
    assert "--capacity must be at least 5: the ring keeps 4 attention sinks" in err and "fewer" not in err
    assert main(["bench", "--runs", "99999999999999999999999"]) == 1  # it ran for ever (a hostile round)
    assert capsys.readouterr().err == "edgeinfer: error: --runs may be at most 1000\n"


def test_bench_defaults_run_on_a_model_trained_on_fewer_positions(capsys):
    """The documented default command (a 512-token prompt, 128 tokens) on the bundled model, trained on
    512 positions: its own ring (512 + 128 + 8) would pass that length, so it runs in the model's
    default ring (480), through which the prompt shifts, and says so."""
    assert main(["bench", "--json", "--runs", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == 512 and r["gen_tokens"] == 128 and r["capacity_tokens"] == 480
    assert main(["bench", "--runs", "1"]) == 0  # the text report says so too (it said nothing: a fresh user's walkthrough)
    out = capsys.readouterr().out
    assert "the KV ring holds 480 tokens, fewer than the job's 640" in out
    assert "the most this model holds without re-basing often" in out
    # a ring the user made small: that is the cause (it blamed the model's trained length, hostile round)
    assert main(["bench", "--runs", "1", "--capacity", "16", "--prompt-tokens", "64", "--gen-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "holds 16 tokens, fewer than the job's 72" in out and "(--capacity 16: a larger ring" in out
    assert main(["bench", "--runs", "1", "--prompt-tokens", "64", "--gen-tokens", "16"]) == 0
    assert "KV ring holds" not in capsys.readouterr().out


def test_every_bench_run_prefills_its_prompt_cold(monkeypatch):
    """The review's find: runs after the first reused the prompt from the prefix cache, so the median
    TTFT was a warm one (4.7 ms cold, 0.2-0.4 ms warm on a 200-token prompt)."""
    from edgeinfer.bench import BenchConfig, run_bench
    from edgeinfer.model import Model

    cached, real = [], Model.generate

    def generate(self, *a, **k):
        c = real(self, *a, **k)
        cached.append(c.usage.cached_tokens)
        return c

    monkeypatch.setattr(Model, "generate", generate)
    run_bench(BenchConfig(prompt_tokens=200, gen_tokens=8, runs=3))
    assert cached == [0, 0, 0]

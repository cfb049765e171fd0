"""ONNX Runtime session settings for the decode step, measured side by side (issue 15: "ORT session
settings chosen by measurement": thread pool spinning, graph optimization level, per-node overhead).

    python scripts/bench_session_options.py -m MODEL [-m MODEL ...] [--rounds 5] [--out FILE]

Every variant is one `edgeinfer.load` of the model with `session.session_options` patched to apply
the variant on top of edgeinfer's own options (the baseline: full graph optimization, 2 intra-op
threads, ONNX Runtime's default spinning). Each round runs every variant once, alternating the
order, and times `Engine.decode_one` after a 31-token prompt: 200 steps after 20 warm-up steps,
the round's median step. Reports per model and variant the median over rounds, the ratio to the
baseline, and the CPU seconds per step (user + system; spinning burns CPU that a device pays for
in battery and heat). JSON out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnxruntime as ort  # noqa: E402

import edgeinfer  # noqa: E402
import edgeinfer.session as session_mod  # noqa: E402

VARIANTS = {  # name -> (threads, function applied to the SessionOptions)
    "baseline": (2, lambda so: None),
    "threads_1": (1, lambda so: None),
    "no_spinning": (2, lambda so: so.add_session_config_entry("session.intra_op.allow_spinning", "0")),
    "extended_opt": (2, lambda so: setattr(so, "graph_optimization_level",
                                           ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)),
    "no_mem_pattern": (2, lambda so: setattr(so, "enable_mem_pattern", False)),
    "no_cpu_arena": (2, lambda so: setattr(so, "enable_cpu_mem_arena", False)),
    "baseline_again": (2, lambda so: None),  # a second session of the baseline: the noise floor
}


def load(model: str, variant: str):
    threads, tweak = VARIANTS[variant]
    original = session_mod.session_options

    def patched(*args, **kwargs):  # session.session_options as it is called, whatever its arguments
        so = original(*args, **kwargs)
        tweak(so)
        return so

    session_mod.session_options = patched
    try:
        return edgeinfer.load(model, threads=threads, capacity_tokens=512)
    finally:
        session_mod.session_options = original


def steps(m, rng) -> tuple[float, float]:
    """(median step ms, CPU s per step) of 200 decode steps after a 31-token prompt."""
    V = m.manifest.arch.vocab_size
    cache = m.new_cache()
    m.engine.prefill(cache, [1] + rng.integers(3, V, 31).tolist())
    toks = rng.integers(3, V, 220).tolist()
    for t in toks[:20]:
        m.engine.decode_one(cache, t)
    times, c0 = [], os.times()
    for t in toks[20:]:
        t0 = time.perf_counter()
        m.engine.decode_one(cache, t)
        times.append(time.perf_counter() - t0)
    c1 = os.times()
    return statistics.median(times) * 1e3, (c1.user - c0.user + c1.system - c0.system) / 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    report = {"onnxruntime": ort.__version__, "rounds": args.rounds, "models": {}}
    rng = np.random.default_rng(0)
    for model in args.model:
        loaded = {v: load(model, v) for v in VARIANTS}
        runs = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            for v in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                runs[v].append(steps(loaded[v], rng))
        base = statistics.median(x[0] for x in runs["baseline"])
        out = {}
        for v, rs in runs.items():
            med = statistics.median(x[0] for x in rs)
            out[v] = {"step_ms": round(med, 4), "speed_vs_baseline": round(base / med, 3),
                      "cpu_ms_per_step": round(statistics.median(x[1] for x in rs) * 1e3, 4)}
            print(model, v, out[v], file=sys.stderr)
        report["models"][model] = out
        del loaded
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Decode-step time of two installs of edgeinfer, or two model folders, side by side (A/B), alternating
runs in one harness.

    python scripts/bench_decode_ab.py -m MODEL --python A=/path/venvA/bin/python B=/path/venvB/bin/python \
        [--rounds 5] [--threads 2] [--out FILE]
    python scripts/bench_decode_ab.py -m A=OLD_FOLDER B=NEW_FOLDER --python A=python B=python ...

Each round runs every interpreter once, in turn, on two cases:
  valid32:   capacity 4,096, 31 prompt tokens, 200 decode steps (32 valid slots: cost set by valid tokens)
  full_ring: capacity 256, a 256-token prompt, then 1,000 decode steps with the ring full and wrapping
             (so any periodic work, e.g. re-basing positions, falls inside the timed steps)
  generate:  `Model.generate` of 300 tokens (EOS ignored), wall time per token: the whole loop
             (sampler, detokenizer, ring) around the steps, median of 5 calls
A step is one `Engine.decode_one` call (graph run + ring bookkeeping), timed with perf_counter.
Reports, per install and case, the median over rounds of the per-run median and mean step (ms); the
mean includes occasional slow steps that the median hides. JSON out; ratios B/A.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

INNER = r"""
import json, sys, time, statistics
import numpy as np
import edgeinfer
model, threads = sys.argv[1], int(sys.argv[2])
out = {}
T = edgeinfer.load(model).manifest.arch.max_position_embeddings  # no ring may be longer (the trained length)
for case, cap, prompt, steps in (("valid32", min(4096, T), 31, 200), ("full_ring", min(256, T // 2), min(256, T // 2), 1000)):
    m = edgeinfer.load(model, threads=threads, capacity_tokens=cap, prefill_chunk=256)
    rng = np.random.default_rng(0)
    V = m.manifest.arch.vocab_size
    cache = m.new_cache()
    m.engine.prefill(cache, [1] + rng.integers(3, V, prompt - 1).tolist())
    toks = rng.integers(3, V, steps + 20).tolist()
    for t in toks[:20]:  # warm-up
        m.engine.decode_one(cache, t)
    times = []
    for t in toks[20:]:
        t0 = time.perf_counter()
        m.engine.decode_one(cache, t)
        times.append((time.perf_counter() - t0) * 1e3)
    out[case] = {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times),
                 "max_ms": max(times), "dropped": cache.dropped}
m = edgeinfer.load(model, threads=threads, capacity_tokens=min(512, T))  # the whole generate loop, per token
ids = [1] + np.random.default_rng(1).integers(3, m.manifest.arch.vocab_size, 4).tolist()
m.generate(ids, max_new_tokens=50, ignore_eos=True, seed=1)
per_token = []
for _ in range(5):
    t0 = time.perf_counter()
    m.generate(ids, max_new_tokens=300, ignore_eos=True, seed=1)
    per_token.append((time.perf_counter() - t0) / 300 * 1e3)
out["generate"] = {"median_ms": statistics.median(per_token), "mean_ms": statistics.fmean(per_token),
                   "max_ms": max(per_token)}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", nargs="+", required=True, metavar="[NAME=]MODEL",
                    help="one folder for every install, or NAME=FOLDER for each")
    ap.add_argument("--python", nargs="+", required=True, metavar="NAME=PYTHON")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    installs = dict(p.split("=", 1) for p in args.python)
    models = dict(m.split("=", 1) for m in args.model) if "=" in args.model[0] else dict.fromkeys(installs, args.model[0])
    if set(models) != set(installs):
        ap.error("-m NAME=FOLDER needs one folder for each --python NAME")
    models = {name: str(Path(folder).resolve()) for name, folder in models.items()}  # the runs start in /
    runs: dict = {name: [] for name in installs}
    for r in range(args.rounds):
        for name, py in installs.items():
            res = subprocess.run([py, "-c", INNER, models[name], str(args.threads)], capture_output=True, text=True,
                                 check=True, cwd="/")
            runs[name].append(json.loads(res.stdout))
            print(f"round {r + 1} {name}: {res.stdout.strip()}", file=sys.stderr)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {case: {k: round(statistics.median(x[case][k] for x in rs), 4)
                                for k in ("median_ms", "mean_ms", "max_ms")} for case in rs[0]}
    names = list(installs)
    ratios = {}
    if len(names) == 2:
        a, b = summary[names[0]], summary[names[1]]
        ratios = {case: {k: round(b[case][k] / a[case][k], 4) for k in ("median_ms", "mean_ms")} for case in a}
    report = {"models": models, "pythons": installs, "threads": args.threads, "rounds": args.rounds, "summary": summary,
              f"ratio_{names[-1]}_over_{names[0]}": ratios}
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

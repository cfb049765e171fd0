"""What a speculative verify call costs: one graph call of s rows against a one-row step, side by side.

    python scripts/bench_verify_rows.py -m MODEL [--context 300] [--capacity N] [--threads 2]
        [--rows 1,2,3,4,5,9] [--rounds 2000] [--out FILE.json]

A ring of `--capacity` slots (default: the model's default ring) is prefilled with `--context` tokens; then, `--rounds` times, one call
of each size in `--rows` (all logits, nothing committed: what `SpeculativeStepper` runs), in turn.
Reports each size's median time after the first 10 % of rounds, and its ratio to the one-row step.
The ratio is what speculation's rule weighs (`Engine.verify_ratios` measures it the same way, on a
short ring); on this 2-core box it moves with the box's load (a call of 9 rows on stories260K: 2.0x
a step when quiet, 2.9x when not), so run it twice, minutes apart. JSON out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import edgeinfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a model folder (default: the bundled model)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,9")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    rows = sorted({1, *(int(r) for r in a.rows.split(","))})
    m = edgeinfer.load(a.model, threads=a.threads, capacity_tokens=a.capacity)
    eng, vocab = m.engine, m.manifest.arch.vocab_size
    a.capacity = m.capacity_tokens
    cache = eng.new_cache(a.capacity, 4)
    if a.context + max(rows) > a.capacity:
        raise SystemExit(f"--context {a.context} and calls of {max(rows)} rows do not fit the ring's {a.capacity} "
                         "slots: give a smaller --context or a larger --capacity")
    eng.prefill(cache, [3 + (j % (vocab - 3)) for j in range(a.context)])  # the context: arbitrary ids
    out = np.empty((1, max(rows), vocab), np.float32)
    times: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(a.rounds):
        for r in rows:
            ids = [3 + (j % (vocab - 3)) for j in range(r)]
            t0 = time.perf_counter()
            eng.forward(cache, ids, all_logits=r > 1, commit=False, out=out)
            times[r].append(time.perf_counter() - t0)
    skip = a.rounds // 10
    med = {r: float(np.median(times[r][skip:])) for r in rows}
    result = {"model": str(m.folder), "context": a.context, "capacity": a.capacity, "threads": a.threads,
              "rounds": a.rounds, "median_us": {r: round(med[r] * 1e6, 1) for r in rows},
              "ratio_to_one_row": {r: round(med[r] / med[1], 3) for r in rows}}
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

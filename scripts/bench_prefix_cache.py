"""Time to first token with the automatic prefix cache: a 512-token prefix, then a new 16-token tail.

    python scripts/bench_prefix_cache.py -m MODEL [--rounds 5] [--prefix 512] [--tail 16] [--out FILE.json]

Each round: a cold request (the model's cache forgotten: `Model.held = None`) on prefix + tail A,
then a warm one on prefix + tail B (the prefix kept, only the tail prefilled), then a cold one on
prefix + tail B (the reference: its tokens must equal the warm one's). Random ids, greedy, 16 new
tokens. Reports the medians of TTFT (`Completion.timings.ttft_ms`) and their ratio. JSON out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

import edgeinfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--tail", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    m = edgeinfer.load(args.model, threads=args.threads, capacity_tokens=args.prefix + args.tail + 64)
    v = m.manifest.arch.vocab_size
    opts = dict(max_new_tokens=16, temperature=0, ignore_eos=True)
    cold, warm, same, cached = [], [], True, []
    for r in range(args.rounds):
        rng = np.random.default_rng(r)
        prefix = [1] + rng.integers(3, v, args.prefix - 1).tolist()
        a, b = (prefix + rng.integers(3, v, args.tail).tolist() for _ in range(2))
        m.held = None
        cold.append(m.generate(a, **opts).timings.ttft_ms)
        w = m.generate(b, **opts)
        warm.append(w.timings.ttft_ms)
        cached.append(w.usage.cached_tokens)
        m.held = None
        same &= m.generate(b, **opts).token_ids == w.token_ids
    row = {"model": args.model, "prefix_tokens": args.prefix, "tail_tokens": args.tail, "rounds": args.rounds,
           "cold_ttft_ms": round(statistics.median(cold), 2), "warm_ttft_ms": round(statistics.median(warm), 2),
           "warm_over_cold": round(statistics.median(warm) / statistics.median(cold), 4),
           "cached_tokens": statistics.median(cached), "identical_tokens": same}
    print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()

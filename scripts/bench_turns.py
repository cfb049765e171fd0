"""A request that decodes beside another's long prefill, on one Engine: how long each takes, against alone.

    python scripts/bench_turns.py -m MODEL [--prompt-tokens 3072] [--steps 32] [--rounds 3]
        [--threads 2] [--out FILE.json]

Two caches of one model. Per round: `--steps` decode steps alone (`Engine.decode_one`, each
followed by a greedy argmax, as sampling would), a prefill of `--prompt-tokens` alone
(`Engine.prefill`, the engine's chunks), then both at once: the prefill in a thread, the steps
starting once its first chunk runs. Reports medians over rounds of each side's wall time alone and
together, and the order of the graph calls in the last round ('P' a prefill chunk, 'd' a step):
the engine's turns (`chunked.ChunkedSteps.give_way`) should let the steps share the engine with
the prefill, not take one step per chunk. JSON out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import edgeinfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="a model folder (default: the bundled model)")
    ap.add_argument("--prompt-tokens", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    m = edgeinfer.load(args.model, threads=args.threads)
    e, vocab = m.engine, m.manifest.arch.vocab_size
    if args.prompt_tokens >= m.capacity_tokens:
        raise SystemExit(f"--prompt-tokens must be under the ring's {m.capacity_tokens} tokens")
    prompt = [3 + i % (vocab - 3) for i in range(args.prompt_tokens)]
    order: list[str] = []
    run = e._forward

    def recorded(cache, ids, *a, **k):
        out = run(cache, ids, *a, **k)
        order.append("d" if len(ids) == 1 else "P")
        return out

    e._forward = recorded

    def steps(cache) -> float:
        t0, token = time.perf_counter(), 7
        for _ in range(args.steps):
            token = int(np.argmax(e.decode_one(cache, token)))
        return time.perf_counter() - t0

    def prefill(cache, started=None) -> float:
        t0 = time.perf_counter()
        e.prefill(cache, prompt, before_chunk=started.set if started else None)
        return time.perf_counter() - t0

    rows = {k: [] for k in ("steps_alone_s", "prefill_alone_s", "steps_beside_s", "prefill_beside_s")}
    for _ in range(args.rounds):
        short = m.new_cache()
        e.prefill(short, [1, 2, 3])
        rows["steps_alone_s"].append(steps(short))
        rows["prefill_alone_s"].append(prefill(m.new_cache()))
        short, long_cache, started, took = m.new_cache(), m.new_cache(), threading.Event(), {}
        e.prefill(short, [1, 2, 3])
        order.clear()
        t = threading.Thread(target=lambda: took.setdefault("p", prefill(long_cache, started)))
        t.start()
        started.wait()
        rows["steps_beside_s"].append(steps(short))
        t.join()
        rows["prefill_beside_s"].append(took["p"])
    out = {"model": args.model or "bundled", "prompt_tokens": args.prompt_tokens, "steps": args.steps,
           "rounds": args.rounds, **{k: round(statistics.median(v), 4) for k, v in rows.items()},
           "calls_last_round": "".join(order)}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

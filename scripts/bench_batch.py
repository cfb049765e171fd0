"""Continuous batching in process: one batched decode step vs single steps, and B threads through the
`DecodeBatcher` vs one (JSON out). Needs a model whose KV mode appends in place (GroupQueryAttention).

    python scripts/bench_batch.py -m MODEL [--threads 2] [--rounds 5] [--out FILE]

1. step: for B = 2 and 4 rings of 32 tokens, 20 `Engine.decode_batch` steps vs 20 x B `decode_one`
   steps, alternating, median of rounds: tokens/s of each and the ratio.
2. streams: 4 threads each running a greedy `Generation` of 128 tokens (prompts of 32..56 tokens)
   through one DecodeBatcher vs 1 thread, alternating rounds (the first a warm-up): aggregate tokens/s.
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
from edgeinfer.batching import DecodeBatcher
from edgeinfer.generation import Generation
from edgeinfer.kv_cache import BatchedKV, max_capacity
from edgeinfer.manifest import read_manifest


def step_speed(m, batch: int, rounds: int) -> dict:
    eng, spec = m.engine, m.manifest.arch
    rng = np.random.default_rng(0)
    kv = BatchedKV(spec, batch, m.capacity_tokens, 4, eng.max_chunk, eng.mode)
    for c in kv.caches:
        eng.prefill(c, [1] + rng.integers(3, spec.vocab_size, 31).tolist())
    batched, single = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(20):
            eng.decode_batch(kv, {b: 5 for b in range(batch)})
        batched.append(20 * batch / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(20):
            for c in kv.caches:
                eng.decode_one(c, 5)
        single.append(20 * batch / (time.perf_counter() - t0))
    b, s = statistics.median(batched), statistics.median(single)
    return {"batched_tok_s": round(b, 1), "single_steps_tok_s": round(s, 1), "ratio": round(b / s, 3)}


def streams(m, rounds: int) -> dict:
    eng = m.engine
    rng = np.random.default_rng(0)
    base = [1] + rng.integers(3, m.manifest.arch.vocab_size, 100).tolist()
    opts = edgeinfer.GenerationOptions.from_kwargs(max_new_tokens=128, temperature=0, ignore_eos=True)
    kv = BatchedKV(m.manifest.arch, 4, m.capacity_tokens, 4, eng.max_chunk, eng.mode)
    batcher = DecodeBatcher(eng, kv)

    def run(i: int) -> None:
        ids, cache = base[:32 + 8 * i], kv.caches[i]
        Generation(eng, m.tokenizer, cache, opts, "shift", begin=lambda req: (cache.reset(), ids)[1],
                   stepper=batcher).run_to_end()

    def aggregate(n: int) -> float:
        t0 = time.perf_counter()
        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return n * 128 / (time.perf_counter() - t0)

    one, four = [], []
    for r in range(rounds + 1):
        a, b = aggregate(1), aggregate(4)
        if r:
            one.append(a)
            four.append(b)
    return {"one_stream_tok_s": round(statistics.median(one), 1), "four_streams_tok_s": round(statistics.median(four), 1),
            "ratio": round(statistics.median(f / o for f, o in zip(four, one)), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    trained = read_manifest(Path(a.model)).arch.max_position_embeddings
    m = edgeinfer.load(a.model, threads=a.threads, capacity_tokens=min(512, max_capacity(trained)))
    if not m.engine.mode.in_place:
        raise SystemExit(f"{a.model}: its KV mode ({m.engine.mode.name}) does not batch; use a GQA model")
    report = {"model": a.model, "threads": a.threads, "rounds": a.rounds,
              "step_b2": step_speed(m, 2, a.rounds), "step_b4": step_speed(m, 4, a.rounds),
              "streams_4_vs_1": streams(m, a.rounds)}
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

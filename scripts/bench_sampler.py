"""Sampler speed: microseconds per call, C extension vs numpy twin (JSON out).

    python scripts/bench_sampler.py [--vocab 32000 152000] [--calls 300] [--model DIR] [--out FILE]

Settings: "default" = top-k 40, top-p 0.95, min-p 0.05, temperature 0.8, repetition penalty 1.1
over 64 ids; "full_top_p" = top-k 0, top-p 0.95 (every token a candidate). Logits are random
normal (std 3). With --model (an edgeinfer folder), also times one decode step of that model
(2 threads, 64 cached tokens) and reports sampling as a share of it. Medians; one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from edgeinfer.sampling import BACKEND, Sampler, SamplingParams, reference
from edgeinfer.sampling.rng import Rng

SETTINGS = {
    "default": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                              penalty_last_n=64),
    "full_top_p": SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
}


def median_us(fn, calls: int) -> float:
    for _ in range(min(20, calls)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def decode_step_us(model: Path, calls: int) -> tuple[float, int]:
    """Median time of one decode step (the Engine's graph call) with 64 cached tokens."""
    from edgeinfer.engine import Engine
    from edgeinfer.session import DecoderSession

    eng = Engine(DecoderSession(model, threads=2), max_chunk=64)
    rng = np.random.default_rng(0)
    cache = eng.new_cache(64 + calls + 8, 0)
    eng.prefill(cache, rng.integers(3, eng.spec.vocab_size, 64).tolist())
    token = int(rng.integers(3, eng.spec.vocab_size))
    return median_us(lambda: eng.decode_one(cache, token), calls), eng.spec.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 152000])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--numpy-calls", type=int, default=15)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for vocab in args.vocab:
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        history = rng.integers(0, vocab, 64)
        for name, params in SETTINGS.items():
            c_us = median_us(lambda s=Sampler(params, 1): s.sample(logits, history), args.calls)
            r = Rng(1)
            np_us = median_us(lambda: reference.sample(logits, params, history, r), args.numpy_calls)
            rows.append({"vocab": vocab, "setting": name, "c_us": round(c_us, 1), "numpy_us": round(np_us, 1),
                         "speedup": round(np_us / c_us, 1)})
    result = {"backend": BACKEND, "results": rows}
    if args.model:
        step_us, vocab = decode_step_us(args.model, args.calls)
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        history = rng.integers(0, vocab, 64)
        s_us = median_us(lambda s=Sampler(SETTINGS["default"], 1): s.sample(logits, history), args.calls)
        result["decode_step"] = {"model": str(args.model), "vocab": vocab, "decode_step_us": round(step_us, 1),
                                 "sample_default_us": round(s_us, 1),
                                 "sampling_share_pct": round(100 * s_us / step_us, 2)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

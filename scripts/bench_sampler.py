"""Sampler speed: microseconds per generated token, C extension vs numpy twin (JSON out).

    python scripts/bench_sampler.py [--vocab 32000 152000] [--calls 300] [--rounds 5] [--model DIR]
                                    [--baseline MODULE] [--out FILE]

Per token = what the generation loop does: `token = sampler.sample(logits)`, then
`sampler.accept(token)`, starting from a 64-id prompt as the history. Settings: "default" = top-k 40,
top-p 0.95, min-p 0.05, temperature 0.8, repetition penalty 1.1 over 64 ids; "penalties" = the same
plus frequency 0.5 and presence 0.5; "no_penalties" = the same filters, no penalty (accept is then
nearly free: `accept_ns`, timed alone); "full_top_p" = top-k 0, top-p 0.95 (every token a candidate);
"greedy" = temperature 0, nothing else (the C sampler's float32 argmax path).
Logits are random normal (std 3), the same for every token.

--baseline MODULE: also time an older copy of `edgeinfer.sampling` importable under that name, side
by side in this process (rounds alternate between the two). If its Sampler has no `accept`, it is the
API from before the sampler owned its history: the caller keeps a PenaltyWindow and passes
`window.view()` to every `sample(logits, history)`, as generation.run did. Make such a copy with
`cp -r <old checkout>/edgeinfer/sampling DIR/old_sampling && sed -i 's/edgeinfer\\.sampling/old_sampling/g'
DIR/old_sampling/*.py` (its built extension included) and run with PYTHONPATH=DIR.

With --model (an edgeinfer folder), also times one decode step of that model (2 threads, 64 cached
tokens) and reports sampling as a share of it. Medians; one process.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import numpy as np

from edgeinfer.sampling import BACKEND, Sampler, SamplingParams, reference
from edgeinfer.sampling.penalties import PenaltyWindow
from edgeinfer.sampling.rng import Rng

FILTERS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
SETTINGS = {
    "default": SamplingParams(**FILTERS, repetition_penalty=1.1, penalty_last_n=64),
    "penalties": SamplingParams(**FILTERS, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                                penalty_last_n=64),
    "no_penalties": SamplingParams(**FILTERS),
    "full_top_p": SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    "greedy": SamplingParams(temperature=0.0),
}


def timings(fn, calls: int) -> list[float]:
    """Seconds of each of `calls` calls of fn."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median_us(fn, calls: int) -> float:
    timings(fn, min(20, calls))
    return statistics.median(timings(fn, calls)) * 1e6


def per_call_ns(fn, batch: int = 20000, repeats: int = 5) -> float:
    """Median over `repeats` batches of the mean time of one call (for calls too short to time singly)."""
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        means.append((time.perf_counter() - t0) / batch)
    return statistics.median(means) * 1e9


def token_step(module, params: SamplingParams, logits: np.ndarray, prompt: list[int]):
    """One generated token with `module`'s Sampler: draw, then hand the token to the history."""
    if hasattr(module.Sampler, "accept"):
        s = module.Sampler(params, 1, prompt)
        return lambda: s.accept(s.sample(logits))
    window = PenaltyWindow(params.penalty_last_n if params.has_penalties else 0, prompt)  # the caller's window
    s = module.Sampler(params, 1)
    return lambda: window.push(s.sample(logits, window.view()))


def side_by_side(steps: dict, calls: int, rounds: int) -> dict[str, float]:
    """Median µs per call of each step, the steps alternating in `rounds` rounds of `calls` calls."""
    for fn in steps.values():
        timings(fn, min(20, calls))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name] += timings(fn, calls)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


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
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of --calls tokens (with --baseline)")
    ap.add_argument("--numpy-calls", type=int, default=15)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--baseline", default=None, help="an older edgeinfer.sampling, importable under this name")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    current = importlib.import_module("edgeinfer.sampling")
    base = importlib.import_module(args.baseline) if args.baseline else None
    rng = np.random.default_rng(0)
    rows = []
    for vocab in args.vocab:
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        prompt = rng.integers(0, vocab, 64).tolist()
        for name, params in SETTINGS.items():
            steps = {"c": token_step(current, params, logits, prompt)}
            if base is not None:
                steps["baseline"] = token_step(base, params, logits, prompt)
            us = side_by_side(steps, args.calls, args.rounds if base is not None else 1)
            s = Sampler(params, 1, prompt)
            accept_ns = per_call_ns(lambda: s.accept(5))
            r, window = Rng(1), PenaltyWindow(params.penalty_last_n if params.has_penalties else 0, prompt)
            np_us = median_us(lambda: window.push(reference.sample(logits, params, window.view(), r)),
                              args.numpy_calls)
            row = {"vocab": vocab, "setting": name, "c_us": round(us["c"], 1), "accept_ns": round(accept_ns),
                   "numpy_us": round(np_us, 1), "speedup": round(np_us / us["c"], 1)}
            if base is not None:
                row.update(baseline_us=round(us["baseline"], 1), vs_baseline=round(us["c"] / us["baseline"], 3))
            rows.append(row)
    result = {"backend": BACKEND, "baseline": args.baseline, "results": rows}
    if args.model:
        step_us, vocab = decode_step_us(args.model, args.calls)
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        prompt = rng.integers(0, vocab, 64).tolist()
        s_us = median_us(token_step(current, SETTINGS["default"], logits, prompt), args.calls)
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

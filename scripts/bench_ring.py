"""The ring-buffer KV cache under load: constant memory, constant speed, cost set by valid tokens.

    python scripts/bench_ring.py [-m MODEL] [--tokens 5000] [--capacity 128] [--threads 2] [--out FILE]

1. Streams `--tokens` sampled tokens (EOS ignored) through a ring of `--capacity` slots with 4
   sinks; records resident memory (psutil) after token 1,000 and after the last token, and decode
   speed over tokens 1,001-2,000 against the last 1,000.
2. With 32 valid tokens, times a decode step (median of 200) with capacity 4,096 and with 256.
JSON out. No -m: the bundled model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import psutil

import edgeinfer
from edgeinfer.bench import prompt_ids


def ring_run(model: Path | None, tokens: int, capacity: int, threads: int) -> dict:
    m = edgeinfer.load(model, threads=threads, capacity_tokens=capacity, n_sink=4)
    proc = psutil.Process()
    stamps, rss = [], {}
    for i, _ in enumerate(m.stream("Once upon a time" if model is None else [1, 3, 4, 5], max_new_tokens=tokens,
                                   ignore_eos=True, seed=1, temperature=0.8), start=1):
        stamps.append(time.perf_counter())
        if i in (1000, tokens):
            rss[i] = proc.memory_info().rss
    assert len(stamps) == tokens, len(stamps)

    def tok_s(a: int, b: int) -> float:  # tokens a..b, 1-based
        return (b - a) / (stamps[b - 1] - stamps[a - 1])

    early, late = tok_s(1001, 2000), tok_s(tokens - 999, tokens)
    return {"model": str(m.folder), "capacity_tokens": capacity, "n_sink": 4, "tokens": tokens,
            "rss_mb_after_1000": round(rss[1000] / 2**20, 2), "rss_mb_after_last": round(rss[tokens] / 2**20, 2),
            "rss_growth_mb": round((rss[tokens] - rss[1000]) / 2**20, 3),
            "decode_tok_s_1001_2000": round(early, 1), "decode_tok_s_last_1000": round(late, 1),
            "late_over_early": round(late / early, 3), "ring_dropped_tokens": m.cache.dropped}


def step_ms(model: Path | None, capacity: int, threads: int, valid: int = 32, steps: int = 200) -> float:
    m = edgeinfer.load(model, threads=threads, capacity_tokens=capacity)
    ids = prompt_ids(m.manifest.arch.vocab_size, m.tokenizer.bos_id, valid - 1, 0)
    times = []
    for _ in range(steps):
        m.cache.reset()
        m.engine.prefill(m.cache, ids)
        t0 = time.perf_counter()
        m.engine.decode_one(m.cache, 5)  # the 32nd valid token
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--capacity", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.tokens < 2000:  # the early window is tokens 1,001-2,000 (below that, an IndexError)
        ap.error("--tokens must be at least 2000 (speed is compared over tokens 1,001-2,000 and the last 1,000)")
    result = {"ring": ring_run(a.model, a.tokens, a.capacity, a.threads)}
    big_cap = min(4096, edgeinfer.load(a.model).capacity_tokens)  # its default ring: within the trained length
    small_cap = min(256, big_cap)
    small, big = step_ms(a.model, small_cap, a.threads), step_ms(a.model, big_cap, a.threads)
    result["valid_32"] = {f"step_ms_capacity_{small_cap}": round(small, 3), f"step_ms_capacity_{big_cap}": round(big, 3),
                          f"ratio_{big_cap}_over_{small_cap}": round(big / small, 3)}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

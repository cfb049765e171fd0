"""`edgeinfer bench`: load time, time to first token, prefill and decode speed, memory, CPU cost.

Method: load the model once (timed), then `runs` times: a fresh cache, the same random prompt
ids (seeded, BOS first), greedy generation of `gen_tokens` tokens with EOS ignored. Speeds are
reported as median, min and max over the runs; the result names the model folder (absolute) and
the versions that ran it (`versions`). peak_rss_mb is the process's peak resident set (in
MiB); cpu_s_per_token is the process's CPU seconds (every thread's, `time.process_time`, to the
microsecond) of the whole generation divided by tokens generated.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer.errors import InvalidArgumentError

MAX_PROMPT_TOKENS = 1 << 20  # a million tokens: hours on a device, and an id array of 8 MB
MAX_RUNS = 1000  # medians of more are no truer on a noisy device


@dataclass(frozen=True)
class BenchConfig:
    model: Path | None = None
    prompt_tokens: int = 512
    gen_tokens: int = 128
    threads: int = 2
    runs: int = 3
    capacity: int | None = None
    seed: int = 0


def prompt_ids(vocab_size: int, bos_id: int | None, n: int, seed: int) -> list[int]:
    """The benchmark prompt: BOS then n-1 uniform random ids in [3, vocab): same for every engine."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab_size, n).tolist()
    if bos_id is not None:
        ids[0] = int(bos_id)
    return ids


def _stats(values: list[float], digits: int = 3) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def versions() -> dict:
    """What measured: edgeinfer's, ONNX Runtime's and Python's versions (a saved result says them)."""
    import platform

    import onnxruntime

    from edgeinfer import __version__
    return {"edgeinfer": __version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}


def peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / 1024 if sys.platform != "darwin" else kb / 2**20, 1)


def run_bench(cfg: BenchConfig, progress=None) -> dict:
    import edgeinfer

    if cfg.prompt_tokens < 1 or cfg.gen_tokens < 2 or cfg.runs < 1 or cfg.threads < 1:
        raise InvalidArgumentError("--prompt-tokens >= 1, --gen-tokens >= 2, --runs >= 1 and --threads >= 1 "
                                   "are required")
    if cfg.prompt_tokens > MAX_PROMPT_TOKENS or cfg.gen_tokens > MAX_PROMPT_TOKENS:  # an array of ids is made
        raise InvalidArgumentError(f"--prompt-tokens and --gen-tokens may be at most {MAX_PROMPT_TOKENS}")
    if cfg.runs > MAX_RUNS:  # 10**23 ran for ever (a hostile round)
        raise InvalidArgumentError(f"--runs may be at most {MAX_RUNS}")
    if cfg.capacity is not None and cfg.capacity < 2:  # 0 read as "not given"
        raise InvalidArgumentError(f"--capacity must be at least 2, got {cfg.capacity}")
    from edgeinfer.kv_cache import max_capacity
    from edgeinfer.manifest import read_manifest
    from edgeinfer.model import default_model_path
    from edgeinfer.overflow import resolve_capacity, resolve_sinks

    manifest = read_manifest(Path(cfg.model) if cfg.model is not None else default_model_path())
    sinks = resolve_sinks(manifest.arch, None)
    if cfg.capacity is not None and cfg.capacity <= sinks:  # (load's message offers fewer sinks: not a bench flag)
        raise InvalidArgumentError(f"--capacity must be at least {sinks + 1}: the ring keeps {sinks} attention sinks "
                                   f"beside the tokens it holds, got {cfg.capacity}")
    capacity = cfg.capacity or cfg.prompt_tokens + cfg.gen_tokens + 8
    if cfg.capacity is None:
        # the largest ring that re-bases seldom (or a sliding window's W - 1): load's rule on no smaller default
        limit = resolve_capacity(max_capacity(manifest.arch.max_position_embeddings), manifest.arch, None)
        portable = manifest.portable
        if portable is not None and capacity > portable.capacity_tokens:  # fixed at convert: say which sizes fit
            n, limit = portable.capacity_tokens, min(limit, portable.capacity_tokens)
            fit = f"--prompt-tokens + --gen-tokens up to {limit - 8}, or " if limit - 8 >= 3 else ""
            raise InvalidArgumentError(f"this portable model holds {n} tokens, and the benchmark's ring would be "
                                       f"--prompt-tokens {cfg.prompt_tokens} + --gen-tokens {cfg.gen_tokens} + 8 = "
                                       f"{capacity}: give {fit}--capacity {limit} (the prompt then shifts through "
                                       f"the ring)")
        if capacity > limit:  # the largest ring the model holds without re-basing often (given, not load's default,
            capacity = limit  # which a device profile may cap further), through which the prompt shifts
    t0 = time.perf_counter()
    model = edgeinfer.load(cfg.model, threads=cfg.threads, capacity_tokens=capacity)
    capacity = model.capacity_tokens
    load_s = time.perf_counter() - t0
    spec = model.manifest.arch
    ids = prompt_ids(spec.vocab_size, model.tokenizer.bos_id, cfg.prompt_tokens, cfg.seed)
    ttft, prefill, decode, cpu = [], [], [], []
    for i in range(cfg.runs):
        if progress:
            progress(i, cfg.runs)
        model.held = None  # a cold prompt every run: the prefix cache would reuse the last run's
        c0 = time.process_time()  # os.times() ticks every 10 ms: the bundled model's tokens read 0.0 ms
        c = model.generate(ids, max_new_tokens=cfg.gen_tokens, temperature=0, ignore_eos=True)
        c1 = time.process_time()
        ttft.append(c.timings.ttft_ms)
        prefill.append(c.timings.prefill_tok_s)
        decode.append(c.timings.decode_tok_s)
        cpu.append((c1 - c0) / len(c.token_ids))
    return {
        "model": os.path.abspath(model.folder), "versions": versions(),
        "quantization": model.manifest.quantization.weights,
        "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens, "threads": cfg.threads, "runs": cfg.runs,
        "capacity_tokens": capacity,
        "load_s": round(load_s, 3), "ttft_ms": _stats(ttft), "prefill_tok_s": _stats(prefill),
        "decode_tok_s": _stats(decode), "peak_rss_mb": peak_rss_mb(), "cpu_s_per_token": _stats(cpu, 7),
    }

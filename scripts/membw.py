"""Memory read bandwidth of this machine, and the decode speed it allows a model (JSON out).

    python scripts/membw.py [--threads 2] [--mb 1024] [MODEL_DIR ...]

Bandwidth: `threads` threads each summing its part of a `mb` MB buffer (numpy releases the GIL),
median of 5 passes. For each model folder, every weight byte is read once per generated token
(the tied int4/int8 matrix is read whole as the lm_head), so the ceiling is
bandwidth / bytes(model.onnx.data) tokens per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np


def read_bandwidth_gb_s(threads: int, mb: int) -> float:
    buf = np.ones(mb * 2**20 // 8, np.float64)
    parts = np.array_split(buf, threads)
    times = []
    for _ in range(5):
        out = [0.0] * threads

        def work(i: int) -> None:
            out[i] = float(np.add.reduce(parts[i]))

        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        times.append(time.perf_counter() - t0)
    return buf.nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=int, default=1024)
    a = ap.parse_args()
    bw = read_bandwidth_gb_s(a.threads, a.mb)
    res = {"read_bandwidth_gb_s": round(bw, 2), "threads": a.threads, "models": {}}
    for m in a.models:
        b = (m / "model.onnx.data").stat().st_size
        res["models"][str(m)] = {"weight_bytes": b, "ceiling_tok_s": round(bw * 1e9 / b, 1)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

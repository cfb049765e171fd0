"""How ONNX Runtime's CPU MatMulNBits runs the ways a GGUF block can be expressed (one decode row).

    python scripts/bench_kept_blocks.py [--rounds 5] [--threads 2] [--json OUT]

One node per case, N x K weights of block 32, x of one row; median ms per call over `--rounds`
rounds of 200 calls, the cases interleaved round by round (the machine is noisy). The cases:
4-bit with the default zero point (Q4_0), 4-bit with float zero points (Q4_1 the direct way), the
same as 4-bit plus a block-sum offset MatMul (Q4_1 as converters/kept_graph.py builds it), 8-bit
(Q8_0) and 8-bit as two 4-bit packs + offset, each at accuracy level 0 and 4. This is why
`gguf_blocks.packs` avoids float zero points and, below level 4, 8-bit kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper

SHAPES = {"gate_up 3072x576": (3072, 576), "lm_head 49152x576": (49152, 576)}


def model(n: int, k: int, case: str, level: int):
    rng = np.random.default_rng(0)
    nb = k // 32
    inits, nodes = [], []

    def mm(name: str, bits: int, zp: bool) -> str:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (n, nb, 32 * bits // 8)).astype(np.uint8), f"{name}.q"))
        inits.append(numpy_helper.from_array((rng.random((n, nb)) * 0.01).astype(np.float32), f"{name}.s"))
        ins = ["x", f"{name}.q", f"{name}.s"]
        if zp:
            inits.append(numpy_helper.from_array(np.full((n, nb), 7.3, np.float32), f"{name}.zp"))
            ins.append(f"{name}.zp")
        nodes.append(helper.make_node("MatMulNBits", ins, [f"{name}.y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                      block_size=32, accuracy_level=level))
        return f"{name}.y"

    def offset(y: str) -> str:
        inits.append(numpy_helper.from_array(np.array([0, 0, nb, 32], np.int64), "blocks"))
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
        inits.append(numpy_helper.from_array(rng.random((nb, n)).astype(np.float32), "off"))
        nodes.extend([helper.make_node("Reshape", ["x", "blocks"], ["xb"]),
                      helper.make_node("ReduceSum", ["xb", "axes"], ["sums"], keepdims=0),
                      helper.make_node("MatMul", ["sums", "off"], ["extra"]),
                      helper.make_node("Add", [y, "extra"], ["y_off"])])
        return "y_off"

    if case == "4-bit":
        y = mm("a", 4, False)
    elif case == "4-bit float zp":
        y = mm("a", 4, True)
    elif case == "4-bit + offset":
        y = offset(mm("a", 4, False))
    elif case == "8-bit":
        y = mm("a", 8, False)
    else:  # "8-bit as 2x4-bit + offset"
        a, b = mm("a", 4, False), mm("b", 4, False)
        nodes.append(helper.make_node("Add", [a, b], ["ab"]))
        y = offset("ab")
    nodes.append(helper.make_node("Identity", [y], ["y"]))
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", 1, [1, 1, k])],
                          [helper.make_tensor_value_info("y", 1, [1, 1, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cases = ["4-bit", "4-bit float zp", "4-bit + offset", "8-bit", "8-bit as 2x4-bit + offset"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    sessions = {(s, c, lv): ort.InferenceSession(model(*SHAPES[s], c, lv).SerializeToString(), so,
                                                 providers=["CPUExecutionProvider"])
                for s in SHAPES for c in cases for lv in (0, 4)}
    times: dict = {key: [] for key in sessions}
    for _ in range(a.rounds):
        for (s, c, lv), sess in sessions.items():
            x = {"x": np.random.default_rng(1).standard_normal((1, 1, SHAPES[s][1])).astype(np.float32)}
            calls = a.calls if "lm_head" not in s or not (c == "8-bit" and lv == 0) else max(a.calls // 20, 5)
            sess.run(None, x)
            t = time.perf_counter()
            for _ in range(calls):
                sess.run(None, x)
            times[(s, c, lv)].append((time.perf_counter() - t) / calls * 1e3)
    rows = [{"shape": s, "case": c, "accuracy_level": lv, "median_ms": round(statistics.median(v), 4)}
            for (s, c, lv), v in times.items()]
    for r in rows:
        print(f"{r['shape']:18} {r['case']:28} level {r['accuracy_level']}  {r['median_ms']:9.3f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"onnxruntime": ort.__version__, "threads": a.threads, "rounds": a.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

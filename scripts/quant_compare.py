"""Size against perplexity: our int4/int8 recipes and llama.cpp's quantizer on the same float weights,
same text, same ids, same perplexity definition, in one run (issue 14's side-by-side).

    python scripts/quant_compare.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --text ../shared/models/SmolLM2-135M-Instruct/eval.txt --reference 33.0909 \
        --llama-python /work/llamavenv/bin/python --out docs/benchmarks/quant-smollm2

The float weights are the GGUF's, dequantized: ours converts it with `--quant int4|int8` and a
recipe (re-quantizing those floats); llama.cpp re-exports it at F32 (llama_model_quantize with
allow_requantize) and quantizes that to each type. Perplexity is `edgeinfer eval`'s (prefill path,
each line [BOS] + its tokens) for ours and scripts/peer_perplexity_llamacpp.py's on the same ids for
llama.cpp. Sizes are the model files (ours: model.onnx + model.onnx.data; llama.cpp: the .gguf).
Writes OUT.json, OUT.md and OUT.png (size in MB against perplexity above the reference, in %).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OURS = [  # label, default_scheme arguments
    ("int4 gptq (default)", dict(quant="int4")),
    ("int4 asym", dict(quant="int4", recipe="asym")),
    ("int4 rtn", dict(quant="int4", recipe="rtn")),
    ("int4 mse", dict(quant="int4", recipe="mse")),
    ("int4 q4_1", dict(quant="int4", recipe="q4_1")),
    ("int4 gptq, int8 embedding", dict(quant="int4", embedding="int8")),
    ("int4 asym, int8 embedding", dict(quant="int4", recipe="asym", embedding="int8")),
    ("int4 rtn, int8 embedding", dict(quant="int4", recipe="rtn", embedding="int8")),
    ("int4 q4_1, int8 embedding", dict(quant="int4", recipe="q4_1", embedding="int8")),
    ("int8", dict(quant="int8")),
]
LLAMA = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_M": 17}

LLAMA_CHILD = r"""
import ctypes, json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import llama_cpp
from peer_perplexity_llamacpp import perplexity
src, work, ids_file, types = sys.argv[2], Path(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
stories = json.loads(Path(ids_file).read_text())
def quantize(a, b, ftype):
    p = llama_cpp.llama_model_quantize_default_params(); p.ftype = ftype; p.nthread = 2; p.allow_requantize = True
    if llama_cpp.llama_model_quantize(a.encode(), b.encode(), ctypes.byref(p)):
        raise SystemExit(f"llama_model_quantize {ftype} failed")
f32 = str(work / "f32.gguf")
quantize(src, f32, 0)
for name, ftype in types.items():
    path = work / f"{name}.gguf"
    quantize(f32, str(path), ftype)
    r = perplexity(llama_cpp, path, stories, 512)
    print(json.dumps({"engine": "llama.cpp " + llama_cpp.__version__, "label": "llama.cpp " + name,
                      "perplexity": r["perplexity"], "bytes": path.stat().st_size}), flush=True)
    path.unlink()
"""


def ours(gguf: Path, text: Path, work: Path) -> list[dict]:
    from edgeinfer.converters import convert, default_scheme
    from edgeinfer.evaluate import perplexity

    rows = []
    for label, kw in OURS:
        dst = work / label.replace(" ", "_").replace(",", "")
        quant = kw.pop("quant")
        convert(gguf, dst, scheme=default_scheme(quant, **kw))
        kw["quant"] = quant
        size = sum(p.stat().st_size for p in dst.iterdir() if p.name.startswith("model.onnx"))
        rows.append({"engine": "edgeinfer", "label": label, "perplexity": perplexity(dst, text).perplexity,
                     "bytes": size})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def chart(rows: list[dict], reference: float, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine, marker in (("edgeinfer", "o"), ("llama.cpp", "s")):
        pts = [r for r in rows if r["engine"].startswith(engine)]
        ax.scatter([r["bytes"] / 1e6 for r in pts], [(r["perplexity"] / reference - 1) * 100 for r in pts],
                   marker=marker, label=engine)
        for r in pts:
            ax.annotate(r["label"].replace("llama.cpp ", ""), (r["bytes"] / 1e6, (r["perplexity"] / reference - 1) * 100),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("model size (MB)")
    ax.set_ylabel("perplexity above float32 (%)")
    ax.axhline(5, linestyle=":", linewidth=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True, help="the model (its weights dequantized are the floats)")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--reference", type=float, required=True, help="float32 perplexity on --text")
    ap.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (skipped without)")
    ap.add_argument("--out", type=Path, required=True, help="prefix of OUT.json, OUT.md, OUT.png")
    a = ap.parse_args()
    failed = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = ours(a.gguf, a.text, work)
        if a.llama_python:
            from edgeinfer import load

            model = load(work / OURS[0][0].replace(" ", "_").replace(",", ""))
            stories = [model.tokenizer.encode(line, add_bos=True) for line in a.text.read_text().splitlines()
                       if line.strip()]
            (work / "ids.json").write_text(json.dumps(stories))
            scripts = str(Path(__file__).resolve().parent)
            out = subprocess.run([a.llama_python, "-c", LLAMA_CHILD, scripts, str(a.gguf), str(work),
                                  str(work / "ids.json"), json.dumps(LLAMA)], capture_output=True, text=True)
            rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                failed = f"llama.cpp's rows are missing: its child ({a.llama_python}) failed, above"
    for r in rows:
        r["above_reference_pct"] = round((r["perplexity"] / a.reference - 1) * 100, 3)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"gguf": a.gguf.name, "text": a.text.name,
                                                      "reference": a.reference, "rows": rows}, indent=1))
    lines = ["| engine | recipe | size (MB) | perplexity | above float32 |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["bytes"]):
        lines.append(f"| {r['engine']} | {r['label']} | {r['bytes'] / 1e6:.1f} | {r['perplexity']:.4f} | "
                     f"{r['above_reference_pct']:+.2f} % |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if chart(rows, a.reference, a.out.with_suffix(".png")):
        print(f"chart: {a.out.with_suffix('.png')}")
    else:
        print("no chart: matplotlib is not installed", file=sys.stderr)
    if failed:  # (the table went out without them, and the exit was 0: a scripts round)
        raise SystemExit(failed)


if __name__ == "__main__":
    main()

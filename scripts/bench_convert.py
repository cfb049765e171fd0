"""Conversion side by side: edgeinfer convert vs ONNX Runtime GenAI's model builder (JSON out).

    python scripts/bench_convert.py SRC [--runs 2] [--out results/convert.json]

Both convert SRC at int4 block 32 for CPU, alternating A B A B, each in its own process; the
figures are wall time, peak RSS of the converting process (getrusage in that process) and the
size of the graph + weights files. The builder is optional: skipped with a note if not installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAP = ("import resource, runpy, sys, json; sys.argv = {argv!r}; code = 0\n"
        "try:\n    runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code or 0\n"
        "sys.stderr.write('\\nMAXRSS_KB ' + str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) + '\\n')\n"
        "sys.exit(code)\n")


def run(module: str, argv: list[str]) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WRAP.format(argv=[module, *argv], module=module)],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{module} failed:\n{p.stderr[-2000:]}")
    rss = int(p.stderr.rsplit("MAXRSS_KB ", 1)[1].split()[0])
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(rss / 1024, 1)}


def model_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    try:
        import onnxruntime_genai  # noqa: F401
        have_genai = True
    except ImportError:
        have_genai = False
        print("note: onnxruntime-genai not installed; builder skipped", file=sys.stderr)
    source_bytes = sum(f.stat().st_size for f in args.src.glob("*.safetensors"))
    results: dict[str, list[dict]] = {"edgeinfer": [], "ort_genai_builder": []}
    with tempfile.TemporaryDirectory(dir=args.src.parent) as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"ours{i}"
            r = run("edgeinfer", ["convert", str(args.src), "-o", str(out), "--quant", "int4", "--block-size", "32", "-q"])
            results["edgeinfer"].append({**r, "model_bytes": model_bytes(out)})
            if have_genai:
                out = Path(tmp) / f"genai{i}"
                r = run("onnxruntime_genai.models.builder", ["-i", str(args.src), "-o", str(out), "-p", "int4",
                                                              "-e", "cpu", "-c", str(Path(tmp) / "cache")])
                results["ort_genai_builder"].append({**r, "model_bytes": model_bytes(out)})
    summary = {"source_safetensors_bytes": source_bytes, "runs": args.runs}
    for name, rs in results.items():
        if rs:
            summary[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    if results["ort_genai_builder"]:
        a, b = summary["edgeinfer"], summary["ort_genai_builder"]
        summary["ratios_edgeinfer_over_builder"] = {k: round(a[k] / b[k], 3) for k in a}
    summary["edgeinfer_rss_over_source"] = round(summary["edgeinfer"]["peak_rss_mb"] * 2**20 / source_bytes, 3)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

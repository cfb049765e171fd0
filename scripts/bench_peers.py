"""Side-by-side benchmark: edgeinfer vs ONNX Runtime GenAI vs llama.cpp on the same synthetic models.

    python scripts/bench_peers.py --shape small medium --work /tmp/peers --out results \
        [--runs 2] [--threads 2] [--prompt-tokens 512] [--gen-tokens 128] [--llama-convert convert_hf_to_gguf.py]

For each shape: make the synthetic Hugging Face model (scripts/make_synthetic_model.py), convert it
with our converter (int4 block 32, int8), with ONNX Runtime GenAI's builder (int4 block 32 accuracy
level 4, int8) and, when llama-cpp-python is installed and llama.cpp's convert_hf_to_gguf.py is
given, to GGUF Q4_0 and Q8_0. Every engine runs in its own process, engines alternating A B A B,
with the same random prompt ids (BOS first), the same threads, greedy, EOS ignored. Reported per
engine (medians over runs): load_s, ttft_ms, decode_tok_s, start_to_first_token_s (process spawn
to first token), peak_rss_mb; ratios are edgeinfer / peer at the same bits. Writes peers.json,
peers.md and peers.png (matplotlib, if installed) into --out. A missing peer is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUANTS = ("int4", "int8")
GGUF = {"int4": "Q4_0", "int8": "Q8_0"}


# ---------------------------------------------------------------- child: one engine, one run

def _ids(vocab: int, n: int, seed: int) -> list[int]:
    sys.path.insert(0, str(ROOT))
    from edgeinfer.bench import prompt_ids

    return prompt_ids(vocab, 1, n, seed)


def child_edgeinfer(a) -> dict:
    import edgeinfer

    t = time.perf_counter()
    m = edgeinfer.load(a.model, threads=a.threads, capacity_tokens=a.prompt_tokens + a.gen_tokens + 8)
    load_s = time.perf_counter() - t
    first = {}
    it = m.stream(_ids(m.manifest.arch.vocab_size, a.prompt_tokens, a.seed), max_new_tokens=a.gen_tokens,
                  temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    n = 0
    for _ in it:
        n += 1
        if n == 1:
            first = {"t": time.perf_counter(), "wall": time.time()}
    t_end = time.perf_counter()
    return {"load_s": load_s, "ttft_ms": (first["t"] - t0) * 1e3,
            "decode_tok_s": (n - 1) / (t_end - first["t"]), "first_wall": first["wall"], "tokens": n}


def child_genai(a) -> dict:
    import onnxruntime_genai as og

    t = time.perf_counter()
    model = og.Model(str(a.model))
    load_s = time.perf_counter() - t
    vocab = json.loads((Path(a.model) / "genai_config.json").read_text())["model"]["vocab_size"]
    ids = _ids(vocab, a.prompt_tokens, a.seed)
    params = og.GeneratorParams(model)
    total = a.prompt_tokens + a.gen_tokens
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()
    t_first, wall = time.perf_counter(), time.time()
    n = 1
    while n < a.gen_tokens and not gen.is_done():
        gen.generate_next_token()
        n += 1
    t_end = time.perf_counter()
    return {"load_s": load_s, "ttft_ms": (t_first - t0) * 1e3, "decode_tok_s": (n - 1) / (t_end - t_first),
            "first_wall": wall, "tokens": n}


def child_llamacpp(a) -> dict:
    import llama_cpp
    import numpy as np

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(a.model), n_ctx=a.prompt_tokens + a.gen_tokens + 8, n_batch=512,
                          n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    load_s = time.perf_counter() - t
    vocab = llm.n_vocab()
    ids = _ids(vocab, a.prompt_tokens, a.seed)

    def last_logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))

    t0 = time.perf_counter()
    llm.eval(ids)
    tok = int(np.argmax(last_logits()))
    t_first, wall = time.perf_counter(), time.time()
    for _ in range(a.gen_tokens - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
    t_end = time.perf_counter()
    return {"load_s": load_s, "ttft_ms": (t_first - t0) * 1e3, "decode_tok_s": (a.gen_tokens - 1) / (t_end - t_first),
            "first_wall": wall, "tokens": a.gen_tokens}


def child_main(a) -> None:
    r = {"edgeinfer": child_edgeinfer, "genai": child_genai, "llamacpp": child_llamacpp}[a.engine](a)
    r["start_to_first_token_s"] = r.pop("first_wall") - a.t0
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(r))


# ---------------------------------------------------------------- parent: prepare, alternate, report

def sh(cmd: list[str], **kw) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")


def prepare(shape: str, work: Path, threads: int, llama_convert: Path | None, notes: list[str]) -> dict:
    d = work / shape
    hf = d / "hf"
    if not (hf / "model.safetensors").exists():
        sh([sys.executable, str(ROOT / "scripts" / "make_synthetic_model.py"), "--shape", shape, "-o", str(hf)])
    variants = {}
    for q in QUANTS:
        out = d / f"edgeinfer-{q}"
        if not (out / "edgeinfer.json").exists():
            sh([sys.executable, "-m", "edgeinfer", "convert", str(hf), "-o", str(out), "--quant", q, "-q"])
        variants[f"edgeinfer-{q}"] = ("edgeinfer", out, q)
    try:
        import onnxruntime_genai  # noqa: F401

        for q in QUANTS:
            out = d / f"genai-{q}"
            if not (out / "genai_config.json").exists():
                sh([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out), "-p", q,
                    "-e", "cpu", "-c", str(d / "genai-cache")])
            cfg_path = out / "genai_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
            cfg_path.write_text(json.dumps(cfg, indent=1))
            variants[f"genai-{q}"] = ("genai", out, q)
    except ImportError:
        notes.append("onnxruntime-genai not installed: skipped")
    try:
        import llama_cpp

        if llama_convert is None:
            notes.append("llama.cpp skipped: pass --llama-convert PATH/convert_hf_to_gguf.py (from llama.cpp's source)")
        else:
            f32 = d / "model-f32.gguf"
            if not f32.exists():
                sh([sys.executable, str(llama_convert), str(hf), "--outtype", "f32", "--outfile", str(f32)])
            for q in QUANTS:
                out = d / f"model-{GGUF[q]}.gguf"
                if not out.exists():
                    import ctypes

                    params = llama_cpp.llama_model_quantize_default_params()
                    params.ftype = {"Q4_0": 2, "Q8_0": 7}[GGUF[q]]
                    params.nthread = threads
                    if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(params)):
                        raise SystemExit(f"llama.cpp quantize {GGUF[q]} failed")
                variants[f"llamacpp-{GGUF[q]}"] = ("llamacpp", out, q)
    except ImportError:
        notes.append("llama-cpp-python not installed: skipped")
    return variants


def run_child(engine: str, model: Path, a) -> dict:
    t0 = time.time()
    cmd = [sys.executable, __file__, "child", "--engine", engine, "--model", str(model), "--threads", str(a.threads),
           "--prompt-tokens", str(a.prompt_tokens), "--gen-tokens", str(a.gen_tokens), "--seed", str(a.seed),
           "--t0", repr(t0)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    return json.loads(line[-1][7:])


KEYS = ("load_s", "ttft_ms", "decode_tok_s", "start_to_first_token_s", "peak_rss_mb")


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1].get("error", "no run")}
    return {k: round(statistics.median(r[k] for r in ok), 3) for k in KEYS}


def markdown(results: dict, meta: dict) -> str:
    lines = [f"Machine: {meta['machine']}; {meta['threads']} threads; prompt {meta['prompt_tokens']} tokens, "
             f"{meta['gen_tokens']} new tokens, greedy; medians of {meta['runs']} alternating runs; {meta['date']}.", "",
             "| model | engine | decode tok/s | TTFT ms | load s | start to first token s | peak RSS MB | "
             "decode vs edgeinfer | TTFT vs edgeinfer |", "|---|---|---|---|---|---|---|---|---|"]
    for shape, variants in results.items():
        for name, r in variants.items():
            if "error" in r:
                lines.append(f"| {shape} | {name} | error | | | | | | |")
                continue
            q = "int4" if ("int4" in name or "Q4" in name) else "int8"
            base = variants.get(f"edgeinfer-{q}", {})
            rd = f"{base['decode_tok_s'] / r['decode_tok_s']:.2f}x" if "decode_tok_s" in base else ""
            rt = f"{r['ttft_ms'] / base['ttft_ms']:.2f}x" if "ttft_ms" in base else ""
            lines.append(f"| {shape} | {name} | {r['decode_tok_s']:.1f} | {r['ttft_ms']:.0f} | {r['load_s']:.2f} | "
                         f"{r['start_to_first_token_s']:.2f} | {r['peak_rss_mb']:.0f} | {rd} | {rt} |")
    lines += ["", "Ratios: edgeinfer decode tok/s over the peer's (above 1: edgeinfer faster), and the peer's time "
              "to first token over edgeinfer's (above 1: edgeinfer faster), at the same bits."]
    return "\n".join(lines) + "\n"


def write_results(out: Path, meta: dict, results: dict, notes: list[str]) -> str:
    """peers.json and peers.md (with `notes`, which meta holds too) into `out`; returns the markdown."""
    (out / "peers.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    md = markdown(results, meta) + "".join(f"\nNote: {n}" for n in notes)
    (out / "peers.md").write_text(md + "\n")
    return md


def chart(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "decode_tok_s", "decode tokens/s (higher is better)"),
                           (axes[1], "ttft_ms", "time to first token, ms (lower is better)")):
        labels, values = [], []
        for shape, variants in results.items():
            for name, r in variants.items():
                if key in r:
                    labels.append(f"{shape}\n{name}")
                    values.append(r[key])
        colors = ["#2a7" if lab.split("\n")[1].startswith("edgeinfer") else "#888" for lab in labels]
        ax.bar(range(len(values)), values, color=colors)
        ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def parent_main(a) -> None:
    import datetime
    import platform

    notes: list[str] = []
    work, out = a.work, a.out
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for shape in a.shape:
        variants = prepare(shape, work, a.threads, a.llama_convert, notes)
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for i in range(a.runs):  # A B A B: every engine once per round
            for name, (engine, model, _) in variants.items():
                r = run_child(engine, model, a)
                runs[name].append(r)
                print(f"{shape} round {i + 1}/{a.runs} {name}: " +
                      (f"{r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:.0f} ms" if "error" not in r
                       else "error"), file=sys.stderr, flush=True)
        results[shape] = {name: summarize(rs) for name, rs in runs.items()}
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
            "threads": a.threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens, "runs": a.runs,
            "date": datetime.date.today().isoformat(), "notes": notes, "versions": versions()}
    md = write_results(out, meta, results, notes)  # before the chart: a chart that fails loses no results
    try:
        drawn, why = chart(results, out / "peers.png"), "matplotlib cannot be imported"
    except Exception as e:  # matplotlib's own failure (a backend, a font): the results are written already
        drawn, why = False, f"the chart failed ({type(e).__name__}: {' '.join(str(e).split())})"
    if not drawn:
        (out / "peers.png").unlink(missing_ok=True)  # an older run's, or what a failed savefig left
        notes.append(f"{why}: no chart")
        md = write_results(out, meta, results, notes)  # again, with the note
    print(md)


def versions() -> dict:
    v = {}
    for mod in ("edgeinfer", "onnxruntime", "onnxruntime_genai", "llama_cpp"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # not installed, or no version attribute
            v[mod] = None
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--engine", required=True)
    c.add_argument("--model", type=Path, required=True)
    c.add_argument("--t0", type=float, required=True)
    for p in (ap, c):
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--prompt-tokens", type=int, default=512)
        p.add_argument("--gen-tokens", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", nargs="+", default=["small", "medium"], choices=["small", "medium"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgeinfer-peers"))
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--llama-convert", type=Path, default=None)
    a = ap.parse_args()
    child_main(a) if a.cmd == "child" else parent_main(a)


if __name__ == "__main__":
    main()

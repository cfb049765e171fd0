"""GGUF fixtures of stories260K made by llama.cpp's own tools, and llama.cpp's reference outputs on them.

    /work/llamavenv/bin/python scripts/make_gguf_fixtures.py \
        --llama-convert LLAMA_CPP/convert_hf_to_gguf.py [--edgeinfer-python /work/venv/bin/python] \
        [--source models/stories260K] [--tokenizer-from models/stories260K-int8] \
        [--shared ../shared/models/stories260K] [--out tests/fixtures/gguf] [--max-f32-bytes 1200000]

Runs in a Python that has llama-cpp-python (and torch/transformers/sentencepiece for the converter).
Steps: convert_hf_to_gguf.py --outtype f32 (subprocess) -> F32 GGUF; llama_model_quantize (default
params, ftype 7 / 2; llama.cpp picks its own fallbacks) -> stories260K-Q8_0.gguf, stories260K-Q4_0.gguf.
The F32 file is kept in --out only when it is at most --max-f32-bytes. Writes llamacpp_reference.json:
per type the tensor types (gguf's GGUFReader), the non-array metadata, llama.cpp's perplexity on eval.txt
computed by scripts/peer_perplexity_llamacpp.py's own functions (edgeinfer's token ids with BOS, one story
per non-empty line, windows of 512), and greedy ids for golden.json's prompts (its prompt ids, as many new
tokens as its cases, EOS ignored) with the top-1 minus top-2 logit margin of every step.
The token ids come from edgeinfer's Tokenizer, run in --edgeinfer-python (a subprocess) so that this
Python needs no edgeinfer dependencies.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from peer_perplexity_llamacpp import perplexity, quantize  # noqa: E402

WINDOW = 512
SOURCE_FILES = ("config.json", "model.safetensors", "tokenizer.model", "tokenizer.json")

# Run in the edgeinfer Python: the ids exactly as peer_perplexity_llamacpp.py and `edgeinfer generate` make them.
TOKENIZE = r"""
import json, sys
from pathlib import Path
from edgeinfer.manifest import read_manifest
from edgeinfer.tokenizer import Tokenizer
folder, text, golden = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
tok = Tokenizer(folder, read_manifest(folder).tokenizer)
stories = [tok.encode(line, add_bos=True) for line in text.read_text().splitlines() if line.strip()]
prompts = [tok.encode(c["prompt"]) for c in json.loads(golden.read_text())["cases"]]
print(json.dumps({"stories": stories, "prompts": prompts}))
"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def import_gguf(llama_convert: Path):
    """The installed gguf package, else llama.cpp's gguf-py next to the converter (the one it writes with)."""
    try:
        import gguf

        return gguf, importlib.metadata.version("gguf")
    except ImportError:
        sys.path.insert(0, str(llama_convert.parent / "gguf-py"))
        import gguf
        import tomllib

        meta = tomllib.loads((llama_convert.parent / "gguf-py" / "pyproject.toml").read_text())
        return gguf, f"{meta['project']['version']} (llama.cpp's gguf-py, not installed)"


def describe(gguf, path: Path) -> dict:
    """Tensor name -> type name, a Counter of the types, and the metadata that is not an array."""
    r = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or (field.types and field.types[0] == gguf.GGUFValueType.ARRAY):
            continue
        v = field.contents()
        meta[name] = v.item() if isinstance(v, np.generic) else v
    arrays = {name: len(f.data) for name, f in r.fields.items()
              if f.types and f.types[0] == gguf.GGUFValueType.ARRAY}
    return {"tensor_types": types, "type_counts": dict(Counter(types.values())),
            "shapes": {t.name: [int(x) for x in t.shape] for t in r.tensors},
            "metadata": meta, "array_metadata_lengths": arrays}


def greedy(llama_cpp, gguf_path: Path, cases: list[dict]) -> list[dict]:
    """Greedy ids with EOS ignored; per step the top-1 minus top-2 logit and the runner-up id."""
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=WINDOW, n_batch=WINDOW, n_threads=2, verbose=False)
    vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,)).copy()

    out = []
    for case in cases:
        n_new = len(case["greedy_ids"])
        llm.reset()
        llm.eval(case["prompt_ids"])
        ids, margins, runner_up = [], [], []
        for step in range(n_new):
            lg = last_logits()
            top2 = np.argsort(-lg, kind="stable")[:2]
            ids.append(int(top2[0]))
            runner_up.append(int(top2[1]))
            margins.append(float(lg[top2[0]] - lg[top2[1]]))
            if step + 1 < n_new:
                llm.eval([ids[-1]])
        first_diff = next((i for i, (a, b) in enumerate(zip(ids, case["greedy_ids"])) if a != b), None)
        out.append({"prompt": case["prompt"], "prompt_ids": case["prompt_ids"], "greedy_ids": ids,
                    "top1_top2_margins": margins, "runner_up_ids": runner_up,
                    "min_margin": min(margins), "step_of_min_margin": int(np.argmin(margins)),
                    "first_step_differing_from_golden": first_diff})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-convert", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--edgeinfer-python", default=sys.executable, help="a Python that imports edgeinfer")
    ap.add_argument("--source", type=Path, default=ROOT / "models" / "stories260K")
    ap.add_argument("--tokenizer-from", type=Path, default=ROOT / "models" / "stories260K-int8")
    ap.add_argument("--shared", type=Path, default=ROOT.parent / "shared" / "models" / "stories260K",
                    help="folder with eval.txt and golden.json")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "gguf")
    ap.add_argument("--max-f32-bytes", type=int, default=1_200_000, help="keep the F32 GGUF only up to this size")
    args = ap.parse_args()
    try:
        import llama_cpp
    except ModuleNotFoundError:  # (a traceback: a scripts round)
        raise SystemExit("this script needs llama-cpp-python (pip install llama-cpp-python): it quantizes with "
                         "llama.cpp's own code") from None

    gguf, gguf_version = import_gguf(args.llama_convert)
    text, golden_path, ppl_json = (args.shared / n for n in ("eval.txt", "golden.json", "eval_ppl.json"))
    golden = json.loads(golden_path.read_text())
    p = subprocess.run([args.edgeinfer_python, "-c", TOKENIZE, str(args.tokenizer_from), str(text), str(golden_path)],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"tokenizing with {args.edgeinfer_python} failed:\n{p.stderr[-3000:]}")
    tokenized = json.loads(p.stdout)
    stories = tokenized["stories"]
    cases = [{"prompt": c["prompt"], "prompt_ids": c.get("prompt_ids") or ids, "greedy_ids": c["greedy_ids"]}
             for c, ids in zip(golden["cases"], tokenized["prompts"])]
    prompt_check = [c.get("prompt_ids") == ids for c, ids in zip(golden["cases"], tokenized["prompts"])]

    args.out.mkdir(parents=True, exist_ok=True)
    convert_cmd = [sys.executable, str(args.llama_convert), str(args.source), "--outtype", "f32"]
    report = {"files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "stories260K-F32.gguf"
        p = subprocess.run(convert_cmd + ["--outfile", str(f32)], capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"convert_hf_to_gguf.py failed:\n{p.stderr[-3000:]}")
        paths = {"F32": f32}
        for q in ("Q8_0", "Q4_0"):
            paths[q] = args.out / f"stories260K-{q}.gguf"
            quantize(llama_cpp, f32, paths[q], q)
        f32_bytes = f32.stat().st_size
        f32_kept = f32_bytes <= args.max_f32_bytes
        if f32_kept:
            shutil.copyfile(f32, args.out / f32.name)
        elif (args.out / f32.name).exists():
            (args.out / f32.name).unlink()
        for q, path in paths.items():
            print(f"{q}: {path.stat().st_size} bytes; perplexity ...", file=sys.stderr, flush=True)
            entry = {"file": path.name, "committed": q != "F32" or f32_kept, "bytes": path.stat().st_size,
                     "sha256": sha256(path), **describe(gguf, path)}
            entry.update(perplexity(llama_cpp, path, stories, WINDOW))
            print(f"{q}: perplexity {entry['perplexity']:.4f}; greedy ...", file=sys.stderr, flush=True)
            entry["greedy"] = greedy(llama_cpp, path, cases)
            report["files"][q] = entry

    report["how"] = {
        "convert": "convert_hf_to_gguf.py SOURCE --outtype f32 --outfile stories260K-F32.gguf",
        "quantize": "llama_model_quantize(F32, out, llama_model_quantize_default_params() with ftype=7 (Q8_0) "
                    "or 2 (Q4_0), nthread=2)",
        "f32_kept": f32_kept, "f32_note": None if f32_kept else
        f"F32 GGUF is {f32_bytes} bytes > {args.max_f32_bytes}: not committed, rerun to make it",
        "perplexity": "scripts/peer_perplexity_llamacpp.py perplexity(): ids = edgeinfer Tokenizer.encode(line, "
                      "add_bos=True) per non-empty line of eval.txt, windows of 512, logits_all, NLL of every "
                      "token but each window's first",
        "greedy": "golden.json prompt_ids (else edgeinfer Tokenizer.encode(prompt)), len(greedy_ids) new tokens, "
                  "argmax of llama.cpp's last logits (ties: lowest id), EOS ignored; margin = top1 - top2 logit",
        "golden_prompt_ids_equal_edgeinfer_encode": prompt_check,
        "eval_ppl_json": {k: v for k, v in json.loads(ppl_json.read_text()).items() if k in ("perplexity",
                          "scored_tokens", "engine")} if ppl_json.exists() else None,
    }
    report["versions"] = {
        "llama_cpp_python": llama_cpp.__version__, "gguf": gguf_version, "numpy": np.__version__,
        "python": sys.version.split()[0], "convert_hf_to_gguf_sha256": sha256(args.llama_convert),
        "source_sha256": {f: sha256(args.source / f) for f in SOURCE_FILES if (args.source / f).exists()},
        "eval_txt_sha256": sha256(text), "golden_json_sha256": sha256(golden_path),
    }
    (args.out / "llamacpp_reference.json").write_text(json.dumps(report, indent=1) + "\n")
    summary = {q: {"bytes": e["bytes"], "perplexity": round(e["perplexity"], 4), "types": e["type_counts"],
                   "greedy_equal_golden": [g["first_step_differing_from_golden"] is None for g in e["greedy"]]}
               for q, e in report["files"].items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

"""Perplexity of llama.cpp (llama-cpp-python) on the same text, ids and method as `edgeinfer eval`.

    python scripts/peer_perplexity_llamacpp.py --gguf MODEL-f32.gguf --tokenizer-from EDGEINFER_DIR \
        --text tests/fixtures/stories260K/eval.txt [--quant Q8_0 Q4_0] [--window 512]

The F32 GGUF comes from llama.cpp's own convert_hf_to_gguf.py (not shipped here). Each --quant
type is made with llama.cpp's quantizer (llama_model_quantize); the token ids are edgeinfer's
(BOS + SentencePiece), so both engines score exactly the same tokens. JSON lines out. Optional peer:
without llama-cpp-python it says so and exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

QTYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2}


def quantize(llama_cpp, src: Path, dst: Path, qtype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QTYPES[qtype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({qtype}) returned {rc}")


def perplexity(llama_cpp, gguf: Path, stories: list[list[int]], window: int) -> dict:
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=window, n_batch=window, logits_all=True, n_threads=2,
                          verbose=False)
    total, count = 0.0, 0
    for ids in stories:
        for start in range(0, len(ids), window):
            w = ids[start:start + window]
            if len(w) < 2:
                continue
            llm.reset()
            llm.eval(w)
            lg = np.asarray(llm.scores[: len(w) - 1], np.float32)
            m = lg.max(axis=-1, keepdims=True)
            lse = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
            total += float(np.sum(lse - lg[np.arange(len(w) - 1), w[1:]]))
            count += len(w) - 1
    return {"perplexity": math.exp(total / count), "scored_tokens": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True, help="F32 GGUF of the model")
    ap.add_argument("--tokenizer-from", type=Path, required=True, help="an edgeinfer folder of the same model")
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--quant", nargs="+", default=["F32", "Q8_0", "Q4_0"])
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print(json.dumps({"skipped": "llama-cpp-python is not installed"}))
        return
    from edgeinfer.manifest import read_manifest
    from edgeinfer.tokenizer import Tokenizer

    tok = Tokenizer(args.tokenizer_from, read_manifest(args.tokenizer_from).tokenizer)
    stories = [tok.encode(line, add_bos=True) for line in args.text.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for q in args.quant:
            path = args.gguf if q == "F32" else Path(tmp) / f"model-{q}.gguf"
            try:
                if q != "F32":
                    quantize(llama_cpp, args.gguf, path, q)
                r = perplexity(llama_cpp, path, stories, args.window)
                print(json.dumps({"engine": f"llama.cpp {llama_cpp.__version__}", "quant": q, **r,
                                  "file_bytes": path.stat().st_size}), flush=True)
            except Exception as e:  # a peer failing is a finding, not a crash of the harness
                print(json.dumps({"engine": "llama.cpp", "quant": q, "error": str(e)}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()

"""Perplexity and size of quantization recipes on a model, side by side (JSON lines out).

    python scripts/quant_matrix.py [--src models/stories260K] [--text tests/fixtures/stories260K/eval.txt]

Each recipe is converted into a temporary folder and scored with `edgeinfer eval`'s method.
The defaults in `default_scheme` were chosen from this table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from edgeinfer.converters import convert, default_scheme
from edgeinfer.evaluate import perplexity

ROOT = Path(__file__).resolve().parents[1]
RECIPES = [
    ("fp32", {}),
    ("int8", {}),
    ("int8", {"accuracy_level": 0}),
    ("int4", {}),  # the default recipe: gptq
    ("int4", {"accuracy_level": 0}),
    ("int4", {"recipe": "asym"}),
    ("int4", {"recipe": "rtn"}),
    ("int4", {"recipe": "mse"}),
    ("int4", {"recipe": "q4_1"}),
    ("int4", {"embedding": "int8"}),
    ("int4", {"embedding": "int8", "recipe": "asym"}),
    ("int4", {"embedding": "int8", "recipe": "rtn"}),
    ("int4", {"embedding": "int8", "int8_tensors": ("down_proj",)}),  # what llama.cpp's Q4_0 does here
    ("int4", {"embedding": "int8", "int8_tensors": ("qkv_proj",)}),
    ("int4", {"embedding": "int8", "int8_tensors": ("qkv_proj", "down_proj")}),
    ("int4", {"embedding": "int8", "int8_tensors": ("qkv_proj", "down_proj"), "recipe": "rtn"}),
    ("int4", {"block_size": 16, "embedding": "int8"}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT / "models" / "stories260K")
    ap.add_argument("--text", type=Path, default=ROOT / "tests" / "fixtures" / "stories260K" / "eval.txt")
    args = ap.parse_args()
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (quant, kw) in enumerate(RECIPES):
            dst = Path(tmp) / f"r{i}"
            scheme = default_scheme(quant, **kw)
            convert(args.src, dst, scheme=scheme)
            r = perplexity(dst, args.text)
            base = base or r.perplexity
            size = sum((dst / f).stat().st_size for f in ("model.onnx", "model.onnx.data"))
            print(json.dumps({"quant": quant, **{k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
                              "recipe": scheme.recipe if quant == "int4" else None,
                              "perplexity": round(r.perplexity, 4),
                              "vs_fp32_pct": round((r.perplexity / base - 1) * 100, 2), "model_bytes": size}),
                  flush=True)


if __name__ == "__main__":
    main()

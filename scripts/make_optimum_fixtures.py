"""Fixtures for `--via optimum`: tiny random Phi-3 and Gemma models, converted through Optimum, with
transformers' references (run once; CI needs neither torch nor Optimum).

    python -m venv /tmp/optvenv && /tmp/optvenv/bin/pip install -e '.[optimum]'  # torch 2.13 (CPU)
    /tmp/optvenv/bin/python scripts/make_optimum_fixtures.py [--dir tests/fixtures/optimum]

Per family (tests/fixtures/optimum/<family>/):
  fp32/, int4/        the model (hidden 64, 2 layers, vocab 512: the stories260K SentencePiece
                      tokenizer) converted by `convert_via_optimum`
  one_layer_fp32/     the same weights cut to the first layer, converted at fp32: with one layer a
                      token's K/V depend only on the token and its position, so a ring step has an
                      exact from-scratch reference (tests/test_optimum.py)
  reference.npz       input_ids [1, 24] and transformers' fp32 logits [24, V] of one forward pass
  reference.json      greedy ids (transformers, fp32, eager attention, full recompute each step):
                        greedy:  32 tokens after an 8-token prompt (2 layers)
                        window:  64 tokens after an 8-token prompt of the one-layer model, each step a
                                 forward over what a ring of `capacity` slots with `n_sink` sinks holds,
                                 at positions 0..n (what the ring computes when it re-bases every token)
                      and the smallest top-1/top-2 logit margin along each
Weights are drawn (seeded) wider than transformers' initializer so that greedy steps are decided by
clear margins, as scripts/make_tiny_models.py does for the native families.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GemmaConfig, Phi3Config
except ModuleNotFoundError as e:  # (a traceback, even for --help: a scripts round)
    raise SystemExit(f"this script needs {e.name}: pip install -e '.[optimum]' (torch 2.13, CPU)") from None

from edgeinfer.converters.optimum_export import convert_via_optimum

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SRC = ROOT / "models" / "stories260K"
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
CONFIGS = {
    # Phi-3's fused qkv and gate_up projections; a sliding window (as Phi-3-mini's 2047), enforced by the ring
    "phi3": lambda **kw: Phi3Config(**{**BASE, **kw}, tie_word_embeddings=False, sliding_window=64,
                                    original_max_position_embeddings=256),
    # Gemma: head_dim set apart from hidden/heads, GeLU-tanh MLP, (1 + w) RMSNorm, scaled tied embedding
    "gemma": lambda **kw: GemmaConfig(**{**BASE, **kw}, head_dim=16, tie_word_embeddings=True),
}
WINDOW = dict(capacity=16, n_sink=4, new_tokens=64)


def make_source(family: str, folder: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A Hugging Face folder of a seeded random `family` model (fp32 safetensors, stories260K's tokenizer)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](num_hidden_layers=2), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Phi-3 scales by w, Gemma by (1 + w)
                p.copy_((0.0 if family == "gemma" else 1.0) + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:  # Gemma multiplies the embedding by sqrt(hidden)
                p.copy_(torch.randn_like(p) * (0.125 if family == "gemma" else 1.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    if num_layers < 2:  # the same weights, cut to the first layers
        cut = AutoModelForCausalLM.from_config(CONFIGS[family](num_hidden_layers=num_layers), dtype=torch.float32)
        cut.load_state_dict({k: v for k, v in model.state_dict().items()
                             if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < num_layers})
        model = cut
    model.save_pretrained(folder)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_SRC / name, folder / name)
    return folder


def _margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def greedy(model, prompt: list[int], n: int, window: dict | None = None) -> tuple[list[int], float]:
    """n greedy ids after `prompt`, recomputing from scratch each step; with `window`, each step sees
    only what the ring holds (the first n_sink tokens and the newest capacity - n_sink before the last
    one, then the last one) at positions 0, 1, ...: the ring's computation for a one-layer model."""
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            seen = ids
            if window is not None and len(ids) - 1 > window["capacity"]:
                c, k = window["capacity"], window["n_sink"]
                seen = ids[:k] + ids[len(ids) - 1 - (c - k):]
            last = model(torch.tensor([seen])).logits[0, -1].float().numpy()
            margins.append(_margin(last))
            ids.append(int(last.argmax()))
    return ids[len(prompt):], min(margins)


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "tests" / "fixtures" / "optimum")
    args = ap.parse_args()
    rng = np.random.default_rng(1234)
    report = {}
    with tempfile.TemporaryDirectory() as work:
        for family in CONFIGS:
            out = args.dir / family
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            src = make_source(family, Path(work) / family)
            one = make_source(family, Path(work) / f"{family}-one-layer", num_layers=1)
            model, model1 = load(src), load(one)
            input_ids = rng.integers(3, 512, size=(1, 24))
            prompt = rng.integers(3, 512, size=8).tolist()
            with torch.no_grad():
                logits = model(torch.tensor(input_ids)).logits[0].float().numpy()
            ids, margin = greedy(model, prompt, 32)
            w_ids, w_margin = greedy(model1, prompt, WINDOW["new_tokens"], WINDOW)
            np.savez_compressed(out / "reference.npz", input_ids=input_ids, logits=logits.astype(np.float32))
            ref = {"prompt_ids": prompt, "greedy_ids": ids, "min_margin": round(margin, 5),
                   "window": {**WINDOW, "greedy_ids": w_ids, "min_margin": round(w_margin, 5)}}
            (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
            for quant, source, name in (("fp32", src, "fp32"), ("int4", src, "int4"), ("fp32", one, "one_layer_fp32")):
                convert_via_optimum(source, out / name, quant=quant, log=lambda msg: None)
                (out / name / ".edgeinfer-verified.json").unlink(missing_ok=True)
            sizes = {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in out.iterdir() if d.is_dir()}
            report[family] = {"min_margin": ref["min_margin"], "window_min_margin": ref["window"]["min_margin"],
                              "logit_absmax": round(float(np.abs(logits).max()), 3), "bytes": sizes}
    report["_versions"] = {p: version(p) for p in ("torch", "transformers", "optimum", "optimum-onnx", "onnxruntime",
                                                    "onnx")}
    (args.dir / "REFERENCE.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

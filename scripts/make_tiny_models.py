"""Write tiny random-weight Hugging Face model folders, one per supported family variant (numpy only).

    python scripts/make_tiny_models.py [-o tests/fixtures/tiny] [--window-output tests/fixtures/window]

`WINDOWED` (a Mistral whose sliding window of 16 binds within its 256 positions) goes to a folder of
its own: its ring differs (no sinks, at most W - 1 tokens), so the tests over every tiny model skip it.
Each folder has config.json, model.safetensors (fp32, bf16 or fp16 as the variant says) and the
stories260K SentencePiece tokenizer (vocab 512), so the converter sees a complete source folder.
Reference logits come from transformers in `make_parity_fixtures.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SRC = ROOT / "models" / "stories260K"
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=True, rope_theta=10000.0)

# name -> (config overrides, weight dtype)
VARIANTS = {
    "llama2_gqa_tied": (dict(architectures=["LlamaForCausalLM"], model_type="llama"), "F32"),
    "llama3_mqa_untied_bf16": (dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=1,
                                    tie_word_embeddings=False, rope_theta=500000.0,
                                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                      high_freq_factor=4.0, original_max_position_embeddings=64)),
                               "BF16"),
    "llama_linear_rope_bias": (dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True,
                                    rope_scaling=dict(rope_type="linear", factor=2.0)), "F32"),
    "mistral_gqa_untied_fp16": (dict(architectures=["MistralForCausalLM"], model_type="mistral",
                                     tie_word_embeddings=False, sliding_window=4096), "F16"),
    "qwen2_bias_tied": (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0), "F32"),
    "qwen3_qknorm_tied": (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32,
                               rope_theta=1000000.0), "F32"),
}
WINDOWED = {
    "mistral_window16": (dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False,
                              sliding_window=16), "F32"),
}
NP = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}


def tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Dh = cfg.get("head_dim", D // H)
    w = lambda *shape, std=0.15: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    out = {"model.embed_tokens.weight": w(V, D, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = norm(D)
        for proj, n in (("q", H * Dh), ("k", Hkv * Dh), ("v", Hkv * Dh)):
            out[f"{p}.self_attn.{proj}_proj.weight"] = w(n, D)
            if qkv_bias:
                out[f"{p}.self_attn.{proj}_proj.bias"] = w(n, std=0.1)
        out[f"{p}.self_attn.o_proj.weight"] = w(D, H * Dh)
        if cfg.get("attention_bias", False):
            out[f"{p}.self_attn.o_proj.bias"] = w(D, std=0.1)
        if cfg["model_type"] == "qwen3":
            out[f"{p}.self_attn.q_norm.weight"] = norm(Dh)
            out[f"{p}.self_attn.k_norm.weight"] = norm(Dh)
        out[f"{p}.post_attention_layernorm.weight"] = norm(D)
        out[f"{p}.mlp.gate_proj.weight"] = w(I, D)
        out[f"{p}.mlp.up_proj.weight"] = w(I, D)
        out[f"{p}.mlp.down_proj.weight"] = w(D, I)
    out["model.norm.weight"] = norm(D)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(V, D, std=1.5)
    return out


def write_safetensors(path: Path, named: dict[str, np.ndarray], tag: str) -> None:
    header, blobs, offset = {}, [], 0
    for name, arr in named.items():
        b = arr.astype(NP[tag]).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "tests" / "fixtures" / "tiny")
    ap.add_argument("--window-output", type=Path, default=ROOT / "tests" / "fixtures" / "window")
    args = ap.parse_args()
    folders = [args.output / n for n in VARIANTS] + [args.window_output / n for n in WINDOWED]
    for seed, (out, (overrides, tag)) in enumerate(zip(folders, [*VARIANTS.values(), *WINDOWED.values()])):
        name = out.name
        out.mkdir(parents=True, exist_ok=True)
        cfg = {**BASE, **overrides}
        (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        write_safetensors(out / "model.safetensors", tensors(cfg, np.random.default_rng(seed)), tag)
        for f in ("tokenizer.model", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZER_SRC / f, out / f)
        print(name)


if __name__ == "__main__":
    main()

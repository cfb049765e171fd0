"""Write a Hugging Face Llama folder with random weights at a real size, for speed and size benchmarks.

    python scripts/make_synthetic_model.py --shape small|medium -o DIR [--seed 0] [--dtype fp32|bf16]

small: SmolLM2-135M dims (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536);
medium: Qwen2.5-0.5B dims (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864).
Both: a 32,000-token SentencePiece BPE vocabulary trained here on a generated corpus, tied
embeddings, Llama architecture. Deterministic for a seed. Weights are streamed to
model.safetensors one tensor at a time. Needs numpy, ml_dtypes and sentencepiece; when
transformers is installed it also writes tokenizer.json (llama.cpp's converter and ONNX Runtime
GenAI's builder read that).
"""

from __future__ import annotations

import argparse
import io
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

SHAPES = {
    "small": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                  intermediate_size=1536),
    "medium": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864),
}
VOCAB = 32000
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ay", "ee", "ou")]


def corpus(seed: int, n_words: int = 600_000) -> str:
    """Pseudo-words from syllables, Zipf-distributed so BPE finds 32k useful merges."""
    rng = np.random.default_rng(seed)
    lexicon = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 5))) for _ in range(60_000)]
    ranks = np.minimum(rng.zipf(1.15, size=n_words) - 1, len(lexicon) - 1)
    words = [lexicon[r] for r in ranks]
    lines = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    return "\n".join(lines)


def train_tokenizer(out: Path, seed: int) -> None:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(seed).splitlines()), model_writer=model, vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=2, minloglevel=2, add_dummy_prefix=True, remove_extra_whitespaces=False,
        hard_vocab_limit=False, train_extremely_large_corpus=False,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "legacy": False, "model_max_length": 4096}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                             "unk_token": "<unk>"}))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, shape, init std); std 0 means ones (norm weights)."""
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Dh = D // H
    specs = [("model.embed_tokens.weight", (V, D), 0.02)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [(f"{p}.input_layernorm.weight", (D,), 0.0),
                  (f"{p}.self_attn.q_proj.weight", (H * Dh, D), 0.02),
                  (f"{p}.self_attn.k_proj.weight", (Hkv * Dh, D), 0.02),
                  (f"{p}.self_attn.v_proj.weight", (Hkv * Dh, D), 0.02),
                  (f"{p}.self_attn.o_proj.weight", (D, H * Dh), 0.02),
                  (f"{p}.post_attention_layernorm.weight", (D,), 0.0),
                  (f"{p}.mlp.gate_proj.weight", (I, D), 0.02),
                  (f"{p}.mlp.up_proj.weight", (I, D), 0.02),
                  (f"{p}.mlp.down_proj.weight", (D, I), 0.02)]
    specs.append(("model.norm.weight", (D,), 0.0))
    return specs


def write_safetensors(path: Path, specs, dtype: str, seed: int) -> None:
    """Stream random tensors into one safetensors file (header first, then data in order)."""
    np_dtype = np.float32 if dtype == "fp32" else ml_dtypes.bfloat16
    tag, item = ("F32", 4) if dtype == "fp32" else ("BF16", 2)
    header, offset = {}, 0
    for name, shape, _ in specs:
        n = int(np.prod(shape)) * item
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, std in specs:
            t = np.ones(shape, np.float32) if std == 0 else (rng.standard_normal(shape, np.float32) * std)
            f.write(t.astype(np_dtype).tobytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    dims = SHAPES[args.shape]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
           **dims, "head_dim": dims["hidden_size"] // dims["num_attention_heads"], "hidden_act": "silu",
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "float32" if args.dtype == "fp32" else "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    train_tokenizer(out, args.seed)
    write_safetensors(out / "model.safetensors", tensor_specs(cfg), args.dtype, args.seed)
    n = sum(int(np.prod(s)) for _, s, _ in tensor_specs(cfg))
    print(json.dumps({"output": str(out), "shape": args.shape, "parameters": n}))


if __name__ == "__main__":
    main()

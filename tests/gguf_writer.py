"""Test helper: a committed Hugging Face fixture folder written as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py writes it (llama.cpp's `conversion/base.py` TextModel, `conversion/llama.py`
LlamaModel, `conversion/qwen.py` Qwen2Model/Qwen3Model), without torch and without llama.cpp:

- general.architecture "llama" for model_type llama and mistral (llama.cpp registers
  MistralForCausalLM under LlamaModel), "qwen2", "qwen3"; the `{arch}.*` hyperparameters TextModel
  writes (block_count, context_length, embedding_length, feed_forward_length, head_count(_kv),
  rope.freq_base, layer_norm_rms_epsilon, key/value_length when config.json has `head_dim`, rope
  scaling type and factor for linear scaling); LlamaModel alone adds vocab_size and
  rope.dimension_count (Qwen2Model/Qwen3Model do not write them).
- Llama q and k weights and biases permuted into llama.cpp's rotary order (`LlamaModel.permute`, k
  with the KV head count); qwen2/qwen3 are not permuted.
- 1-D tensors and `*_norm.weight` F32, `.bias` F32; 2-D weights in `qtype` ("F32", "F16", "Q8_0"),
  a row that gguf.quants cannot quantize (length not a multiple of 32) falling back to F16.
- llama3 rope scaling: no scaling keys, a `rope_freqs.weight` tensor of per-frequency factors
  (`LlamaModel.generate_extra_tensors`).
- The vocabulary as `_set_vocab_sentencepiece` makes it from tokenizer.model (piece, score, type:
  1 normal, 2 unknown, 3 control, 5 unused, 6 byte), with `gguf.SpecialVocab` (the gguf package's
  class llama.cpp itself uses) for the BOS/EOS/UNK ids and add_bos/add_eos from
  tokenizer_config.json, and add_space_prefix from its `add_prefix_space`.

tests/test_gguf_parity.py checks this writer against a file llama.cpp's converter made
(tests/fixtures/gguf/stories260K-F32.gguf): the same metadata and the same tensor bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> GGUF arch
FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7}  # gguf.LlamaFileType: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# sentencepiece token types as llama.cpp numbers them (gguf.TokenType / SentencePieceTokenTypes)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for a Hugging Face one ("model.layers.0.self_attn.q_proj.bias" -> "blk.0.attn_q.bias")."""
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 5:
        raise KeyError(f"no GGUF name for {hf!r}")
    module, suffix = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{int(parts[2])}.{_LAYER[module]}.{suffix}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), in numpy: per head, Hugging Face's
    halved rotary rows (j, j + Dh/2) become interleaved pairs (2j, 2j+1)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def rope_parameters(cfg: dict) -> dict:
    """TextModel.rope_parameters: rope_parameters or rope_scaling, with rope_theta and rope_type mirrored."""
    params = dict(cfg.get("rope_parameters", cfg.get("rope_scaling")) or {})
    if "rope_theta" not in params and cfg.get("rope_theta") is not None:
        params["rope_theta"] = cfg["rope_theta"]
    if "rope_type" not in params and params.get("type") is not None:
        params["rope_type"] = params["type"]
    return params


def llama3_rope_factors(cfg: dict, rope: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the `rope_freqs.weight` factors for llama3 rope scaling."""
    base = rope.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def sentencepiece_vocab(tokenizer_model: Path, vocab_size: int | None):
    """`_create_vocab_sentencepiece`: tokens (bytes), scores and types, padded to `vocab_size`."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(tokenizer_model))
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores, types = [-10000.0] * n, [UNUSED] * n
    for i in range(min(sp.vocab_size(), n)):
        kind = NORMAL
        if sp.IsUnknown(i):
            kind = UNKNOWN
        elif sp.IsControl(i):
            kind = CONTROL
        elif sp.IsUnused(i):
            kind = UNUSED
        elif sp.IsByte(i):
            kind = BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), kind
    return tokens, scores, types


def _encode(gguf, data: np.ndarray, qtype: str):
    """(bytes-or-floats, GGMLQuantizationType) as llama.cpp's prepare_tensors picks them."""
    kind = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(data, kind), kind
    except gguf.QuantError:  # llama.cpp: "falling back to F16"
        kind = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(data, kind), kind


def write_gguf(hf_folder: Path, out: Path, qtype: str) -> Path:
    """Write the Hugging Face folder `hf_folder` (config.json, *.safetensors, tokenizer.model) as the
    GGUF file `out` with its 2-D weights in `qtype` ("F32", "F16" or "Q8_0"). Returns `out`."""
    import gguf

    from edgeinfer.converters.safetensors_io import Checkpoint

    if qtype not in FILE_TYPE:
        raise ValueError(f"qtype must be one of {', '.join(FILE_TYPE)}, got {qtype!r}")
    hf_folder, out = Path(hf_folder), Path(out)
    cfg = json.loads((hf_folder / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = ARCH[model_type]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    rope = rope_parameters(cfg)

    w = gguf.GGUFWriter(out, arch)
    # prepare_metadata
    w.add_type("model")
    w.add_name(hf_folder.name)
    # TextModel.set_gguf_parameters
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rope_type = rope.get("rope_type")
    if rope_type == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type not in (None, "default", "llama3"):
        raise ValueError(f"this test writer does not write rope type {rope_type!r}")
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(FILE_TYPE[qtype])
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # set_vocab: tokenizer_config's add_prefix_space (LlamaModel only), then _set_vocab_sentencepiece
    tok_cfg_path = hf_folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    if arch == "llama" and tok_cfg.get("add_prefix_space") is not None:
        w.add_add_space_prefix(tok_cfg["add_prefix_space"])
    tokens, scores, types = sentencepiece_vocab(hf_folder / "tokenizer.model", cfg.get("vocab_size"))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    # tensors: generate_extra_tensors first, then the checkpoint's in its order
    ckpt = Checkpoint(hf_folder)
    items: list[tuple[str, np.ndarray]] = []
    if arch == "llama" and str(rope_type).lower() == "llama3":
        items.append(("rope_freqs.weight", llama3_rope_factors(cfg, rope)))
    for hf in ckpt.tensors:
        if hf.endswith(".rotary_emb.inv_freq"):
            continue
        data = ckpt.read(hf)
        if arch == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads, heads)
        elif arch == "llama" and hf.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, heads, kv_heads)
        items.append((gguf_name(hf), np.ascontiguousarray(data, np.float32)))
    for name, data in items:
        if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
            w.add_tensor(name, data)  # F32
            continue
        raw, kind = _encode(gguf, data, qtype)
        w.add_tensor(name, raw, raw_dtype=kind)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

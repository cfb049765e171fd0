"""What `convert` needs from a GGUF file besides its tensors: the ArchSpec, the `--quant keep`
scheme (a description of what the file's types become), the tokenizer and the manifest's origin.

The architecture metadata is read into a Hugging Face config dict (`GGUFCheckpoint.config`) and
through the same family modules as a config.json, so a GGUF is checked exactly as a folder is;
their messages name the GGUF's metadata instead of config.json.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.families import spec_from_config
from edgeinfer.converters.gguf_blocks import KEPT_TYPES
from edgeinfer.converters.gguf_checkpoint import GGUFCheckpoint
from edgeinfer.converters.gguf_tokenizer import tokenizer_info, write_tokenizer
from edgeinfer.errors import ConvertError
from edgeinfer.manifest import Origin, TokenizerInfo
from edgeinfer.quant_scheme import QuantScheme

GGUF_MAGIC = b"GGUF"
_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic (or is named .gguf: a damaged one is then refused as GGUF)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError as e:  # unreadable (permissions, a failing disk: EIO): said as the source's, not the output's
        raise ConvertError(f"cannot read the source {path}: {e.strerror or e}") from None


# config.json fields as the GGUF keys they come from (for messages): {arch} is general.architecture
_GGUF_KEYS = {"hidden_size": "{arch}.embedding_length", "intermediate_size": "{arch}.feed_forward_length",
              "num_hidden_layers": "{arch}.block_count", "num_attention_heads": "{arch}.attention.head_count",
              "num_key_value_heads": "{arch}.attention.head_count_kv", "head_dim": "{arch}.attention.key_length",
              "vocab_size": "{arch}.vocab_size", "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
              "rope_theta": "{arch}.rope.freq_base", "max_position_embeddings": "{arch}.context_length",
              "rope_scaling.factor": "{arch}.rope.scaling.factor", "bos_token_id": "tokenizer.ggml.bos_token_id",
              "eos_token_id": "tokenizer.ggml.eos_token_id", "partial_rotary_factor": "{arch}.rope.dimension_count",
              "use_sliding_window=true": "{arch}.attention.sliding_window"}


def spec_from_gguf(ckpt: GGUFCheckpoint) -> ArchSpec:
    """The ArchSpec of a GGUF's metadata, checked as a config.json is; messages name the GGUF keys."""
    cfg = ckpt.config()  # (its own messages name the GGUF keys)
    try:
        return spec_from_config(cfg)
    except ConvertError as e:  # the file's name put in last: "my_vocab_size.gguf" was renamed by the keys
        msg = str(e)
        for hf, key in _GGUF_KEYS.items():
            msg = msg.replace(hf, key.format(arch=ckpt.arch))
        raise ConvertError(msg.replace("config.json", f"{ckpt.path.name} metadata")) from None


def kind_of(ckpt: GGUFCheckpoint, name: str) -> str:
    """What `--quant keep` stores a tensor as: a kept type at its own width, others by `stored_kind`."""
    qtype = ckpt.gguf_type(name)
    if qtype in KEPT_TYPES:
        return "int8" if qtype == "Q8_0" else "int4"
    return ckpt.stored_kind(qtype)


def keep_scheme(ckpt: GGUFCheckpoint, spec: ArchSpec, accuracy_level: int | None) -> QuantScheme:
    """The manifest's description of a `--quant keep` conversion: the projections' most common kind
    (with those held at int8 listed, as a mixed int4 scheme lists them), the embedding's and the
    head's, zero points when any Q4_1 is kept, and accuracy level 0 (float activations: the file's
    numbers as they are) unless asked otherwise."""
    layers = range(spec.num_layers)
    kinds = {p: Counter(kind_of(ckpt, f"model.layers.{i}.{'self_attn' if p in ('qkv_proj', 'o_proj') else 'mlp'}.{t}.weight")
                        for i in layers for t in parts) for p, parts in _PROJECTIONS.items()}
    total = sum(kinds.values(), Counter())
    weights = total.most_common(1)[0][0]
    embedding = kind_of(ckpt, "model.embed_tokens.weight")
    head = kind_of(ckpt, "lm_head.weight") if "lm_head.weight" in ckpt else embedding
    int8 = tuple(p for p, c in kinds.items() if weights == "int4" and set(c) == {"int8"})
    symmetric = "Q4_1" not in ckpt.type_counts()
    return QuantScheme(weights=weights, block_size=32, symmetric=symmetric,
                       accuracy_level=0 if accuracy_level is None else accuracy_level,
                       embedding=embedding, lm_head=head, int8_tensors=int8, scale_dtype="float16")


def origin(ckpt: GGUFCheckpoint, quant: str, requantized: dict[str, str], kept_types=()) -> Origin:
    """The manifest's origin for a GGUF converted with `quant` ("keep", or a width): `kept_types`, the
    types of the tensors whose blocks were taken over exactly (`TensorSource.kept_types`)."""
    types = ckpt.type_counts()
    kept = tuple(t for t in types if t in kept_types) if quant == "keep" else ()
    return Origin(format="gguf", file=ckpt.path.name, tensor_types=types, quant=quant, kept_exact=kept,
                  requantized=tuple(f"{n}: {how}" for n, how in sorted(requantized.items())))


def write_gguf_tokenizer(ckpt: GGUFCheckpoint, spec: ArchSpec, folder: Path) -> tuple[TokenizerInfo, list[str]]:
    """tokenizer.json from the GGUF's metadata into `folder`; the TokenizerInfo and the files written."""
    info = tokenizer_info(ckpt.metadata, ckpt.path.name)
    files = write_tokenizer(ckpt.metadata, ckpt.path.name, folder)
    if not info.eos_token_ids and spec.eos_token_ids:
        info = TokenizerInfo(**{**info.__dict__, "eos_token_ids": spec.eos_token_ids})
    return info, files

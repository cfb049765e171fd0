"""A GGUF file (llama.cpp's format) as a checkpoint the decoder builder reads, under Hugging Face names.

The header (metadata and tensor table) is read by `gguf_header` in one pass; the `gguf` package
(llama.cpp's own, on PyPI) gives the type numbers, block sizes and the dequantizers. Each tensor's
bytes are read with a plain `read`, one tensor at a time (as `safetensors_io` does), so the
converter never holds the file. Every tensor's extent is checked against the file size before
any work.

What it gives the builder (the `Checkpoint` protocol of `safetensors_io`, plus `blocks`):
    tensors / `in`        the Hugging Face names present ("model.layers.0.self_attn.q_proj.weight")
    read(name, shape)     float32 [N, K] (dequantized by the `gguf` package for quantized types)
    blocks(name, shape)   `gguf_blocks.Blocks` for Q8_0 / Q4_0 / Q4_1, taken over exactly; else None
    gguf_type(name)       the tensor's GGUF type ("Q4_1", "F32", "Q6_K")
    config()              the architecture metadata as a Hugging Face config dict (families/ read it)
Llama files hold q and k rows in llama.cpp's rotary order; both methods undo it (`unpermute_rows`).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np

from edgeinfer.converters import gguf_blocks
from edgeinfer.converters.gguf_header import HeaderError, read_header
from edgeinfer.converters.gguf_tokenizer import SPM_DEFAULT_IDS
from edgeinfer.converters.quantize import MAX_WEIGHT_ABS, check_magnitude
from edgeinfer.errors import ConvertError

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # general.architecture -> family
REQUIRED = {"context_length": "trained length", "attention.layer_norm_rms_epsilon": "norm epsilon",
            "embedding_length": "hidden size", "block_count": "layer count", "attention.head_count": "head count",
            "feed_forward_length": "MLP size"}  # a GGUF's own keys, under its architecture's name
FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor", "rope.scale_linear",
              "rope.scaling.attn_factor")  # float32 (or float64) in the file, as llama.cpp reads them
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # stored as float by keep, never re-quantized
PIP_HINT = "pip install 'edgeinfer[gguf]'"
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for one we do not know."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    n = parts[1] if len(parts) == 3 else ""
    # a layer number as llama.cpp writes it: ASCII digits, no leading zero ("blk.01", "blk.١" would
    # name layer 1 a second time: a hostile file held both, and the later one was used)
    if parts[0] == "blk" and n.isascii() and n.isdigit() and (n == "0" or n[0] != "0") and parts[2] in _LAYER:
        return f"model.layers.{int(n)}.{_LAYER[parts[2]]}"
    return None


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConvertError(f"reading a GGUF file needs the gguf package: {PIP_HINT}") from None
    return gguf


class GGUFCheckpoint:
    """One GGUF file's metadata and tensors (see the module doc)."""

    def __init__(self, path: Path):
        gguf = _gguf()
        self.path = Path(path)
        self.files = [self.path]
        size = self.path.stat().st_size
        try:
            self.metadata, entries = read_header(self.path)
        except HeaderError as e:
            raise ConvertError(f"{self.path.name}: not a readable GGUF file ({e})") from None
        self.arch = self.metadata.get("general.architecture")
        self._infos: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}  # hf -> (gguf name, type, shape, offset, bytes)
        unknown, seen = [], set()
        align = self.metadata.get("general.alignment", 32)
        for t in entries:
            if t.name in seen:
                raise ConvertError(f"{self.path.name}: tensor {t.name!r:.80} appears twice in the tensor table")
            seen.add(t.name)
            if t.offset % align:
                raise ConvertError(f"{self.path.name}: tensor {t.name!r:.80} starts at byte {t.offset}, not aligned to "
                                   f"{align} as the format requires (a damaged tensor table)")
            try:
                qtype = gguf.GGMLQuantizationType(t.type_id).name
                block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type_id)]
            except (ValueError, KeyError):
                raise ConvertError(f"{self.path.name}: tensor {t.name!r:.80} has type number {t.type_id}, which this "
                                   "converter cannot read") from None
            elements = math.prod(int(d) for d in t.dims)  # exact (an int64 product wrapped negative past 2**63)
            if elements % block or (t.dims and t.dims[0] % block):
                raise ConvertError(f"{self.path.name}: tensor {t.name!r:.80} of {list(t.dims)} does not divide into "
                                   f"{qtype} blocks of {block}")
            end = t.offset + elements // block * type_bytes
            if end > size:
                raise ConvertError(f"{self.path.name}: truncated GGUF file: tensor {t.name!r:.80} ends at byte {end}, "
                                   f"the file has {size}")
            name = hf_name(t.name)
            if name is None:
                unknown.append(t.name)
                continue
            shape = tuple(reversed(t.dims))  # GGUF lists ne0 (the row length) first
            self._infos[name] = (t.name, qtype, shape, t.offset, end - t.offset)
        if unknown:  # first: they hold bytes too, which the gaps below would call damage (llama-quantize
            # writes rope_freqs between output_norm and token_embd)
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            why = " (Llama 3.1-style rope scaling is not supported from GGUF)" if "rope_freqs.weight" in unknown else ""
            raise ConvertError(f"{self.path.name}: tensors this converter does not know: "
                               f"{', '.join(f'{n!r:.60}' for n in unknown[:3])}{more}{why}")
        extents = sorted((i[3], i[3] + i[4], i[0]) for i in self._infos.values())
        for (_, end, a), (start, _, b) in zip(extents, extents[1:]):
            if start < end:
                raise ConvertError(f"{self.path.name}: tensors {a!r:.80} and {b!r:.80} overlap in the file (a damaged tensor "
                                   "table)")
            if start - end >= align:  # writers pad each tensor to the alignment only: a type or a shape in the
                # table was changed (an F32 norm retyped F16 converted into a model of garbage; a hostile review)
                raise ConvertError(f"{self.path.name}: tensor {a!r:.80} ends at byte {end} but the next, {b!r:.80}, starts at "
                                   f"{start}: {start - end} bytes belong to no tensor (a damaged tensor table)")
        if extents and size - extents[-1][1] >= align:  # the same rule after the last tensor: a smaller type in
            # its entry, or a smaller general.alignment (every tensor read early), converted into garbage
            _, end, last = extents[-1]
            raise ConvertError(f"{self.path.name}: the last tensor, {last!r:.80}, ends at byte {end} of {size}: "
                               f"{size - end} bytes belong to no tensor (a damaged tensor table or alignment, or data appended)")
        self.tensors = self._infos  # the checkpoint protocol's name -> entry map
        self._order: dict[str, np.ndarray] = {}

    # --- the checkpoint protocol -------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def gguf_type(self, name: str) -> str:
        return self._info(name)[1]

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each GGUF type the file holds (for the manifest's origin)."""
        return dict(sorted(Counter(i[1] for i in self._infos.values()).items()))

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """One tensor as float32 in a new array (dequantized when quantized), rows in Hugging Face order."""
        gguf = _gguf()
        _, qtype, have, _, _ = self._info(name, shape)
        if qtype in gguf_blocks.KEPT_TYPES and len(have) == 2:
            return self.blocks(name, shape).dequantize()
        try:  # damaged scales make NaN or infinity, refused below: numpy's warnings would come before that line
            with np.errstate(invalid="ignore", over="ignore"):
                arr = gguf.quants.dequantize(self._raw(name), gguf.GGMLQuantizationType[qtype])  # raw bytes, any type
        except (NotImplementedError, KeyError, ValueError) as e:
            raise ConvertError(f"{self.path.name}: tensor {self._info(name)[0]!r} has type {qtype}, which this "
                               f"converter cannot read ({e.__class__.__name__}: {e})") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(have)
        if not np.isfinite(arr).all():
            raise ConvertError(f"{self.path.name}: tensor {self._info(name)[0]!r} holds NaN or infinite values "
                               "(a damaged file)")
        check_magnitude(f"{self.path.name}: tensor {self._info(name)[0]!r}", arr)
        order = self._row_order(name, have)
        return arr[order] if order is not None else arr

    def blocks(self, name: str, shape: tuple[int, ...] | None = None) -> gguf_blocks.Blocks | None:
        """The tensor's blocks taken over exactly (Q8_0, Q4_0, Q4_1 matrices), or None for other types."""
        _, qtype, have, _, _ = self._info(name, shape)
        if qtype not in gguf_blocks.KEPT_TYPES or len(have) != 2:
            return None
        b = gguf_blocks.from_gguf(self._raw(name), qtype, have[0], have[1])
        for what, v in (("scale", b.scales), ("minimum", b.mins)):
            bad = np.argwhere(~np.isfinite(v)) if v is not None else ()
            if len(bad):
                row, block = (int(x) for x in bad[0])
                raise ConvertError(f"{self.path.name}: tensor {self._info(name)[0]!r} has a non-finite {what} in "
                                   f"block {block} of row {row} (a damaged file)")
        # the most a block's weights can reach, as `read` checks the weights themselves (a flipped exponent bit
        # in one Q8_0 scale, 0.0146 -> 955.5, made weights of 1.2e5 that --quant keep converted silently)
        reach = np.abs(b.scales.astype(np.float32)) * ((1 << b.bits) - 1 if b.mins is not None else 1 << (b.bits - 1))
        if b.mins is not None:
            reach += np.abs(b.mins.astype(np.float32))
        if reach.size and float(reach.max()) > MAX_WEIGHT_ABS:
            row, block = (int(x) for x in np.unravel_index(int(np.argmax(reach)), reach.shape))
            raise ConvertError(f"{self.path.name}: tensor {self._info(name)[0]!r} has a block (row {row}, block "
                               f"{block}) whose scale makes weights of magnitude up to {float(reach.max()):.3g}, past "
                               f"any trained model's (at most {MAX_WEIGHT_ABS:g} here): a damaged file (a flipped "
                               "exponent bit, say)")
        order = self._row_order(name, have)
        return b.rows(order) if order is not None else b

    @staticmethod
    def stored_kind(qtype: str) -> str:
        """How `--quant keep` stores a tensor of GGUF type `qtype` that is not taken over as blocks:
        F32 and BF16 as fp32, F16 as fp16; a quantized type re-quantized by our recipe, at int8 when
        it has 5 bits or more (Q5_*, Q6_K, Q8_*), else int4."""
        if qtype in FLOAT_TYPES and qtype != "F16":
            return "fp32"
        if qtype == "F16":
            return "fp16"
        return "int8" if any(c in qtype for c in "5678") else "int4"

    # --- metadata ---------------------------------------------------------------------------------

    def config(self) -> dict:
        """The architecture metadata as a Hugging Face config.json dict (what families/ read)."""
        m, arch = self.metadata, self.arch
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise ConvertError(f"{self.path.name}: GGUF architecture {arch!r:.60} is not supported "
                               f"(supported: {', '.join(ARCHITECTURES)})")
        for k, v in m.items():  # one value each (an array where a number belongs was a TypeError traceback)
            if k.startswith(f"{arch}.") and not isinstance(v, (int, float, str)):
                raise ConvertError(f"{self.path.name} metadata: {k!r:.80} must be a single value, got an array of "
                                   f"{len(v)}")
        for k in FLOAT_KEYS:  # an integer type read its bits as a number: an epsilon of 925,353,388 (a hostile
            v = m.get(f"{arch}.{k}")  # round); llama.cpp refuses a key of the wrong type too
            if v is not None and not isinstance(v, float):
                raise ConvertError(f"{self.path.name} metadata: {arch}.{k} must be stored as a float, got "
                                   f"{type(v).__name__} {v!r:.40}")
        for k in REQUIRED:  # llama.cpp refuses a file without them too (they were guessed: 2048, 1e-6)
            if f"{arch}.{k}" not in m:
                raise ConvertError(f"{self.path.name} metadata: {arch}.{k} is missing (the model's "
                                   f"{REQUIRED[k]})")

        def key(k: str, default=None):
            return m.get(f"{arch}.{k}", default)

        heads = key("attention.head_count")
        hidden = key("embedding_length")
        tokens = m.get("tokenizer.ggml.tokens")
        dims = key("rope.dimension_count")
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            raise ConvertError(f"{self.path.name} metadata: {arch}.rope.dimension_count must be an integer, got {dims!r:.40}")
        cfg = {"model_type": ARCHITECTURES[arch], "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
               "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
               "num_key_value_heads": key("attention.head_count_kv", heads),
               "vocab_size": key("vocab_size", len(tokens) if isinstance(tokens, list) and tokens else None),
               "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
               "rope_theta": key("rope.freq_base", 10000.0),
               "max_position_embeddings": key("context_length"),
               "tie_word_embeddings": "lm_head.weight" not in self,
               "bos_token_id": self._special("tokenizer.ggml.bos_token_id"),
               "eos_token_id": self._special("tokenizer.ggml.eos_token_id"),
               "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self}
        for k in ("attention.key_length", "attention.value_length"):
            v = key(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConvertError(f"{self.path.name} metadata: {arch}.{k} must be a positive integer, got {v!r:.40}")
        if key("attention.key_length") is not None:
            cfg["head_dim"] = key("attention.key_length")
            if key("attention.value_length", cfg["head_dim"]) != cfg["head_dim"]:
                raise ConvertError(f"{self.path.name} metadata: key and value head sizes differ "
                                   f"({arch}.attention.key_length {cfg['head_dim']}, "
                                   f"{arch}.attention.value_length {key('attention.value_length')})")
        if isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
            head_dim = cfg.get("head_dim", hidden // heads)
            if dims is not None and dims != head_dim:  # RoPE on part of each head: not something we build
                source = f"{arch}.attention.key_length" if "head_dim" in cfg else \
                    f"{arch}.embedding_length / {arch}.attention.head_count"
                raise ConvertError(f"{self.path.name} metadata: {arch}.rope.dimension_count {dims} differs from the "
                                   f"head size {head_dim} ({source}): RoPE on part of each head (partial rotary) "
                                   "is not supported")
        # as llama.cpp reads them: the type defaults to linear, the factor falls back to the older key
        # rope.scale_linear, and 0 means none (a factor without a type was dropped: logits off by 49)
        scaling, factor = key("rope.scaling.type"), key("rope.scaling.factor", key("rope.scale_linear"))
        if scaling is None and factor not in (None, 0, 0.0, 1, 1.0):
            scaling = "linear"
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {"type": scaling, "factor": factor if factor not in (None, 0, 0.0) else 1.0}
        attn_factor = key("rope.scaling.attn_factor")
        if attn_factor not in (None, 1, 1.0):  # llama.cpp scales RoPE's cos and sin by it (so q and k)
            raise ConvertError(f"{self.path.name} metadata: {arch}.rope.scaling.attn_factor {attn_factor!r:.40} "
                               "(RoPE scaled by a factor) is not supported")
        causal = key("attention.causal", True)
        if not isinstance(causal, bool):  # (llama.cpp refuses another type too; 1 was called non-causal here)
            raise ConvertError(f"{self.path.name} metadata: {arch}.attention.causal must be a boolean, got "
                               f"{type(causal).__name__} {causal!r:.40}")
        if causal is not True:  # llama.cpp then attends both ways
            raise ConvertError(f"{self.path.name} metadata: {arch}.attention.causal is false: non-causal attention "
                               "(an embedding model) is not supported")
        if key("attention.sliding_window"):
            cfg["use_sliding_window"] = True
        n_tokens = len(tokens) if isinstance(tokens, list) else 0
        if isinstance(cfg["vocab_size"], int) and n_tokens > cfg["vocab_size"]:
            raise ConvertError(f"{self.path.name} metadata: {n_tokens} tokens but {cfg['vocab_size']} embedding rows "
                               "(every token needs one)")
        return cfg

    # --- internals --------------------------------------------------------------------------------

    def _special(self, key: str):
        """A BOS/EOS id: the file's, or llama.cpp's default for a SentencePiece vocabulary."""
        m = self.metadata
        if key in m or m.get("tokenizer.ggml.model") != "llama":
            return m.get(key)
        tokens = m.get("tokenizer.ggml.tokens")
        default = SPM_DEFAULT_IDS.get(key)
        return default if default is not None and isinstance(tokens, list) and default < len(tokens) else None

    def _info(self, name: str, shape: tuple[int, ...] | None = None):
        try:
            info = self._infos[name]
        except KeyError:
            raise ConvertError(f"tensor {name!r} is missing from {self.path.name}") from None
        if shape is not None and tuple(shape) != info[2]:
            raise ConvertError(f"{self.path.name}: tensor {info[0]!r} has shape {list(info[2])}, the metadata "
                               f"implies {list(shape)}")
        return info

    def _raw(self, name: str) -> np.ndarray:
        gname, _, _, offset, nbytes = self._info(name)
        buf = bytearray(nbytes)
        with open(self.path, "rb") as f:
            f.seek(offset)
            got = f.readinto(buf)
        if got != nbytes:
            raise ConvertError(f"{self.path.name}: truncated while reading {gname!r}")
        return np.frombuffer(buf, np.uint8)

    def _row_order(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """llama.cpp permutes Llama's q and k rows (and biases) for its rotary layout; undo it."""
        if self.arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = self.metadata.get("llama.attention.head_count")
        if ".k_proj." in name:
            heads = self.metadata.get("llama.attention.head_count_kv", heads)
        if not isinstance(heads, int) or heads <= 0:
            raise ConvertError(f"{self.path.name} metadata: bad head count {heads!r:.40}")
        key = (shape[0], heads)
        if key not in self._order:
            self._order[key] = gguf_blocks.unpermute_rows(shape[0], heads)
        return self._order[key]

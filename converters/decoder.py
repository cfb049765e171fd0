"""Builds the decoder graph (fused flavour) for every registered family from an `ArchSpec`.

Families differ only in flags on the spec (biases, q/k norm, rope scaling); this module walks the
layers once, reading one layer's tensors from the checkpoint at a time and streaming the
(quantized) weights to the external-data file, so peak memory is about one layer.

Graph interface (version 2; see docs/architecture.md):
  inputs   input_ids     int64 [B, S]
           position_ids  int64 [B, S]          absolute positions: the rows of the tables below
           cos_cache     float32 [R, Dh/2]     cos / sin of RoPE's angles, row p for position p (the
           sin_cache     float32 [R, Dh/2]       host's; R beyond every position and the total length,
                                                 as GroupQueryAttention checks)
           logits_index  int64 [N]             which of the S positions get logits
           the KV mode's extra inputs          (`KVMode.extra_inputs`)
           past_key_values.{i}.key / .value    float32, `KVMode.past_dims`
  outputs  logits        float32 [B, N, V]
           present.{i}.key / .value            float32, `KVMode.present_dims` (keys roped)
A mode that appends in place (`KVMode.in_place`) is built on GroupQueryAttention, which reads the
past and writes this call's rows in one buffer; the other on standard ops, whose present is this
call's new rows for the runtime to place. `widen.choose_kv_mode` is `--attention`'s chooser.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from onnx import TensorProto, helper
from threadpoolctl import threadpool_limits

from edgeinfer.arch import ArchSpec
from edgeinfer.converters import graph as G
from edgeinfer.converters.calibration import Calibration, Peak
from edgeinfer.converters.gguf_blocks import Blocks, q4_1_blocks, stack
from edgeinfer.converters.gguf_checkpoint import FLOAT_TYPES
from edgeinfer.converters.kept_graph import kept_gather, kept_linear, kept_matmul, kept_weight
from edgeinfer.converters.quantize import QuantScheme, bits_of, quantize_blockwise
from edgeinfer.converters.rows import Rows, checked
from edgeinfer.converters.safetensors_io import Checkpoint
from edgeinfer.errors import ConvertError
from edgeinfer.kv_mode import NAMES, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, KVMode
from edgeinfer.interface import ROPE_COS, ROPE_SIN, io_names

IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


KIND_WIDTH = ("int4", "int8", "fp16", "fp32")  # narrowest first: a stacked projection takes its widest part's


class TensorSource:
    """Reads named tensors with shape checks and remembers which were used.

    `keep` (a GGUF source converted with `--quant keep`): Q8_0 / Q4_0 / Q4_1 matrices come as the
    file's blocks (`blocks`, `projection`), taken over exactly; any other tensor is stored as its
    type implies (`ckpt.stored_kind`: floats as they are, other quantized types re-quantized by our
    recipe at the nearest width, listed in `requantized`).
    """

    def __init__(self, ckpt: Checkpoint, keep: bool = False):
        self.ckpt = ckpt
        self.keep = keep
        self.used: set[str] = set()
        self.requantized: dict[str, str] = {}  # name -> "Q6_K -> int8": what it was, what it is stored as
        self.kept_types: set[str] = set()  # GGUF types of the tensors whose blocks were taken over exactly

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as a float array; ConvertError if it holds NaN or infinity (quantizing would
        hide it: a block's scale skips a NaN, and the weight becomes an arbitrary code)."""
        self.used.add(name)
        return checked(name, self.ckpt.read(name, shape))

    def rows(self, name: str, shape: tuple[int, int]) -> Rows:
        """A 2-D tensor to read a slice of rows at a time (`rows.Rows`), with `get`'s checks on each slice."""
        self.used.add(name)
        return Rows(self.ckpt, name, shape)

    def maybe(self, name: str, shape: tuple[int, ...], present: bool) -> np.ndarray | None:
        if not present:
            return None
        return self.get(name, shape)

    def blocks(self, name: str, shape: tuple[int, ...]) -> Blocks | None:
        """The tensor's GGUF blocks when kept (`keep` and a kept type), else None."""
        b = self.ckpt.blocks(name, shape) if self.keep else None
        if b is not None:
            self.used.add(name)
        return b

    def stored_kind(self, name: str) -> str:
        """With `keep`: how a tensor that is not taken over as blocks is stored (its type's kind)."""
        return self.stored_as([name], self.ckpt.stored_kind(self.ckpt.gguf_type(name)))

    def stored_as(self, names: list[str], kind: str) -> str:
        """Record that tensors `names` are stored as `kind` though not as their blocks (the manifest's
        `requantized`: each quantized one as it really is stored, a kept type included); returns kind."""
        for name in names:
            qtype = self.ckpt.gguf_type(name)
            if qtype not in FLOAT_TYPES:
                self.requantized[name] = f"{qtype} -> {kind}"
        return kind

    def kept(self, names: list[str], b: Blocks) -> Blocks:
        """Record that tensors `names` are stored as their own blocks `b`; returns b."""
        self.kept_types.update(self.ckpt.gguf_type(n) for n in names)
        return b

    def projection(self, parts: list[tuple[str, tuple[int, int]]], kind: str) -> tuple[np.ndarray | Blocks, str]:
        """One projection's [N, K] weight with its parts (q|k|v, gate|up) stacked along N, and the
        kind to store it as: `kind`, or with `keep` the parts' blocks stacked exactly, or else the
        widest kind the parts' types imply (every part then stored at that kind, and recorded so)."""
        names = [n for n, _ in parts]
        if self.keep:
            blocks = [self.blocks(n, s) for n, s in parts]
            if all(b is not None for b in blocks):
                try:
                    return self.kept(names, blocks[0] if len(blocks) == 1 else stack(blocks)), kind
                except ValueError:
                    pass
            widest = max((self.ckpt.stored_kind(self.ckpt.gguf_type(n)) for n in names), key=KIND_WIDTH.index)
            kind = self.stored_as(names, widest)
        arrays = [self.get(n, s) for n, s in parts]
        return (arrays[0] if len(arrays) == 1 else np.concatenate(arrays)), kind

    def check_all_used(self) -> None:
        extra = sorted(n for n in self.ckpt.tensors if n not in self.used and not n.endswith(IGNORED_TENSOR_SUFFIXES))
        if extra:
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            raise ConvertError(f"checkpoint has tensors this architecture does not use: {', '.join(extra[:3])}{more}")


def tied_head(spec: ArchSpec, ckpt) -> bool:
    """Whether the lm_head is the embedding; ConvertError when the config says it is not and the
    checkpoint has none (transformers would start such a head at random: a model of noise)."""
    if not spec.tie_word_embeddings and "lm_head.weight" not in ckpt:
        raise ConvertError("the checkpoint has no lm_head.weight, but tie_word_embeddings is false (its default when "
                           "config.json leaves it out): the model's output layer is missing")
    return spec.tie_word_embeddings


def check_embedding_blocks(spec: ArchSpec, scheme: QuantScheme) -> None:
    """ConvertError when the scheme quantizes the embedding by blocks that do not divide its rows
    (GatherBlockQuantized takes whole blocks); `convert` calls it before any work."""
    if scheme.embedding in ("int4", "int8") and spec.hidden_size % scheme.block_size:
        raise ConvertError(f"hidden size {spec.hidden_size} is not a multiple of block {scheme.block_size}: "
                           "use --embedding fp32 or fp16, or a --block-size that divides it")


def embedding_and_head(g: G.Graph, spec: ArchSpec, src: TensorSource, scheme: QuantScheme,
                       input_ids: str, calibrated: bool = False) -> tuple[str, callable]:
    """Returns the embedded ids [B, S, D] and head(x, x_cal=None), which maps normed hidden [B, N, D]
    to logits (x_cal: x on the calibration text [tokens, D], for the gptq recipe).

    A tied, quantized embedding is stored once: MatMulNBits reads the packed blocks as the
    lm_head and GatherBlockQuantized reads the same initializer (reshaped) as the embedding. With
    the gptq recipe (`calibrated`) those blocks are fitted to the head's input, known only after
    the last layer: the embedding's nodes are then made by head() and moved to the front, where
    the graph reads them first.
    """
    V, D = spec.vocab_size, spec.hidden_size
    tied = tied_head(spec, src.ckpt)
    kept = src.blocks("model.embed_tokens.weight", (V, D))
    if kept is not None:
        src.kept(["model.embed_tokens.weight"], kept)
    if kept is None and not src.keep and scheme.recipe == "q4_1" and scheme.embedding == "int4" and D % 32 == 0:
        kept = q4_1_blocks(src.get("model.embed_tokens.weight", (V, D)))
    if kept is not None:
        return _kept_embedding_and_head(g, spec, src, scheme, input_ids, kept, tied)
    if calibrated and tied and not src.keep and scheme.embedding == "int4" and D % scheme.block_size == 0:
        return _fitted_tied_embedding(g, spec, src, scheme, input_ids)  # (read a slice at a time, at the end)
    head_w = head_kind = None
    if src.keep:  # an embedding that is not blocks is stored as its type implies; an untied head on its own
        scheme = replace(scheme, embedding=src.stored_kind("model.embed_tokens.weight"))
        if not tied:
            head_w, head_kind = src.projection([("lm_head.weight", (V, D))], scheme.lm_head)
    emb = src.get("model.embed_tokens.weight", (V, D))
    if not tied and head_w is None:
        head_w = src.get("lm_head.weight", (V, D))
    p_emb, p_head = "/model/embed_tokens", "/lm_head"
    own_head = head_kind is not None  # keep: the untied head as its own type says
    head_kind = head_kind or (scheme.embedding if tied else scheme.lm_head)
    share_quant = tied and scheme.embedding in ("int4", "int8") and D % scheme.block_size == 0

    def head(x: str, x_cal: np.ndarray | None = None) -> str:
        if own_head:
            return _linear(g, p_head, x, head_w, None, head_kind, scheme, x_cal)
        if head_kind in ("int4", "int8") and share_quant:
            ins = [x, "lm_head.qweight", sc] + (["lm_head.zero_points"] if not scheme.symmetric else [])
            (y,) = g.node("MatMulNBits", ins, f"{p_head}/MatMulNBits", domain=G.MS, K=D, N=V,
                          bits=bits_of(head_kind), block_size=scheme.block_size, accuracy_level=scheme.accuracy_level)
            return y
        if head_kind in ("int4", "int8"):
            return G.linear(g, p_head, x, emb if tied else head_w, None, head_kind, scheme, x_cal)
        # float head: Gemm with transB reads the [V, D] matrix as stored (shared with the embedding when tied)
        w_name = "model.embed_tokens.weight" if tied else g.weight(
            "lm_head.weight", head_w.astype(np.float16 if head_kind == "fp16" else np.float32))
        if head_kind == "fp16":
            (w_name,) = g.node("Cast", [w_name], f"{p_head}/Cast", to=TensorProto.FLOAT)
        (flat,) = g.node("Reshape", [x, g.const("shape_rows_D", np.array([-1, D], np.int64))], f"{p_head}/Reshape")
        (y,) = g.node("Gemm", [flat, w_name], f"{p_head}/Gemm", transB=1)
        (shape,) = g.node("Shape", [x], f"{p_head}/Shape", end=2)
        (out_shape,) = g.node("Concat", [shape, g.const("shape_V", np.array([V], np.int64))], f"{p_head}/Concat", axis=0)
        (y,) = g.node("Reshape", [y, out_shape], f"{p_head}/OutReshape")
        return y

    kind = scheme.embedding
    if kind in ("int4", "int8"):
        bits = bits_of(kind)
        if share_quant:
            packed, scales, zp = quantize_blockwise(emb, bits, scheme.block_size, scheme.symmetric, scheme.recipe)
            qw, sc = g.weight("lm_head.qweight", packed), G.block_scales(g, "lm_head.scales", scales, scheme)
            zps = [g.weight("lm_head.zero_points", zp)] if zp is not None else []
            (data,) = g.node("Reshape", [qw, g.const("shape_emb_packed", np.array([V, D * bits // 8], np.int64))],
                             f"{p_emb}/Reshape")
        else:
            check_embedding_blocks(spec, scheme)
            packed, scales, zp = quantize_blockwise(emb, bits, scheme.block_size, scheme.symmetric, scheme.recipe)
            data = g.weight("model.embed_tokens.qweight", packed.reshape(V, -1))
            sc = G.block_scales(g, "model.embed_tokens.scales", scales, scheme)
            zps = [g.weight("model.embed_tokens.zero_points", zp)] if zp is not None else []
        (h,) = g.node("GatherBlockQuantized", [data, input_ids, sc, *zps], f"{p_emb}/GatherBlockQuantized",
                      domain=G.MS, gather_axis=0, quantize_axis=1, block_size=scheme.block_size, bits=bits)
    else:
        table = g.weight("model.embed_tokens.weight", emb.astype(np.float16 if kind == "fp16" else np.float32))
        (h,) = g.node("Gather", [table, input_ids], f"{p_emb}/Gather", axis=0)
        if kind == "fp16":
            (h,) = g.node("Cast", [h], f"{p_emb}/Cast", to=TensorProto.FLOAT)
    return h, head


def _fitted_tied_embedding(g: G.Graph, spec: ArchSpec, src: TensorSource, scheme: QuantScheme,
                           input_ids: str) -> tuple[str, callable]:
    """`embedding_and_head`'s tied int4 blocks under the gptq recipe: quantized by head(x, x_cal) with
    the head's input on the calibration text; the embedding's nodes (made then) go where the graph starts."""
    V, D = spec.vocab_size, spec.hidden_size
    at, p_emb = len(g.nodes), "/model/embed_tokens"
    h = f"{p_emb}/GatherBlockQuantized/output_0"

    def head(x: str, x_cal: np.ndarray | None = None) -> str:
        packed, scales, zp = quantize_blockwise(src.rows("model.embed_tokens.weight", (V, D)), 4, scheme.block_size,
                                                scheme.symmetric, scheme.recipe, x_cal)
        first = len(g.nodes)
        qw, sc = g.weight("lm_head.qweight", packed), G.block_scales(g, "lm_head.scales", scales, scheme)
        zps = [g.weight("lm_head.zero_points", zp)]
        del packed
        (data,) = g.node("Reshape", [qw, g.const("shape_emb_packed", np.array([V, D // 2], np.int64))],
                         f"{p_emb}/Reshape")
        g.node("GatherBlockQuantized", [data, input_ids, sc, *zps], f"{p_emb}/GatherBlockQuantized", domain=G.MS,
               gather_axis=0, quantize_axis=1, block_size=scheme.block_size, bits=4, outputs=[h])
        made = g.nodes[first:]
        del g.nodes[first:]
        g.nodes[at:at] = made  # before the layers that read h
        (y,) = g.node("MatMulNBits", [x, qw, sc, *zps], "/lm_head/MatMulNBits", domain=G.MS, K=D, N=V, bits=4,
                      block_size=scheme.block_size, accuracy_level=scheme.accuracy_level)
        return y

    return h, head


def _kept_embedding_and_head(g: G.Graph, spec: ArchSpec, src: TensorSource, scheme: QuantScheme, input_ids: str,
                             emb: Blocks, tied: bool) -> tuple[str, callable]:
    """`embedding_and_head` for an embedding taken over as GGUF blocks (`kept_graph`); a tied head
    is MatMulNBits over the same initializers."""
    V, D = spec.vocab_size, spec.hidden_size
    w = kept_weight(g, "lm_head" if tied else "model.embed_tokens", emb, scheme.accuracy_level)
    h = kept_gather(g, "/model/embed_tokens", w, input_ids)

    def head(x: str, x_cal: np.ndarray | None = None) -> str:
        if tied:
            return kept_matmul(g, "/lm_head", x, w, scheme.accuracy_level)
        head_w, kind = src.projection([("lm_head.weight", (V, D))], scheme.lm_head)
        return _linear(g, "/lm_head", x, head_w, None, kind, scheme, x_cal)

    return h, head


def _linear(g: G.Graph, prefix: str, x: str, w: np.ndarray | Blocks, bias, kind: str, scheme: QuantScheme,
            x_cal: np.ndarray | None = None) -> str:
    """`graph.linear` (x_cal: x on the calibration text, for the gptq recipe), or `kept_graph.kept_linear`
    for blocks taken over from a GGUF file or made by the q4_1 recipe (int4 weights whose rows are
    whole blocks)."""
    if not isinstance(w, Blocks) and kind == "int4" and scheme.recipe == "q4_1" and w.shape[1] % 32 == 0:
        w = q4_1_blocks(w)
    if isinstance(w, Blocks):
        return kept_linear(g, prefix, x, w, bias, scheme.accuracy_level)
    return G.linear(g, prefix, x, w, bias, kind, scheme, x_cal)


ATTENTION_CHOICES = ("auto", *NAMES)  # `convert --attention`: a KV mode's name, or auto


def build_decoder(spec: ArchSpec, src: TensorSource, scheme: QuantScheme, writer, mode: KVMode,
                  calibration_ids: np.ndarray | None = None) -> tuple["onnx.ModelProto", Peak | None]:  # noqa: F821
    """The decoder graph, and the largest activation on the calibration rows (None without them).
    calibration_ids [n, T] (`calibration.plan`): the float model runs on them alongside
    (`calibration.Calibration`), and under the gptq recipe each int4 projection is quantized with its
    input there (`gptq.gptq_int4`), BLAS on one thread (the work is spread over the cores by rows
    instead: the same sums, and so the same bytes, whatever the core count)."""
    if calibration_ids is None:
        return _build(spec, src, scheme, writer, mode, None), None
    with threadpool_limits(1, "blas"):
        rows = src.rows("model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size)).take(calibration_ids)
        cal = Calibration(spec, calibration_ids, rows)
        return _build(spec, src, scheme, writer, mode, cal), cal.peak


def _build(spec: ArchSpec, src: TensorSource, scheme: QuantScheme, writer, mode: KVMode,
           cal: Calibration | None) -> "onnx.ModelProto":  # noqa: F821
    g = G.Graph(writer)
    names = io_names(spec.num_layers)
    D, H, Hkv, Dh, I = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    eps = spec.rms_norm_eps

    fitted = cal is not None and scheme.recipe == "gptq"  # (rows there only for `Calibration.peak`: not fitted)
    h, head = embedding_and_head(g, spec, src, scheme, "input_ids", calibrated=fitted)
    cos, sin, positions = ROPE_COS, ROPE_SIN, "position_ids"  # graph inputs: the host's table, row = position
    gqa = mode.in_place  # GroupQueryAttention reads the past and appends the new rows in the one buffer
    packed = gqa and not spec.qk_norm  # q/k norms sit between the projection and RoPE: those need them apart
    mask = None if gqa else G.causal_mask(g, "input_ids", names.past_key(0))

    residual, normed, mlp_out = h, None, None
    for i in range(spec.num_layers):
        hf, p = f"model.layers.{i}", f"/model/layers.{i}"
        ln_in = src.get(f"{hf}.input_layernorm.weight", (D,))
        if i == 0:
            normed = G.rms_norm(g, f"{p}/input_layernorm", residual, ln_in, eps)
        else:
            normed, residual = G.skip_rms_norm(g, f"{p}/input_layernorm", mlp_out, residual, ln_in, eps)

        a = f"{hf}.self_attn"
        w_qkv, qkv_kind = src.projection([(f"{a}.q_proj.weight", (H * Dh, D)), (f"{a}.k_proj.weight", (Hkv * Dh, D)),
                                          (f"{a}.v_proj.weight", (Hkv * Dh, D))], scheme.kind_for("qkv_proj"))
        b_qkv = None
        if spec.qkv_bias:
            b_qkv = np.concatenate([src.get(f"{a}.q_proj.bias", (H * Dh,)), src.get(f"{a}.k_proj.bias", (Hkv * Dh,)),
                                    src.get(f"{a}.v_proj.bias", (Hkv * Dh,))])
        q_norm = src.get(f"{a}.q_norm.weight", (Dh,)) if spec.qk_norm else None
        k_norm = src.get(f"{a}.k_norm.weight", (Dh,)) if spec.qk_norm else None
        x_cal = cal.attention_input(ln_in) if cal else None
        qkv = _linear(g, f"{p}/attn/qkv_proj", normed, w_qkv, b_qkv, qkv_kind, scheme, x_cal)
        x_cal = cal.attention(w_qkv, b_qkv, q_norm, k_norm) if cal else None
        del w_qkv
        past_k, past_v, present_k, present_v = (names.past_key(i), names.past_value(i), names.present_key(i),
                                                names.present_value(i))
        if packed:  # one node: q|k|v in, RoPE and attention inside
            ctx = G.gqa_packed_attention(g, f"{p}/attn", qkv, past_k, past_v, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
                                         cos, sin, positions, H, Hkv, present_k, present_v)
        else:
            q, k, v = G.split_last(g, f"{p}/attn/qkv_proj", qkv, [H * Dh, Hkv * Dh, Hkv * Dh])
            if spec.qk_norm:
                q = _head_norm(g, f"{p}/attn/q_norm", q, q_norm, H, Dh, eps)
                k = _head_norm(g, f"{p}/attn/k_norm", k, k_norm, Hkv, Dh, eps)
            q = G.rotary(g, f"{p}/attn/q_rotary", q, positions, cos, sin, H)
            k = G.rotary(g, f"{p}/attn/k_rotary", k, positions, cos, sin, Hkv)
            if gqa:
                ctx = G.gqa_attention(g, f"{p}/attn", q, k, v, past_k, past_v, SEQLENS_K, TOTAL_SEQUENCE_LENGTH,
                                      H, Hkv, present_k, present_v)
            else:
                ctx = G.attention(g, f"{p}/attn", q, k, v, past_k, past_v, mask, H, Hkv, Dh, present_k, present_v)
        o_b = src.maybe(f"{a}.o_proj.bias", (D,), spec.o_bias)
        w_o, o_kind = src.projection([(f"{a}.o_proj.weight", (D, H * Dh))], scheme.kind_for("o_proj"))
        attn_out = _linear(g, f"{p}/attn/o_proj", ctx, w_o, o_b, o_kind, scheme, x_cal)
        post_ln = src.get(f"{hf}.post_attention_layernorm.weight", (D,))
        x_cal = cal.mlp_input(w_o, o_b, post_ln) if cal else None
        del w_o

        normed, residual = G.skip_rms_norm(g, f"{p}/post_attention_layernorm", attn_out, residual, post_ln, eps)
        m = f"{hf}.mlp"
        w_gu, gu_kind = src.projection([(f"{m}.gate_proj.weight", (I, D)), (f"{m}.up_proj.weight", (I, D))],
                                       scheme.kind_for("gate_up_proj"))
        gu = _linear(g, f"{p}/mlp/gate_up_proj", normed, w_gu, None, gu_kind, scheme, x_cal)
        x_cal = cal.mlp_act(w_gu) if cal else None
        del w_gu
        gate, up = G.split_last(g, f"{p}/mlp/gate_up_proj", gu, [I, I])
        act = G.silu_mul(g, f"{p}/mlp", gate, up)
        w_down, down_kind = src.projection([(f"{m}.down_proj.weight", (D, I))], scheme.kind_for("down_proj"))
        mlp_out = _linear(g, f"{p}/mlp/down_proj", act, w_down, None, down_kind, scheme, x_cal)
        if cal:
            cal.end_layer(w_down)
        del w_down, x_cal

    (final,) = g.node("Add", [mlp_out, residual], "/model/final/Add")
    (picked,) = g.node("Gather", [final, "logits_index"], "/model/final/Gather", axis=1)  # [B, N, D]
    norm = src.get("model.norm.weight", (D,))
    normed = G.rms_norm(g, "/model/norm", picked, norm, eps)
    logits = head(normed, cal.head_input(norm) if cal else None)
    g.node("Identity", [logits], "/model/logits/Identity", outputs=["logits"])
    src.check_all_used()
    return _model(g, spec, names, mode)


def _head_norm(g: G.Graph, prefix: str, x: str, weight: np.ndarray, heads: int, dh: int, eps: float) -> str:
    """Per-head RMSNorm (Qwen3): [B, S, heads*Dh] -> [B, S, heads, Dh] -> norm -> back."""
    (x4,) = g.node("Reshape", [x, g.const(f"shape_heads_{heads}_{dh}", np.array([0, 0, heads, dh], np.int64))],
                   f"{prefix}/Reshape")
    y = G.rms_norm(g, prefix, x4, weight, eps)
    (y,) = g.node("Reshape", [y, g.const(f"shape_flat_{heads * dh}", np.array([0, 0, heads * dh], np.int64))],
                  f"{prefix}/ReshapeBack")
    return y


def _model(g: G.Graph, spec: ArchSpec, names, mode: KVMode) -> "onnx.ModelProto":  # noqa: F821
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv = mode.past_dims(spec.num_kv_heads, spec.head_dim)
    new_kv = mode.present_dims(spec.num_kv_heads, spec.head_dim)
    half = spec.head_dim // 2
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("position_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info(ROPE_COS, f32, ["rope_rows", half]),
              helper.make_tensor_value_info(ROPE_SIN, f32, ["rope_rows", half]),
              helper.make_tensor_value_info("logits_index", i64, ["num_logits"])]
    inputs += [helper.make_tensor_value_info(e.name, helper.np_dtype_to_tensor_dtype(np.dtype(e.dtype)), list(e.dims))
               for e in mode.extra_inputs]
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "num_logits", spec.vocab_size])]
    for i in range(spec.num_layers):
        inputs += [helper.make_tensor_value_info(names.past_key(i), f32, kv),
                   helper.make_tensor_value_info(names.past_value(i), f32, kv)]
        outputs += [helper.make_tensor_value_info(names.present_key(i), f32, new_kv),
                    helper.make_tensor_value_info(names.present_value(i), f32, new_kv)]
    graph = helper.make_graph(g.nodes, "edgeinfer_decoder", inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(G.MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10, producer_name="edgeinfer")

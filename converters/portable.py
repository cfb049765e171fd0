"""Builds the portable graphs (`convert --target coreml|nnapi`): standard ONNX ops on the CoreML ML
Program and NNAPI supported lists only, every shape static, so that those execution providers take
each graph whole (ONNX Runtime's `check_onnx_model_mobile_usability` is the judge; tests/test_portable.py).

Two graphs, one set of nodes and one weights file: `model.onnx` decodes 1 token, `prefill.onnx`
takes a chunk of P tokens (padded); they differ only in their input and output shapes, because
every Reshape uses -1 for the sequence. What the EPs lack is done on the host (`portable_engine.py`):

    inputs   inputs_embeds   f32 [1, S, D]          the embedding rows (the host gathers them)
             rope_cos        f32 [1, 1, S, Dh]      cos(pos * inv_freq), both halves
             rope_sin        f32 [1, 1, S, Dh]      sin(...) with the first half negated (rotate-half)
             attention_mask  f32 [1, 1, G*S, R+S]   additive: 0 where query row may see the column,
                                                    MASK_VALUE elsewhere; rows are (group, query)
             logits_select   f32 [1, 1, S]          one-hot: the position whose logits are wanted
             past_key_values.{i}.key / .value  f32 [1, Hkv, R, Dh]   the whole ring (R rows, fixed)
    outputs  logits.{c}      f32 [1, 1, Vc]         the vocabulary in chunks of at most 16,384
             present.{i}.key / .value          f32 [1, Hkv, S, Dh]   this call's rows (keys roped),
                                                    which the host writes into the ring

G = H / Hkv query heads per KV head: queries are grouped as [1, Hkv, G*S, Dh] so attention needs
no Expand/Tile (NNAPI has neither). RMSNorm is decomposed (Mul, ReduceMean, Add, Sqrt, Div, Mul).
Weights: fp32, fp16 (a Cast after each; CoreML's choice) or int8 per output channel with a
constant DequantizeLinear (NNAPI's; CoreML ML Program does not list DequantizeLinear).
Opset 17 (ReduceMean's axes an attribute). Node names follow the fused builder's scheme.
"""

from __future__ import annotations

import copy

import numpy as np
from onnx import TensorProto, helper

from edgeinfer.arch import ArchSpec
from edgeinfer.converters import graph as G
from edgeinfer.converters.decoder import TensorSource, tied_head
from edgeinfer.converters.safetensors_io import Checkpoint
from edgeinfer.errors import ConvertError
from edgeinfer.interface import io_names
from edgeinfer.portable import MAX_DIM, PortableInfo, logit_chunks

OPSET = 17
WEIGHT_KINDS = ("fp32", "fp16", "int8")


def _linear(g: G.Graph, prefix: str, x: str, w_out_in: np.ndarray, bias: np.ndarray | None, kind: str) -> str:
    """y = x @ W^T (+ b) with W stored [K, N] in fp32, fp16 (+Cast) or int8 (+DequantizeLinear)."""
    w = np.ascontiguousarray(w_out_in.T.astype(np.float32))
    if kind == "fp32":
        wname = g.weight(f"{prefix}.weight", w)
    elif kind == "fp16":
        (wname,) = g.node("Cast", [g.weight(f"{prefix}.weight", w.astype(np.float16))], f"{prefix}/Cast",
                          to=TensorProto.FLOAT)
    else:  # int8, symmetric per output channel
        scale = np.maximum(np.abs(w).max(axis=0), 1e-12).astype(np.float32) / 127.0
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        (wname,) = g.node("DequantizeLinear", [g.weight(f"{prefix}.qweight", q), g.weight(f"{prefix}.scale", scale),
                                               g.weight(f"{prefix}.zero_point", np.zeros(w.shape[1], np.int8))],
                          f"{prefix}/DequantizeLinear", axis=1)
    (y,) = g.node("MatMul", [x, wname], f"{prefix}/MatMul")
    if bias is not None:
        (y,) = g.node("Add", [y, g.weight(f"{prefix}.bias", bias.astype(np.float32))], f"{prefix}/Add")
    return y


def _rms_norm(g: G.Graph, prefix: str, x: str, weight: np.ndarray, eps: float) -> str:
    """x / sqrt(mean(x^2, last axis) + eps) * weight, in listed ops."""
    (sq,) = g.node("Mul", [x, x], f"{prefix}/Square")
    (ms,) = g.node("ReduceMean", [sq], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
    (ms,) = g.node("Add", [ms, g.const(f"eps_{eps:g}", np.array(eps, np.float32))], f"{prefix}/AddEps")
    (rms,) = g.node("Sqrt", [ms], f"{prefix}/Sqrt")
    (y,) = g.node("Div", [x, rms], f"{prefix}/Div")
    (y,) = g.node("Mul", [y, g.weight(f"{prefix}.weight", weight.astype(np.float32))], f"{prefix}/Mul")
    return y


def _heads(g: G.Graph, prefix: str, x: str, heads: int, dh: int) -> str:
    """[1, S, heads*Dh] -> [1, heads, S, Dh]."""
    (y,) = g.node("Reshape", [x, g.const(f"shape_1_s_{heads}_{dh}", np.array([1, -1, heads, dh], np.int64))],
                  f"{prefix}/Reshape")
    (y,) = g.node("Transpose", [y], f"{prefix}/Transpose", perm=[0, 2, 1, 3])
    return y


def _rope(g: G.Graph, prefix: str, x: str, dh: int) -> str:
    """x * cos + [x2, x1] * sin_signed on [1, heads, S, Dh] (rotate-half, transformers' convention)."""
    half = dh // 2
    (x1,) = g.node("Slice", [x, g.const("zero", np.array([0], np.int64)), g.const(f"half_{half}", np.array([half], np.int64)),
                             g.const("axis3", np.array([3], np.int64))], f"{prefix}/SliceLow")
    (x2,) = g.node("Slice", [x, g.const(f"half_{half}", np.array([half], np.int64)),
                             g.const(f"dh_{dh}", np.array([dh], np.int64)), g.const("axis3", np.array([3], np.int64))],
                   f"{prefix}/SliceHigh")
    (swapped,) = g.node("Concat", [x2, x1], f"{prefix}/Concat", axis=3)
    (a,) = g.node("Mul", [x, "rope_cos"], f"{prefix}/MulCos")
    (b,) = g.node("Mul", [swapped, "rope_sin"], f"{prefix}/MulSin")
    (y,) = g.node("Add", [a, b], f"{prefix}/Add")
    return y


def build_portable(spec: ArchSpec, ckpt: Checkpoint, weights: str, writer, info: PortableInfo
                   ) -> tuple["onnx.ModelProto", "onnx.ModelProto", np.ndarray]:  # noqa: F821
    """(decode graph, prefill graph, embedding table [V, D] as stored) for `spec`."""
    if weights not in WEIGHT_KINDS:
        raise ConvertError(f"the portable graph stores weights as {', '.join(WEIGHT_KINDS)}, not {weights}")
    if spec.qk_norm:
        raise ConvertError("the portable graph does not express per-head q/k norms (Qwen3) yet: use --target cpu")
    g = G.Graph(writer)
    src = TensorSource(ckpt)
    D, H, Hkv, Dh, I = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    Gq, eps, names = H // Hkv, spec.rms_norm_eps, io_names(spec.num_layers)
    for dim, what in ((D, "hidden size"), (I, "intermediate size"), (info.ring_rows + info.prefill_tokens, "ring"),
                      (Gq * info.prefill_tokens, "grouped query rows (query heads per KV head x prefill tokens)")):
        if dim > MAX_DIM:
            raise ConvertError(f"the {what} {dim} is over {MAX_DIM}, the largest dimension CoreML takes")
    emb = src.get("model.embed_tokens.weight", (spec.vocab_size, D))
    tied = tied_head(spec, ckpt)
    head_w = emb if tied else src.get("lm_head.weight", (spec.vocab_size, D))
    scale = g.const(f"attn_scale_{Dh}", np.array(1.0 / np.sqrt(Dh), np.float32))

    x = "inputs_embeds"
    for i in range(spec.num_layers):
        hf, p = f"model.layers.{i}", f"/model/layers.{i}"
        a = f"{hf}.self_attn"
        xn = _rms_norm(g, f"{p}/input_layernorm", x, src.get(f"{hf}.input_layernorm.weight", (D,)), eps)
        proj = {}
        for name, rows in (("q", H * Dh), ("k", Hkv * Dh), ("v", Hkv * Dh)):
            b = src.maybe(f"{a}.{name}_proj.bias", (rows,), spec.qkv_bias)
            proj[name] = _linear(g, f"{p}/attn/{name}_proj", xn, src.get(f"{a}.{name}_proj.weight", (rows, D)), b, weights)
        q = _rope(g, f"{p}/attn/q_rotary", _heads(g, f"{p}/attn/q", proj["q"], H, Dh), Dh)
        k = _rope(g, f"{p}/attn/k_rotary", _heads(g, f"{p}/attn/k", proj["k"], Hkv, Dh), Dh)
        v = _heads(g, f"{p}/attn/v", proj["v"], Hkv, Dh)
        g.node("Identity", [k], f"{p}/attn/present_key", outputs=[names.present_key(i)])
        g.node("Identity", [v], f"{p}/attn/present_value", outputs=[names.present_value(i)])
        (k_all,) = g.node("Concat", [names.past_key(i), k], f"{p}/attn/k_cat", axis=2)  # [1, Hkv, R+S, Dh]
        (v_all,) = g.node("Concat", [names.past_value(i), v], f"{p}/attn/v_cat", axis=2)
        (qg,) = g.node("Reshape", [q, g.const(f"shape_groups_{Hkv}_{Dh}", np.array([1, Hkv, -1, Dh], np.int64))],
                       f"{p}/attn/q_groups")  # [1, Hkv, G*S, Dh]: head h = kv * G + g
        (kt,) = g.node("Transpose", [k_all], f"{p}/attn/k_T", perm=[0, 1, 3, 2])
        (sc,) = g.node("MatMul", [qg, kt], f"{p}/attn/QK")
        (sc,) = g.node("Mul", [sc, scale], f"{p}/attn/Scale")
        (sc,) = g.node("Add", [sc, "attention_mask"], f"{p}/attn/Mask")
        (pr,) = g.node("Softmax", [sc], f"{p}/attn/Softmax", axis=-1)
        (ctx,) = g.node("MatMul", [pr, v_all], f"{p}/attn/PV")  # [1, Hkv, G*S, Dh]
        (ctx,) = g.node("Reshape", [ctx, g.const(f"shape_heads_{H}_{Dh}", np.array([1, H, -1, Dh], np.int64))],
                        f"{p}/attn/ctx_heads")
        (ctx,) = g.node("Transpose", [ctx], f"{p}/attn/ctx_T", perm=[0, 2, 1, 3])
        (ctx,) = g.node("Reshape", [ctx, g.const(f"shape_flat_{H * Dh}", np.array([1, -1, H * Dh], np.int64))],
                        f"{p}/attn/ctx_flat")
        o_b = src.maybe(f"{a}.o_proj.bias", (D,), spec.o_bias)
        attn = _linear(g, f"{p}/attn/o_proj", ctx, src.get(f"{a}.o_proj.weight", (D, H * Dh)), o_b, weights)
        (x,) = g.node("Add", [x, attn], f"{p}/attn/residual")
        m = f"{hf}.mlp"
        xn = _rms_norm(g, f"{p}/post_attention_layernorm", x, src.get(f"{hf}.post_attention_layernorm.weight", (D,)),
                       eps)
        gate = _linear(g, f"{p}/mlp/gate_proj", xn, src.get(f"{m}.gate_proj.weight", (I, D)), None, weights)
        up = _linear(g, f"{p}/mlp/up_proj", xn, src.get(f"{m}.up_proj.weight", (I, D)), None, weights)
        (sg,) = g.node("Sigmoid", [gate], f"{p}/mlp/Sigmoid")
        (act,) = g.node("Mul", [gate, sg], f"{p}/mlp/SiLU")
        (act,) = g.node("Mul", [act, up], f"{p}/mlp/GateUp")
        down = _linear(g, f"{p}/mlp/down_proj", act, src.get(f"{m}.down_proj.weight", (D, I)), None, weights)
        (x,) = g.node("Add", [x, down], f"{p}/mlp/residual")

    (picked,) = g.node("MatMul", ["logits_select", x], "/model/final/Select")  # [1, 1, D]
    normed = _rms_norm(g, "/model/norm", picked, src.get("model.norm.weight", (D,)), eps)
    for c, (lo, hi) in enumerate(logit_chunks(spec.vocab_size)):
        y = _linear(g, f"/lm_head.{c}", normed, head_w[lo:hi], None, weights)
        g.node("Identity", [y], f"/lm_head.{c}/Identity", outputs=[f"logits.{c}"])
    src.check_all_used()
    g.nodes = _outputs_named_at_source(g.nodes)
    decode = _model(g, spec, info, 1)
    prefill = _model(g, spec, info, info.prefill_tokens)
    return decode, prefill, emb


def _outputs_named_at_source(nodes: list) -> list:
    """`nodes` without the Identity nodes that name graph outputs (present.*, logits.*): the node that
    computes each tensor names it, and the nodes that read it read that name. ONNX Runtime 1.23's
    CoreML MLProgram EP (the newest runtime with Python 3.10 wheels) takes no Identity, so stories260K's
    decode graph ran 11 of its 290 nodes on the CPU; each such Identity reads a tensor one node makes."""
    made = {o for n in nodes for o in n.output}
    rename = {}
    for n in nodes:
        if n.op_type == "Identity":
            assert n.input[0] in made and n.input[0] not in rename, n.name
            rename[n.input[0]] = n.output[0]
    kept = []
    for n in nodes:
        if n.op_type != "Identity":
            n = copy.deepcopy(n)
            n.input[:] = [rename.get(t, t) for t in n.input]
            n.output[:] = [rename.get(t, t) for t in n.output]
            kept.append(n)
    return kept


def _model(g: G.Graph, spec: ArchSpec, info: PortableInfo, s: int) -> "onnx.ModelProto":  # noqa: F821
    f32 = TensorProto.FLOAT
    Hkv, Dh, R = spec.num_kv_heads, spec.head_dim, info.ring_rows
    n = io_names(spec.num_layers)
    inputs = [helper.make_tensor_value_info("inputs_embeds", f32, [1, s, spec.hidden_size]),
              helper.make_tensor_value_info("rope_cos", f32, [1, 1, s, Dh]),
              helper.make_tensor_value_info("rope_sin", f32, [1, 1, s, Dh]),
              helper.make_tensor_value_info("attention_mask", f32, [1, 1, spec.num_heads // Hkv * s, R + s]),
              helper.make_tensor_value_info("logits_select", f32, [1, 1, s])]
    outputs = [helper.make_tensor_value_info(f"logits.{c}", f32, [1, 1, hi - lo])
               for c, (lo, hi) in enumerate(logit_chunks(spec.vocab_size))]
    for i in range(spec.num_layers):
        inputs += [helper.make_tensor_value_info(n.past_key(i), f32, [1, Hkv, R, Dh]),
                   helper.make_tensor_value_info(n.past_value(i), f32, [1, Hkv, R, Dh])]
        outputs += [helper.make_tensor_value_info(n.present_key(i), f32, [1, Hkv, s, Dh]),
                    helper.make_tensor_value_info(n.present_value(i), f32, [1, Hkv, s, Dh])]
    graph = helper.make_graph(copy.deepcopy(g.nodes), f"edgeinfer_portable_s{s}", inputs, outputs,
                              copy.deepcopy(g.initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8,
                             producer_name="edgeinfer")

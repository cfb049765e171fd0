"""Optimum's exported decoder, rewired to the ring's KV exchange (the `optimum` KV mode).

Optimum's `text-generation-with-past` graph (interface as exported, per layer i):

    in   input_ids, position_ids [B, S], attention_mask [B, P + S]
         past_key_values.{i}.key / .value  [B, Hkv, P, Dh]
    out  logits [B, S, V]
         present.{i}.key / .value          [B, Hkv, P + S, Dh] = Concat(past, new rows, axis -2)

Bound as it is, the runtime would have to gather the ring's valid slots into a heads-first block
before every call and copy the new rows back out of `present` after it. Instead this module moves
the layout changes into the graph, where they cost what the graph's own Concat of the past already
costs, and leaves the runtime the standard mode's zero-copy binding (kv_mode.OPTIMUM):

- each past input becomes slot-major [B, P, Hkv, Dh] (the ring's layout, the valid slots bound in
  place), followed by a Transpose back to what Optimum's nodes read;
- each present output becomes the call's S new rows only, [B, S, Hkv, Dh] (the second input of the
  Concat that appends them to the past, transposed), which the runtime binds right after the valid
  slots; the Concat itself stays, feeding attention;
- a `logits_index` input [N] selects the positions that get logits (a Gather in front of the
  lm_head MatMul, so a prefill does not project every position onto the vocabulary);
- the graph's inputs and outputs are rebuilt from `interface.graph_interface(spec, OPTIMUM)`, so the
  graph and the manifest's description cannot disagree; nodes nothing reads any more are dropped.

Anything that does not have this shape (no Concat appending to a past, a missing input) is a
ConvertError naming the tensor, never a silently different graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from edgeinfer.arch import ArchSpec
from edgeinfer.errors import ConvertError
from edgeinfer.kv_mode import ATTENTION_MASK, OPTIMUM
from edgeinfer.interface import graph_interface, io_names

SWAP_S_N = [0, 2, 1, 3]  # BNSH <-> BSNH (its own inverse)
OPTIMUM_INPUTS = ("input_ids", ATTENTION_MASK, "position_ids")
# elementwise ops that may sit between the lm_head MatMul and `logits` (with constant other inputs: Gemma 2's
# soft-capping, a Cast): a Gather over the sequence axis commutes with them
_ELEMENTWISE = {"Identity", "Cast", "Mul", "Div", "Add", "Sub", "Tanh"}


def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for j, x in enumerate(node.input):
            if x == old:
                node.input[j] = new


def _rename_output(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename tensor `old` (a node's output) to `new` where it is produced and read."""
    for node in graph.node:
        for j, x in enumerate(node.output):
            if x == old:
                node.output[j] = new
    _rename_uses(graph, old, new)


def _constants(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}


def _new_rows(graph: onnx.GraphProto, past: str) -> str:
    """The tensor of this call's new rows: the second input of the Concat (axis -2 of BNSH) that
    appends them to the (transposed) past."""
    cats = [n for n in graph.node if n.op_type == "Concat" and len(n.input) == 2 and n.input[0] == past
            and any(a.name == "axis" and helper.get_attribute_value(a) in (2, -2) for a in n.attribute)]
    if len(cats) != 1:
        raise ConvertError(f"Optimum's graph does not append the new rows to {past} with one Concat on the "
                           f"sequence axis ({len(cats)} found): edgeinfer cannot bind it to its KV ring")
    return cats[0].input[1]


def _select_logits(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Make `logits` hold only the positions `logits_index` names: a Gather on the lm_head's input when
    the lm_head (a MatMul by a constant weight, then only elementwise ops with constants) is found,
    else on the logits themselves (same result, the full projection computed). Returns nodes to append."""
    prod = {o: n for n in graph.node for o in n.output}
    consts = _constants(graph)
    node = prod.get("logits")
    while node is not None and node.op_type in _ELEMENTWISE:
        live = [x for x in node.input if x and x not in consts]
        node = prod.get(live[0]) if len(live) == 1 else None
    if node is not None and node.op_type == "MatMul" and node.input[1] in consts:
        picked = "/edgeinfer/lm_head/selected_positions"
        gather = helper.make_node("Gather", [node.input[0], "logits_index"], [picked], axis=1,
                                  name="/edgeinfer/lm_head/Gather")
        node.input[0] = picked
        nodes = list(graph.node)
        at = nodes.index(node)
        del graph.node[:]
        graph.node.extend(nodes[:at] + [gather] + nodes[at:])
        return []
    _rename_output(graph, "logits", "/edgeinfer/logits/all_positions")
    return [helper.make_node("Gather", ["/edgeinfer/logits/all_positions", "logits_index"], ["logits"], axis=1,
                             name="/edgeinfer/logits/Gather")]


def _node_inputs(node: onnx.NodeProto):
    """Every tensor a node reads, including what its subgraphs (If, Loop) read from the outer scope."""
    yield from node.input
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                yield from _node_inputs(n)


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes and initializers no graph output depends on (e.g. a sliding-window Slice of
    the old present)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(_node_inputs(node))
    del graph.node[:]
    graph.node.extend(reversed(keep))
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def _value_infos(desc, num_layers: int) -> list[onnx.ValueInfoProto]:
    """ONNX value infos of one side (inputs or outputs) of an Interface, per-layer names expanded."""
    out = []
    for key, t in desc.items():
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))
        names = [t.name.format(i=i) for i in range(num_layers)] if t.name else [key]
        out += [helper.make_tensor_value_info(n, elem, list(t.shape)) for n in names]
    return out


def _check_dims(graph: onnx.GraphProto, spec: ArchSpec, past: str) -> None:
    """The exported graph's fixed KV and vocabulary dims are the spec's (read from config.json): the
    manifest, the ring and the graph must agree on them."""
    def dims(vi):
        return [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]

    kv = dims(next(i for i in graph.input if i.name == past))
    logits = dims(next(o for o in graph.output if o.name == "logits"))
    for what, got, want in (("KV heads", kv[1:2], spec.num_kv_heads), ("head size", kv[3:4], spec.head_dim),
                            ("vocabulary", logits[2:3], spec.vocab_size)):
        if got and got[0] is not None and got[0] != want:
            raise ConvertError(f"Optimum's graph has {what} {got[0]} where config.json says {want}")


def rewire(model: onnx.ModelProto, spec: ArchSpec) -> onnx.ModelProto:
    """Rewire Optimum's decoder `model` (changed in place, and returned) to the optimum KV mode's
    interface for `spec`. The weights are not touched (the model may be loaded without its external data)."""
    g = model.graph
    names = io_names(spec.num_layers)
    kv = [(names.past_key(i), names.present_key(i)) for i in range(spec.num_layers)] + \
         [(names.past_value(i), names.present_value(i)) for i in range(spec.num_layers)]
    want_in = {*OPTIMUM_INPUTS, *(p for p, _ in kv)}
    want_out = {"logits", *(p for _, p in kv)}
    have_in = {i.name for i in g.input} - {t.name for t in g.initializer}
    have_out = {o.name for o in g.output}
    for what, want, have in (("input", want_in, have_in), ("output", want_out, have_out)):
        if have != want:
            odd = sorted(want - have) or sorted(have - want)
            verb = "lacks" if want - have else "has an unexpected"
            raise ConvertError(f"Optimum's graph {verb} {what} {odd[0]!r} (expected {spec.num_layers} layers of "
                               f"past_key_values/present and {', '.join(OPTIMUM_INPUTS)}): edgeinfer cannot bind it")
    _check_dims(g, spec, kv[0][0])
    head, tail = [], []
    for past, present in kv:
        heads_first = f"/edgeinfer/{past}/BNSH"
        _rename_uses(g, past, heads_first)
        head.append(helper.make_node("Transpose", [past], [heads_first], perm=SWAP_S_N,
                                     name=f"/edgeinfer/{past}/Transpose"))
        new = _new_rows(g, heads_first)
        _rename_output(g, present, f"/edgeinfer/{present}/all_rows")  # still read by attention
        tail.append(helper.make_node("Transpose", [new], [present], perm=SWAP_S_N,
                                     name=f"/edgeinfer/{present}/Transpose"))
    tail += _select_logits(g)
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    want = graph_interface(spec, OPTIMUM)
    for side, desc in ((g.input, want.inputs), (g.output, want.outputs)):
        del side[:]
        side.extend(_value_infos(desc, spec.num_layers))
    del g.value_info[:]  # shapes of renamed tensors would be stale; ONNX Runtime infers them
    _prune(g)
    return model

"""Graph interface versions: version 2 fused graphs take RoPE's cos/sin table (a row per position)
from the host; folders converted before (version 1: each call's rows computed in the graph from
position_ids) load and decode as they did. tests/fixtures/interface_v1 holds the tiny llama2_gqa_tied model converted to int8 by the
converter of commit 50f5f50 (version 1), in both KV modes."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest

import edgeinfer
from conftest import FIXTURES, TINY, write_manifest
from edgeinfer.converters import convert
from edgeinfer.kv_cache import BatchedKV
from edgeinfer.interface import INTERFACE_VERSION, ROPE_COS, ROPE_SIN, graph_interface
from edgeinfer.manifest import MANIFEST_FILE, read_manifest

V1 = FIXTURES / "interface_v1"


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    made = {}

    def get(attention: str):
        if attention not in made:
            made[attention] = tmp_path_factory.mktemp("v2") / attention
            convert(TINY / "llama2_gqa_tied", made[attention], quant="int8", attention=attention)
        return made[attention]

    return get


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_a_version_1_folder_decodes_as_the_version_2_graph(v2, attention):
    old, new = V1 / f"llama2_gqa_tied-{attention}", v2(attention)
    assert read_manifest(old).interface.version == 1 and read_manifest(new).interface.version == INTERFACE_VERSION == 2
    a, b = (edgeinfer.load(f, capacity_tokens=40, n_sink=2, prefill_chunk=7) for f in (old, new))
    assert not a.engine.host_rope and b.engine.host_rope and a.engine.mode is b.engine.mode
    ids = np.random.default_rng(3).integers(3, 512, 30).tolist()
    ca, cb = a.new_cache(), b.new_cache()
    assert np.abs(a.engine.prefill(ca, ids) - b.engine.prefill(cb, ids)).max() < 1e-4
    rows = (a.engine.forward(ca, ids[:5], all_logits=True), b.engine.forward(cb, ids[:5], all_logits=True))
    assert np.abs(rows[0] - rows[1]).max() < 1e-4
    for t in ids * 3:  # past the capacity: the rings wrap and re-base (positions move back)
        assert np.abs(a.engine.decode_one(ca, t) - b.engine.decode_one(cb, t)).max() < 1e-4
    assert ca.rebased_tokens == cb.rebased_tokens > 0
    x = a.generate(ids[:6], max_new_tokens=40, temperature=0, ignore_eos=True)
    y = b.generate(ids[:6], max_new_tokens=40, temperature=0, ignore_eos=True)
    assert x.token_ids == y.token_ids


def test_version_2_graph_has_no_rope_nodes_and_takes_the_rows(v2):
    model = onnx.load(str(v2("gqa") / "model.onnx"), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    assert {ROPE_COS, ROPE_SIN, "position_ids"} <= set(inputs)
    assert not [n for n in model.graph.node if n.op_type in ("Cos", "Sin", "Pad", "Range")]
    old = onnx.load(str(V1 / "llama2_gqa_tied-gqa" / "model.onnx"), load_external_data=False)
    assert len(old.graph.node) - len(model.graph.node) == 18  # the per-call rows, their padding


def test_batched_steps_on_both_versions_agree(v2):
    logits = []
    for folder in (V1 / "llama2_gqa_tied-gqa", v2("gqa")):
        m = edgeinfer.load(folder, capacity_tokens=32, n_sink=2)
        eng = m.engine
        kv = BatchedKV(m.manifest.arch, 3, 32, 2, eng.max_chunk, eng.mode)
        rng = np.random.default_rng(5)
        for c, n in zip(kv.caches, (3, 11, 25)):
            eng.prefill(c, rng.integers(3, 512, n).tolist())
        out = []
        for step in range(60):  # rows at different positions; the rings wrap
            eng.decode_batch(kv, {b: int(rng.integers(3, 512)) for b in range(3) if (step + b) % 5})
            out.append(kv.logits.copy())
        logits.append(np.stack(out))
    assert np.abs(logits[0] - logits[1]).max() < 1e-4


@pytest.mark.parametrize("graph_version", [1, 2])
def test_a_manifest_relabelled_to_the_other_version_is_refused_at_load(v2, tmp_path, graph_version):
    """Version and inputs edited together pass the manifest's own checks; the graph's inputs do not
    match them, which load says (not ONNX Runtime at the first call)."""
    src = V1 / "llama2_gqa_tied-gqa" if graph_version == 1 else v2("gqa")
    dst = tmp_path / "relabelled"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".edgeinfer-verified.json*"))
    m = read_manifest(dst)
    other = graph_interface(m.arch, m.interface.kv_mode, m.interface.kv_dtype, 3 - graph_version)
    doc = json.loads((dst / MANIFEST_FILE).read_text())
    doc["interface"] = other.to_json()
    write_manifest(dst, doc)
    assert read_manifest(dst).interface.version == 3 - graph_version  # a consistent manifest on its own
    with pytest.raises(edgeinfer.ModelFormatError, match="does not take the inputs its edgeinfer.json names"):
        edgeinfer.load(dst)


def test_positions_past_the_rings_limit_are_refused_not_tabled(v2):
    """A ring's positions stay below its `position_limit` (re-basing); bookkeeping that says otherwise
    (a forged snapshot) is an error, not a table of 10^8 rows."""
    m = edgeinfer.load(v2("gqa"), capacity_tokens=32, n_sink=4)
    cache = m.new_cache()
    m.engine.prefill(cache, [1, 5, 9])  # 3 tokens, all sinks: no re-basing would move them back
    rows = m.engine._rope_cos.shape[0]
    cache.restore(dataclasses.replace(cache.snapshot(), next_position=10 ** 8))
    with pytest.raises(ValueError, match="pass the ring's limit"):
        m.engine.decode_one(cache, 7)
    assert m.engine._rope_cos.shape[0] == rows

"""Both KV modes through the Engine (IO binding straight into the ring): GroupQueryAttention over
the shared buffer and standard-op attention over the valid block must reproduce transformers'
greedy continuations, with any prefill chunking, and forget exactly what the ring drops."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import edgeinfer
from conftest import TINY, TINY_MODELS
from edgeinfer.converters import convert
from edgeinfer.converters.safetensors_io import Checkpoint
from edgeinfer.session import DecoderSession


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = {}

    def get(name: str, attention: str):
        if (name, attention) not in cache:
            dst = tmp_path_factory.mktemp("paths") / f"{name}-{attention}"
            convert(TINY / name, dst, quant="fp32", attention=attention)
            cache[name, attention] = dst
        return cache[name, attention]

    return get


@pytest.mark.parametrize("attention", ["auto", "standard"])
@pytest.mark.parametrize("chunk", [256, 3])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_engine_greedy_matches_transformers(folders, name, attention, chunk):
    ref = np.load(TINY / name / "reference.npz")
    m = edgeinfer.load(folders(name, attention), prefill_chunk=chunk)
    assert m.engine.shared == (attention == "auto")  # every tiny model has a head size GQA takes
    c = m.generate(ref["prompt_ids"].tolist(), max_new_tokens=32, temperature=0, ignore_eos=True)
    assert list(c.token_ids) == ref["greedy_ids"].tolist()


def _one_layer(tmp_path, name: str):
    src = tmp_path / "src"
    shutil.copytree(TINY / name, src)
    (src / "reference.npz").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (src / "config.json").write_text(json.dumps(cfg))
    ckpt = Checkpoint(TINY / name)
    keep = {n: ckpt.read(n) for n in ckpt.tensors if not n.startswith("model.layers.") or n.startswith("model.layers.0.")}
    header, blobs, off = {}, [], 0
    for n, a in keep.items():
        header[n] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    (src / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    convert(src, tmp_path / "one", quant="fp32")
    return tmp_path / "one"


def test_gqa_ring_matches_explicit_sliding_window(tmp_path):
    folder = _one_layer(tmp_path, "llama2_gqa_tied")
    m = edgeinfer.load(folder, capacity_tokens=24, n_sink=2, prefill_chunk=5)
    assert m.engine.shared
    sess = DecoderSession(folder)
    ids = np.random.default_rng(0).integers(3, 512, 70).tolist()
    cache = m.new_cache()
    rows, pos = {}, 0
    while pos < len(ids):
        s = min(5, len(ids) - pos)  # chunks keep going past the capacity: overflow rows move into the ring
        lg = m.engine.forward(cache, ids[pos:pos + s], all_logits=True)
        rows.update({pos + j: lg[j].copy() for j in range(s)})
        pos += s
    assert cache.n_valid == 24 and cache.dropped == 70 - 24
    for t in (10, 23, 24, 25, 40, 69):
        if t < 24:
            sel = list(range(t + 1))
        else:  # the call that holds t started with the ring as it was after the previous chunk
            start = t - (t % 5)
            held = list(range(2)) + list(range(max(2, start - 22), start))
            sel = held + list(range(start, t + 1))
        ref, _ = sess.forward(np.array([[ids[i] for i in sel]]), np.array([sel]), sess.empty_past(),
                              np.array([len(sel) - 1]))
        assert np.abs(ref[0, -1] - rows[t]).max() < 1e-4, t

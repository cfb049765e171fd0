"""Block quantization: the packed format MatMulNBits reads, decoded by hand in numpy.

4 bits: two values per byte, low nibble first; value = (q - 8) * scale when symmetric,
(q - zero_point) * scale otherwise. A row whose width is not a multiple of the block is padded,
never truncated (stories260K's down_proj has K = 172).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgeinfer.converters.quantize import QuantScheme, quantize_blockwise
from edgeinfer.errors import ConvertError


def decode(packed: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, bits: int, k: int) -> np.ndarray:
    n, n_blocks, _ = packed.shape
    if bits == 4:
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, n_blocks, -1).astype(np.float32)
    else:
        q = packed.astype(np.float32)
    if zp is None:
        z = np.full((n, n_blocks, 1), 2 ** (bits - 1), np.float32)
    elif bits == 4:
        z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)[:, :n_blocks, None].astype(np.float32)
    else:
        z = zp[:, :n_blocks, None].astype(np.float32)
    return ((q - z) * scales[:, :, None]).reshape(n, -1)[:, :k]


def matmulnbits(x: np.ndarray, packed, scales, zp, bits: int, k: int, n: int, block: int) -> np.ndarray:
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")]
    ins = ["x", "B", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=10)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_hand_computed_4bit_block():
    # one row, one block of 32: values -8..7 times 0.5, so the scale is 0.5 and q = value / 0.5 + 8
    w = (np.tile(np.arange(-8, 8), 2) * 0.5).astype(np.float32)[None]
    packed, scales, zp = quantize_blockwise(w, 4, 32, symmetric=True)
    assert zp is None and packed.shape == (1, 1, 16) and scales.shape == (1, 1)
    assert scales[0, 0] == pytest.approx(0.5)
    assert packed[0, 0, 0] == (0 | (1 << 4))  # q = 0 (value -4.0) in the low nibble, q = 1 (-3.5) high
    np.testing.assert_array_equal(decode(packed, scales, zp, 4, 32), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [172, 40, 64])
def test_padded_rows_keep_every_weight(bits, symmetric, k):
    rng = np.random.default_rng(k)
    n, block = 24, 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed, scales, zp = quantize_blockwise(w, bits, block, symmetric)
    assert packed.shape[1] == -(-k // block)  # ceil: the partial last block is kept
    deq = decode(packed, scales, zp, bits, k)
    # round-to-nearest: every weight (the tail columns included) within half a step; symmetric maps the
    # largest magnitude to -2^(bits-1) with a signed scale (as llama.cpp's Q4_0), so an opposite extreme
    # of equal size clips at +2^(bits-1)-1: within one step
    step = np.abs(np.repeat(scales, block, axis=1)[:, :k])
    bound = 1.0 if symmetric else 0.5
    assert np.all(np.abs(deq - w) <= step * bound + 1e-6)
    assert np.abs(deq[:, -(k % block or block):] - w[:, -(k % block or block):]).max() < np.abs(w).max() / 4
    # ONNX Runtime's kernel reads exactly this format
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = matmulnbits(x, packed, scales, zp, bits, k, n, block)
    np.testing.assert_allclose(y, x @ deq.T, rtol=1e-4, atol=1e-4)


def test_scheme_validation():
    with pytest.raises(ConvertError, match="unknown quantization 'int3'"):
        QuantScheme(weights="int3")
    with pytest.raises(ConvertError, match="block size 48"):
        QuantScheme(weights="int4", block_size=48)
    with pytest.raises(ConvertError, match="accuracy_level"):
        QuantScheme(weights="int4", accuracy_level=7)
    assert QuantScheme(weights="int4", int8_tensors=("down_proj",)).kind_for("down_proj") == "int8"
    assert QuantScheme(weights="int4", int8_tensors=("down_proj",)).kind_for("qkv_proj") == "int4"


def _dequantize_symmetric_int4(packed, scales, k):
    codes = np.empty((*packed.shape[:2], packed.shape[2] * 2), np.float32)
    codes[..., 0::2], codes[..., 1::2] = packed & 15, packed >> 4
    return ((codes - 8) * scales[..., None]).reshape(len(packed), -1)[:, :k]


@pytest.mark.parametrize("k", [64, 172])  # 172: a last block padded with zeros (stories260K's down_proj)
def test_mse_recipe_never_has_more_weight_error_than_round_to_nearest(k):
    """Hand reference: the blocks' own dequantization. The mse recipe's candidate set includes the
    round-to-nearest scale; its total squared error is lower (measured 4.5 % on heavy-tailed weights)."""
    from edgeinfer.converters.quantize import quantize_blockwise

    w = np.random.default_rng(3).standard_normal((96, k)).astype(np.float32) ** 3  # heavy tails
    errs = {}
    for recipe in ("rtn", "mse"):
        packed, scales, zp = quantize_blockwise(w, 4, 32, True, recipe)
        assert zp is None and packed.shape == (96, -(-k // 32), 16)
        errs[recipe] = np.square(_dequantize_symmetric_int4(packed, scales, k) - w).sum()
    assert errs["mse"] < 0.99 * errs["rtn"]  # measured 0.955


def test_mse_recipe_on_stories260k(converted):
    """Measured: perplexity 6.5462 (rtn) -> 6.3772 (mse) on eval.txt; fp32 5.6836."""
    from conftest import STORIES_FIX, STORIES_SRC
    from edgeinfer.evaluate import perplexity

    ppl = {r: perplexity(converted(STORIES_SRC, "int4", recipe=r), STORIES_FIX / "eval.txt").perplexity
           for r in ("rtn", "mse")}
    assert ppl["mse"] < ppl["rtn"] - 0.1


def test_int4_scales_stored_as_fp16_by_default(converted):
    """Measured on stories260K: 209,934 -> 196,923 model bytes, perplexity 6.5462 -> 6.5480 (fp32 scales
    -> fp16 scales, the same codes). Reference: the float32-scale conversion of the same weights."""
    import onnx

    from conftest import STORIES_FIX, STORIES_SRC
    from edgeinfer.evaluate import perplexity
    from edgeinfer.manifest import read_manifest

    f16, f32 = converted(STORIES_SRC, "int4"), converted(STORIES_SRC, "int4", scale_dtype="float32")
    assert read_manifest(f16).quantization.scale_dtype == "float16"
    graph = onnx.load(f16 / "model.onnx", load_external_data=False).graph
    scales = [i for i in graph.initializer if i.name.endswith(".scales_fp16")]
    assert scales and all(i.data_type == TensorProto.FLOAT16 for i in scales)
    size = {k: (f / "model.onnx.data").stat().st_size for k, f in (("f16", f16), ("f32", f32))}
    assert size["f16"] < 0.95 * size["f32"]
    ppl = {k: perplexity(f, STORIES_FIX / "eval.txt").perplexity for k, f in (("f16", f16), ("f32", f32))}
    assert abs(ppl["f16"] / ppl["f32"] - 1) < 1e-3


def test_q4_1_recipe_blocks_match_llama_cpp_q4_1():
    """Reference: the gguf package's Q4_1 (llama.cpp's own rule). Ours computes the codes from the
    fp16-rounded scale and minimum it stores, so its error is no larger than the reference's."""
    gguf = pytest.importorskip("gguf")
    from edgeinfer.converters.gguf_blocks import q4_1_blocks

    w = np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32) ** 3
    ref = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1)
    b = q4_1_blocks(w)
    assert (b.bits, b.source, b.scales.dtype) == (4, "q4_1", np.float16)
    ours = b.dequantize()
    assert np.square(ours - w).sum() <= np.square(ref - w).sum() * 1.001
    step = np.repeat(b.scales.astype(np.float32), 32, axis=1)  # each weight's block scale
    diff = np.abs(ours - ref)
    assert (diff <= 1.01 * step + 1e-3 * np.abs(w)).all()  # at most one step apart (fp16 rounding of d and m)
    assert (diff > 1e-6).mean() < 0.02  # and almost always the same code


def test_q4_1_recipe_on_stories260k(converted):
    """Measured: 6.3042 (+10.9 %, 237,881 model bytes) against rtn's 6.5480 (196,923 bytes); it runs on
    kept_graph's symmetric packs plus a block-sum offset (0.69x rtn's decode speed on the small shape)."""
    from conftest import STORIES_FIX, STORIES_SRC
    from edgeinfer.evaluate import perplexity

    ppl = {r: perplexity(converted(STORIES_SRC, "int4", recipe=r), STORIES_FIX / "eval.txt").perplexity
           for r in ("rtn", "q4_1")}
    assert ppl["q4_1"] < ppl["rtn"] - 0.15


def test_asym_recipe_searches_integer_zero_points():
    """Hand reference: the blocks' own dequantization s (q - z). The search includes min/max's (s, z)
    neighbourhood, so its error is below ONNX Runtime's asymmetric round-to-nearest on the same weights."""
    from edgeinfer.converters.quantize import quantize_blockwise

    w = np.random.default_rng(9).standard_normal((64, 96)).astype(np.float32) ** 3 + 0.3
    errs = {}
    for recipe in ("rtn", "asym"):
        packed, scales, zp = quantize_blockwise(w, 4, 32, False, recipe)
        z = np.stack([zp & 15, zp >> 4], -1).reshape(len(zp), -1)[:, :scales.shape[1]].astype(np.float32)
        codes = np.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:2], -1).astype(np.float32)
        deq = ((codes - z[..., None]) * scales[..., None]).reshape(len(w), -1)[:, :96]
        errs[recipe] = np.square(deq - w).sum()
    assert errs["asym"] < 0.98 * errs["rtn"]  # measured 0.951


def test_asym_search_in_threaded_chunks_equals_one_search_of_all_rows():
    """`int4_asym` searches chunks of rows on several threads; its blocks are those of one search over
    every row at once (rows past a chunk boundary, the last block of a 172-wide row padded)."""
    from edgeinfer.converters.gguf_blocks import pack4
    from edgeinfer.converters.quantize import ASYM_ROWS, asym_search, int4_asym

    w = np.random.default_rng(3).standard_normal((2 * ASYM_ROWS + 37, 172)).astype(np.float32) ** 3
    packed, scales, zp = int4_asym(w, 32)
    x = np.zeros((len(w), 6 * 32), np.float32)
    x[:, :172] = w
    codes, s, z = asym_search(x.reshape(len(w), 6, 32))
    assert np.array_equal(packed, pack4(codes)) and np.array_equal(scales, s)
    assert np.array_equal(zp, pack4(z.astype(np.uint8)))


def test_asym_recipe_on_stories260k(converted):
    """Measured: 6.3626 (+11.95 %, 203,121 model bytes) against asymmetric rtn's 6.4784 and symmetric
    rtn's 6.5480; SmolLM2 +21.3 % against +22.5 % (docs/architecture.md)."""
    from conftest import STORIES_FIX, STORIES_SRC
    from edgeinfer.evaluate import perplexity

    ppl = {r: perplexity(converted(STORIES_SRC, "int4", symmetric=False, recipe=r), STORIES_FIX / "eval.txt").perplexity
           for r in ("rtn", "asym")}
    assert ppl["asym"] < ppl["rtn"] - 0.05


def test_default_int4_is_the_gptq_recipe(tmp_path, capsys):
    """No recipe given, int4 is gptq (asym's blocks fitted on calibration text), int8 symmetric round
    to nearest; the CLI's default conversion says so in its manifest and `inspect`, and its weights
    are those of `--recipe gptq`."""
    from conftest import STORIES_SRC
    from edgeinfer.cli import main
    from edgeinfer.converters import default_scheme
    from edgeinfer.manifest import read_manifest

    assert (default_scheme("int4").recipe, default_scheme("int4").symmetric) == ("gptq", False)
    assert (default_scheme("int4", recipe="asym").recipe, default_scheme("int4", recipe="asym").symmetric) == \
        ("asym", False)
    assert (default_scheme("int4", recipe="rtn").recipe, default_scheme("int4", recipe="rtn").symmetric) == ("rtn", True)
    assert (default_scheme("int8").recipe, default_scheme("int8").symmetric) == ("rtn", True)
    for name, flags in (("default", []), ("gptq", ["--recipe", "gptq"])):
        assert main(["convert", str(STORIES_SRC), "-o", str(tmp_path / name), "-q", "--quant", "int4", *flags]) == 0
    q = read_manifest(tmp_path / "default").quantization
    assert (q.recipe, q.symmetric) == ("gptq", False)
    for f in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "default" / f).read_bytes() == (tmp_path / "gptq" / f).read_bytes()
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "default")]) == 0
    assert "recipe gptq" in capsys.readouterr().out


def test_q4_1_recipe_is_for_the_cpu_graph(tmp_path):
    from conftest import STORIES_SRC
    from edgeinfer.converters import convert, default_scheme

    with pytest.raises(ConvertError, match="--recipe q4_1 builds the cpu graph"):
        convert(STORIES_SRC, tmp_path / "out", target="cuda", scheme=default_scheme("int4", recipe="q4_1"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,w", [
    ("constant", np.full((4, 64), 0.5, np.float32)),
    ("negative constant", np.full((4, 64), -0.02, np.float32)),
    ("offset", (0.05 + np.random.default_rng(0).standard_normal((16, 64)) * 0.001).astype(np.float32)),
    ("far offset", (3.0 + np.random.default_rng(1).standard_normal((16, 64))).astype(np.float32))])
def test_asym_keeps_blocks_on_one_side_of_zero(name, w):
    """A block that does not hold 0 (a constant one, an offset one): its range was its own [min, max],
    which the grid s (q - z), z in [0, 15], cannot reach, and every weight of a constant block came out
    0 (hostile round). The range holds 0 now: such blocks are kept at least as well as rtn keeps them."""
    errs = {}
    for recipe in ("rtn", "asym"):
        packed, scales, zp = quantize_blockwise(w, 4, 32, recipe == "rtn", recipe)
        errs[recipe] = np.linalg.norm(decode(packed, scales, zp, 4, w.shape[1]) - w) / np.linalg.norm(w)
    assert errs["asym"] <= errs["rtn"] + 1e-6 and errs["asym"] < 0.05, errs


def test_a_scheme_whose_recipe_contradicts_its_storage_is_refused():
    """QuantScheme(weights="int4", recipe="asym") with the default symmetric=True stored rtn blocks
    labelled asym (hostile round): a recipe and a storage that disagree are refused."""
    with pytest.raises(ConvertError, match="recipe asym stores asymmetric blocks"):
        QuantScheme(weights="int4", recipe="asym")
    with pytest.raises(ConvertError, match="recipe mse stores symmetric blocks"):
        QuantScheme(weights="int4", recipe="mse", symmetric=False)
    assert QuantScheme(weights="int4", recipe="asym", symmetric=False).recipe == "asym"


def test_q4_1_is_recorded_as_the_asymmetric_recipe_it_is():
    """`--recipe q4_1` (blocks with an fp16 minimum) was recorded and shown as "symmetric", and
    `--asymmetric` silently changed the tensors it cannot take (a fresh user's review): the scheme is
    asymmetric throughout now, with or without the flag."""
    from edgeinfer.converters.convert import default_scheme

    assert default_scheme("int4", 32, recipe="q4_1").symmetric is False
    assert default_scheme("int4", 32, recipe="q4_1", symmetric=False) == default_scheme("int4", 32, recipe="q4_1")

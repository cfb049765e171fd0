"""GGUF parity (issue 13, acceptance 2): the tiny parity models of tests/fixtures/tiny written as GGUF
(F16, Q8_0) by `gguf_writer.write_gguf` (convert_hf_to_gguf.py's layout, checked below against a file
llama.cpp's converter made) and converted with `--quant keep` reproduce transformers' greedy sequences.

Tolerances, measured on these fixtures (logits absmax 39..48, std 8..12):

F16     keep-converted logits equal `convert --quant fp16` of the Hugging Face folder exactly (max |diff|
        0.0: the same fp16 weights by two paths, q/k rows un-permuted exactly). Against transformers'
        fp32 logits the fp16 weight rounding (relative 2^-11) gives max |diff| <= 0.0453 (llama2_gqa_tied;
        1.2e-3 of the logit absmax), mean <= 0.0053; mistral's weights are fp16 already: 3e-5.
        Bounds: max 0.1, mean 0.01.
Q8_0    keep-converted logits equal the fp32 conversion of the same weights dequantized (max |diff| 0.0,
        both greedy sequences identical): the converter adds nothing to the file's own rounding. That
        rounding moves the logits by max |Q8_0 - F16| 0.66..1.21, RMS 1.8..2.0 % of the logits' std
        (random tiny models; llama.cpp 0.3.36 itself on the same files: 0.90..1.60 from transformers).
        Bounds: max 2.0, RMS 3 % of the std.
        mistral_gqa_untied_fp16 at Q8_0 leaves transformers' sequence at step 1: transformers' top-2
        margin there is 0.35 (377 over 188), inside Q8_0's perturbation; our Q8_0 logits put 188 over
        377 by 0.030, and llama.cpp 0.3.36 on the same file also picks 188 (by 0.17). That flip is
        listed in KNOWN_Q8_0_FLIPS and checked as exactly that (same prefix, near-tie on both sides),
        every other fixture must match all 32 tokens; the full mistral sequence must still equal the
        dequantized-fp32 model's.
The llama3 rope-scaled fixture is written with llama.cpp's `rope_freqs.weight` and must be refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from conftest import FIXTURES, STORIES_SRC, TINY, TINY_MODELS, write_safetensors  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from edgeinfer.converters import convert  # noqa: E402
from edgeinfer.converters.safetensors_io import Checkpoint  # noqa: E402
from edgeinfer.engine import Engine  # noqa: E402
from edgeinfer.errors import ConvertError  # noqa: E402
from edgeinfer.manifest import TokenizerInfo, read_manifest  # noqa: E402
from edgeinfer.session import DecoderSession  # noqa: E402
from edgeinfer.tokenizer import Tokenizer  # noqa: E402

LLAMA3 = "llama3_mqa_untied_bf16"  # llama3 rope scaling: llama.cpp writes rope_freqs.weight, which we refuse
MODELS = [n for n in TINY_MODELS if n != LLAMA3]
QTYPES = ("F16", "Q8_0")
F16_MAX, F16_MEAN = 0.1, 0.01  # vs transformers (measured max 0.0453, mean 0.0053)
SAME = 1e-5  # two conversions of the same weights (measured 0.0)
# the same numbers computed another way: below level 4 a kept 8-bit weight runs as two 4-bit packs
# plus a block-sum offset (converters/kept_graph.py), which reorders float additions (measured 2.7e-5
# on logits up to ~20: a few ulps)
SAME_NUMBERS = 1e-4
Q8_0_MAX, Q8_0_RMS_OF_STD = 2.0, 0.03  # Q8_0 vs F16 (measured max 1.21, RMS 2.0 % of the std)
NEAR_TIE = 0.5  # a top-2 margin Q8_0 may flip: below its measured logit perturbation (>= 0.66 on every fixture)
KNOWN_Q8_0_FLIPS = {"mistral_gqa_untied_fp16": 1}  # fixture -> first step that differs from transformers


def _engine(folder: Path):
    eng = Engine(DecoderSession(folder), max_chunk=64)
    return eng, eng.new_cache(256, 0)


def _full_pass(folder: Path, ids: list[int]) -> np.ndarray:
    eng, cache = _engine(folder)
    return eng.forward(cache, ids, all_logits=True).copy()


def _greedy(folder: Path, prompt: list[int], n: int = 32) -> tuple[list[int], np.ndarray]:
    """test_parity's greedy loop; also returns each step's logits row."""
    eng, cache = _engine(folder)
    rows = [eng.prefill(cache, prompt).copy()]
    out = [int(rows[-1].argmax())]
    while len(out) < n:
        rows.append(eng.decode_one(cache, out[-1]).copy())
        out.append(int(rows[-1].argmax()))
    return out, np.stack(rows)


def _teacher_forced_rows(folder: Path, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits rows for each step of `tokens` fed after `prompt` (row i predicts tokens[i])."""
    eng, cache = _engine(folder)
    rows = [eng.prefill(cache, prompt).copy()]
    for t in tokens[:-1]:
        rows.append(eng.decode_one(cache, t).copy())
    return np.stack(rows)


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory):
    """gguf_model(name, qtype) -> the fixture written as GGUF and converted with --quant keep (once per session)."""
    cache: dict = {}

    def get(name: str, qtype: str) -> Path:
        if (name, qtype) not in cache:
            tmp = tmp_path_factory.mktemp("gguf")
            src = write_gguf(TINY / name, tmp / f"{name}-{qtype}.gguf", qtype)
            convert(src, tmp / f"{name}-{qtype}", quant="keep")
            cache[name, qtype] = tmp / f"{name}-{qtype}"
        return cache[name, qtype]

    return get


@pytest.fixture(scope="session")
def dequantized_q8_0(tmp_path_factory, converted):
    """dequantized_q8_0(name) -> the Hugging Face fixture with every 2-D weight rounded through Q8_0 (as
    the GGUF holds it; F16 where a row is not a multiple of 32), converted at fp32: the exact float model
    of the Q8_0 file's numbers, built by the safetensors path."""
    cache: dict = {}

    def roundtrip(a: np.ndarray) -> np.ndarray:
        if a.ndim != 2:
            return a
        kind = gguf.GGMLQuantizationType.Q8_0 if a.shape[1] % 32 == 0 else gguf.GGMLQuantizationType.F16
        return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind), np.float32)

    def get(name: str) -> Path:
        if name not in cache:
            src = tmp_path_factory.mktemp("deq") / name
            shutil.copytree(TINY / name, src, ignore=shutil.ignore_patterns("*.safetensors", "reference.npz"))
            ckpt = Checkpoint(TINY / name)
            write_safetensors(src / "model.safetensors", {n: roundtrip(ckpt.read(n)) for n in ckpt.tensors})
            cache[name] = converted(src, "fp32")
        return cache[name]

    return get


# --- the writer is llama.cpp's layout ---------------------------------------------------------------

def _metadata(path: Path) -> dict:
    r = gguf.GGUFReader(path)
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.size_label":  # size_label: llama.cpp's parameter-count label
            continue
        v = f.contents()
        out[k] = (v.item() if isinstance(v, np.generic) else v, [int(t) for t in f.types])
    return out


def _tensors(path: Path) -> dict:
    return {t.name: (t.tensor_type.name, t.shape.tolist(), t.data.tobytes()) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_writer_matches_llama_cpp(qtype, tmp_path):
    """stories260K-F32.gguf was made by convert_hf_to_gguf.py, -Q8_0 by llama.cpp's quantizer from it
    (scripts/make_gguf_fixtures.py): our writer gives the same metadata and the same tensor bytes (the
    q/k permutation, the F32 norms, Q8_0 blocks and the F16 fallback of ffn_down's 172-wide rows)."""
    theirs = FIXTURES / "gguf" / f"stories260K-{qtype}.gguf"
    if not theirs.exists():
        pytest.skip(f"{theirs} not present")
    ours = write_gguf(STORIES_SRC, tmp_path / "ours.gguf", qtype)
    assert _metadata(ours) == _metadata(theirs)
    a, b = _tensors(ours), _tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name][:2] == b[name][:2], name
        assert a[name][2] == b[name][2], f"{name}: bytes differ"


# --- parity ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_tokens_match_transformers(name, qtype, gguf_model, converted):
    ref = np.load(TINY / name / "reference.npz")
    prompt, expected = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
    out, rows = _greedy(gguf_model(name, qtype), prompt)
    step = KNOWN_Q8_0_FLIPS.get(name) if qtype == "Q8_0" else None
    if step is None:
        assert out == expected
        return
    # the documented Q8_0 flip, and nothing else: the same prefix, then a near-tie on both sides
    assert out[:step] == expected[:step]
    assert out[step] != expected[step], f"{name} at Q8_0 now matches transformers: update KNOWN_Q8_0_FLIPS"
    ours, theirs = out[step], expected[step]
    fp32 = _teacher_forced_rows(converted(TINY / name, "fp32"), prompt, expected)[step]  # = transformers within 1e-4
    ref_margin = fp32[theirs] - np.partition(fp32, -2)[-2]
    our_margin = rows[step][ours] - rows[step][theirs]
    assert int(fp32.argmax()) == theirs and 0 < ref_margin < NEAR_TIE, ref_margin
    assert int(np.argsort(-rows[step])[1]) == theirs and 0 < our_margin < NEAR_TIE, our_margin


@pytest.mark.parametrize("name", MODELS)
def test_f16_full_pass_logits(name, gguf_model, converted):
    ref = np.load(TINY / name / "reference.npz")
    ids = ref["input_ids"][0].tolist()
    logits = _full_pass(gguf_model(name, "F16"), ids)
    diff = np.abs(logits - ref["logits"])
    assert diff.max() < F16_MAX and diff.mean() < F16_MEAN, (diff.max(), diff.mean())
    hf_fp16 = _full_pass(converted(TINY / name, "fp16"), ids)
    assert np.abs(logits - hf_fp16).max() < SAME


@pytest.mark.parametrize("name", MODELS)
def test_q8_0_is_exactly_the_files_numbers(name, gguf_model, dequantized_q8_0):
    """--quant keep takes the Q8_0 blocks over exactly: the same logits and greedy sequence as the fp32
    model of the dequantized weights (so any distance to transformers is the file's own rounding)."""
    ref = np.load(TINY / name / "reference.npz")
    ids, prompt = ref["input_ids"][0].tolist(), ref["prompt_ids"].tolist()
    kept, deq = gguf_model(name, "Q8_0"), dequantized_q8_0(name)
    assert np.abs(_full_pass(kept, ids) - _full_pass(deq, ids)).max() < SAME_NUMBERS
    assert _greedy(kept, prompt)[0] == _greedy(deq, prompt)[0]
    m = read_manifest(kept)
    assert (m.quantization.weights, m.quantization.embedding, m.quantization.accuracy_level) == ("int8", "int8", 0)
    assert m.origin.format == "gguf" and m.origin.kept_exact == ("Q8_0",)


@pytest.mark.parametrize("name", MODELS)
def test_q8_0_logits_close_to_f16(name, gguf_model):
    ids = np.load(TINY / name / "reference.npz")["input_ids"][0].tolist()
    f16 = _full_pass(gguf_model(name, "F16"), ids)
    diff = _full_pass(gguf_model(name, "Q8_0"), ids) - f16
    assert np.abs(diff).max() < Q8_0_MAX, np.abs(diff).max()
    assert np.sqrt((diff ** 2).mean()) < Q8_0_RMS_OF_STD * f16.std()


# --- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_llama3_rope_freqs_refused(qtype, tmp_path):
    src = write_gguf(TINY / LLAMA3, tmp_path / f"{LLAMA3}-{qtype}.gguf", qtype)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(src).tensors}
    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match="rope_freqs"):
        convert(src, dst, quant="keep")
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # no .out.partial-PID left either


# --- tokenizer ---------------------------------------------------------------------------------------

TEXTS = ["Once upon a time, there was a little girl named Lily.", " leading space", "trailing space ",
         "  two leading,   three inside  ", "line one\nline two\n\nend\n", "\n", "tabs\tand\r\nreturns",
         "unicode: café naïve Über 日本語 🙂 ✓", "digits 0123456789, 3.14159 and 2024-05-01", "x", "don't",
         "Tom said, \"Let's go!\""]
SPECIAL_TEXTS = ["<s> and </s> as text", "<s>Hi", "Hi</s>", "a<s>b"]


@pytest.mark.parametrize("name", ["llama2_gqa_tied", "qwen2_bias_tied"])  # llama and qwen2 metadata
def test_rebuilt_tokenizer_matches_sentencepiece(name, gguf_model):
    import sentencepiece as spm

    folder = gguf_model(name, "F16")
    info = read_manifest(folder).tokenizer
    assert (info.kind, info.add_bos, info.bos_token_id, info.eos_token_ids) == ("hf_tokenizers", True, 1, (2,))
    tok = Tokenizer(folder, info)
    sp = spm.SentencePieceProcessor(model_file=str(TINY / name / "tokenizer.model"))
    for text in TEXTS:
        ids = sp.encode(text)
        assert tok.encode(text, add_bos=False) == ids, text
        assert tok.encode(text) == [1, *ids], text
        assert tok.decode(ids) == sp.decode(ids), text
    # control pieces written as text: the same ids as the runtime's SentencePiece tokenizer of the
    # Hugging Face folder (raw SentencePiece would spell "<s>" out; both runtimes map it to its id)
    hf = Tokenizer(TINY / name, TokenizerInfo(kind="sentencepiece", add_bos=True, bos_token_id=1,
                                              eos_token_ids=(2,), chat_template=None))
    for text in SPECIAL_TEXTS:
        assert tok.encode(text, add_bos=False) == hf.encode(text, add_bos=False), text

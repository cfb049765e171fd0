"""Hostile tests for GGUF import (`edgeinfer convert FILE.gguf`): each reproduces one defect found by
attacking the importer as a user with a damaged or odd file would, and passes once it is fixed.

The rule every test states: a GGUF file either converts into a folder that loads and runs, or
`convert` raises ConvertError (a one-line CLI error) and leaves nothing behind. Never another
exception (a traceback), never a folder that its own loader rejects or whose logits are NaN.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import edgeinfer  # noqa: E402
from conftest import FIXTURES  # noqa: E402
from edgeinfer.converters import convert  # noqa: E402
from edgeinfer.converters.gguf_checkpoint import GGUFCheckpoint  # noqa: E402
from edgeinfer.converters.gguf_header import read_header  # noqa: E402
from edgeinfer.converters.gguf_tokenizer import tokenizer_info, tokenizer_json  # noqa: E402
from edgeinfer.errors import ConvertError  # noqa: E402

Q8 = FIXTURES / "gguf" / "stories260K-Q8_0.gguf"
Q4 = FIXTURES / "gguf" / "stories260K-Q4_0.gguf"
F32 = FIXTURES / "gguf" / "stories260K-F32.gguf"
V = gguf.GGUFValueType
DROP = object()


def _mutate(src: Path, dst: Path, fields: dict | None = None, tensors=None) -> Path:
    """A copy of GGUF `src` with metadata replaced ({key: (value, value type[, item type])} or DROP;
    the type may differ from the original's) and its tensor list passed through `tensors`
    ([name, type name, shape (HF order), raw uint8 bytes] each)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    fields = dict(fields or {})
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        spec = fields.pop(name, None)
        if spec is DROP:
            continue
        if spec is None:
            spec = (f.contents(), f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None)
        w.add_key_value(name, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    for name, spec in fields.items():
        if spec is not DROP:
            w.add_key_value(name, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    ts = [[t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
           np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy()] for t in r.tensors]
    if tensors is not None:
        ts = tensors(ts)
    for name, q, shape, raw in ts:
        qt = gguf.GGMLQuantizationType[q]
        plain = {"F32": np.float32, "F16": np.float16}.get(q)
        w.add_tensor_info(name, shape if plain else gguf.quant_shape_to_byte_shape(shape, qt), plain or np.uint8,
                          raw.nbytes, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for *_, raw in ts:
        w.write_tensor_data(raw)
    w.close()
    return dst


def _converts_cleanly_or_refuses(tmp_path: Path, src: Path, **kw) -> None:
    """The contract: ConvertError and nothing written, or a folder that loads and generates."""
    dst = tmp_path / "out"
    try:
        convert(src, dst, **kw)
    except ConvertError:
        assert not dst.exists()
        assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
        return
    # any other exception propagates and fails the test (a CLI traceback)
    model = edgeinfer.load(dst)  # must not raise: convert said it succeeded
    model.generate("Once upon a time", max_new_tokens=4, temperature=0)  # must not raise "logits contain NaN"


# --- 1. wrong-typed metadata escapes as ValueError / TypeError (a CLI traceback) ------------------

@pytest.mark.parametrize("fields", [
    {"llama.attention.layer_norm_rms_epsilon": ("abc", V.STRING)},
    {"llama.attention.layer_norm_rms_epsilon": ([1e-5], V.ARRAY, V.FLOAT32)},
    {"llama.rope.freq_base": ("x", V.STRING)},
    {"llama.rope.dimension_count": ("x", V.STRING)},
    {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": ("x", V.STRING)},
    {"tokenizer.ggml.unknown_token_id": ("0", V.STRING)},
    {"tokenizer.ggml.scores": (["a"] * 512, V.ARRAY, V.STRING)},
], ids=["eps_str", "eps_array", "freq_base_str", "rope_dim_str", "scaling_factor_str", "unk_id_str", "scores_str"])
def test_wrong_typed_metadata_is_a_convert_error(tmp_path, fields):
    src = _mutate(Q8, tmp_path / "bad.gguf", fields)
    with pytest.raises(ConvertError):
        convert(src, tmp_path / "out")


# --- 2. metadata that converts into a folder that cannot load or gives NaN logits -----------------

@pytest.mark.parametrize("fields", [
    {"llama.attention.layer_norm_rms_epsilon": (-1.0, V.FLOAT32)},  # ORT refuses SkipLayerNorm at load
    {"llama.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)},
    {"llama.rope.freq_base": (0.0, V.FLOAT32)},  # inv_freq inf: NaN logits
    {"llama.rope.freq_base": (-10000.0, V.FLOAT32)},
    {"llama.rope.freq_base": (float("nan"), V.FLOAT32)},
    {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (0.0, V.FLOAT32)},
    {"tokenizer.ggml.bos_token_id": (99999, V.UINT32)},  # load: token id not in the vocabulary
    {"tokenizer.ggml.eos_token_id": (99999, V.UINT32)},
    {"tokenizer.ggml.bos_token_id": ("1", V.STRING)},  # the manifest written fails its own schema
    {"tokenizer.chat_template": ("{% if %}", V.STRING)},  # load refuses the whole model
    {"tokenizer.chat_template": ("{{ messages | nosuchfilter }}", V.STRING)},  # parses, does not compile
], ids=["eps_neg", "eps_nan", "theta_0", "theta_neg", "theta_nan", "linear_factor_0", "bos_oob", "eos_oob",
        "bos_str", "template_unparsable", "template_unknown_filter"])
def test_metadata_that_breaks_the_model_is_refused_at_convert(tmp_path, fields):
    _converts_cleanly_or_refuses(tmp_path, _mutate(Q8, tmp_path / "bad.gguf", fields))


def test_more_tokens_than_embedding_rows_is_refused(tmp_path):
    """llama.cpp refuses this file (token_embd must have one row per token); we convert it and the
    extra tokens' ids fail only when a prompt contains them."""
    r = gguf.GGUFReader(Q8)
    extra = [f"<extra_{i}>" for i in range(8)]
    src = _mutate(Q8, tmp_path / "more.gguf", {
        "tokenizer.ggml.tokens": (r.fields["tokenizer.ggml.tokens"].contents() + extra, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": (r.fields["tokenizer.ggml.scores"].contents() + [0.0] * 8, V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": (r.fields["tokenizer.ggml.token_type"].contents() + [4] * 8, V.ARRAY, V.INT32)})
    with pytest.raises(ConvertError):
        convert(src, tmp_path / "out")


def test_accuracy_level_bool_does_not_write_an_unloadable_manifest(tmp_path):
    _converts_cleanly_or_refuses(tmp_path, Q4, accuracy_level=True)


# --- 3. tokenizer metadata that the tokenizers library rejects with a bare Exception ---------------

def _bpe_meta(**over) -> dict:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": ["a", "b", "ab", "c"], "tokenizer.ggml.token_type": [1, 1, 1, 1],
            "tokenizer.ggml.merges": ["a b"]}
    meta.update({f"tokenizer.ggml.{k}": v for k, v in over.items()})
    return meta


@pytest.mark.parametrize("over", [
    {"merges": ["a b", "x y"]},  # a merge of tokens not in the vocabulary
    {"merges": ["a b c"]},  # three parts
    {"merges": [" a"]},  # an empty part
    {"tokens": ["a", "b", "x", "c"]},  # a merge result ("ab") missing, e.g. replaced by a duplicate
], ids=["merge_oov", "merge_three", "merge_empty_part", "merge_result_missing"])
def test_malformed_bpe_vocabulary_is_a_convert_error(over):
    """Today: the tokenizers library's bare `Exception` ("Error while initializing BPE"), a traceback,
    raised only after the whole graph and its weights were written."""
    with pytest.raises(ConvertError):
        tokenizer_json(_bpe_meta(**over), "x.gguf")


# --- 4. the tensor table: llama.cpp refuses duplicate, overlapping and unaligned tensors ----------

def _patch_offset(src: Path, dst: Path, name: str, rel_offset: int) -> Path:
    data = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, i)[0]
    struct.pack_into("<Q", data, i + 4 + 8 * n_dims + 4, rel_offset)
    dst.write_bytes(bytes(data))
    return dst


def _rel_offsets(path: Path) -> dict:
    _, entries = read_header(path)
    start = min(e.offset for e in entries)
    return {e.name: e.offset - start for e in entries}


def test_duplicate_tensor_name_is_refused(tmp_path):
    def add_dup(ts):
        q = next(t for t in ts if t[0] == "blk.0.attn_q.weight")
        return ts + [["blk.0.attn_q.weighX", q[1], q[2], np.zeros_like(q[3])]]

    tmp = _mutate(Q8, tmp_path / "d0.gguf", tensors=add_dup)
    (tmp_path / "dup.gguf").write_bytes(tmp.read_bytes().replace(b"blk.0.attn_q.weighX", b"blk.0.attn_q.weight"))
    with pytest.raises(ConvertError):
        GGUFCheckpoint(tmp_path / "dup.gguf")


def test_overlapping_tensors_are_refused(tmp_path):
    offs = _rel_offsets(Q8)
    src = _patch_offset(Q8, tmp_path / "overlap.gguf", "blk.0.attn_k.weight", offs["blk.0.attn_q.weight"])
    with pytest.raises(ConvertError):
        GGUFCheckpoint(src)


def test_unaligned_tensor_offset_is_refused(tmp_path):
    """Converted today; generation then raises 'logits contain NaN'."""
    offs = _rel_offsets(Q8)
    src = _patch_offset(Q8, tmp_path / "unaligned.gguf", "blk.0.attn_k.weight", offs["blk.0.attn_k.weight"] + 1)
    with pytest.raises(ConvertError):
        GGUFCheckpoint(src)


# --- 5. non-finite fp16 scales: converted, then every generation fails with "logits contain NaN" ---

def _poison(ts, name: str, value: float, block_bytes: int, block: int = 0):
    for t in ts:
        if t[0] == name:
            t[3][block * block_bytes:block * block_bytes + 2] = np.array([value], np.float16).view(np.uint8)
    return ts


@pytest.mark.parametrize("src,name,value,block_bytes,block", [
    (Q8, "blk.0.attn_q.weight", np.nan, 34, 0),
    (Q8, "blk.0.attn_q.weight", np.inf, 34, 0),
    (Q4, "blk.0.ffn_up.weight", np.nan, 18, 0),
    (Q8, "token_embd.weight", np.nan, 34, 1000),  # one embedding row (token 500): the tied head NaNs every step
], ids=["q8_nan", "q8_inf", "q4_nan", "embedding_row_nan"])
def test_non_finite_block_scale_is_refused_at_convert(tmp_path, src, name, value, block_bytes, block):
    bad = _mutate(src, tmp_path / "nan.gguf", tensors=lambda ts: _poison(ts, name, value, block_bytes, block))
    with pytest.raises(ConvertError):
        convert(bad, tmp_path / "out")


# --- 6. two threads converting to the same destination share one temporary folder -----------------

def test_two_threads_converting_to_one_destination(tmp_path):
    """The temporary folder is named after the pid only (".out.partial-PID"): the second thread's
    rmtree deletes the first's work, the loser reports an internal path, and in about 2 runs in 5
    the winner returns success over a folder whose model.onnx.data does not match its manifest."""
    for trial in range(3):
        root = tmp_path / str(trial)
        root.mkdir()
        dst, errors = root / "out", []

        def work():
            try:
                convert(Q8, dst)
            except ConvertError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not [e for e in errors if ".partial-" in e], errors  # no leak of the temporary folder's name
        assert len(errors) < 2
        edgeinfer.load(dst).generate("Once", max_new_tokens=2, temperature=0)  # the folder that won is whole


# --- 7. inspect's origin line, tokenizer defaults as llama.cpp reads them -------------------------

def test_inspect_does_not_say_requantized_for_a_float_gguf_kept(tmp_path):
    from edgeinfer.inspect import describe

    convert(F32, tmp_path / "f32")  # --quant keep: every tensor stored as the file holds it (fp32)
    line = describe(tmp_path / "f32").splitlines()[-1]
    assert "re-quantized" not in line, line


def test_gpt2_pre_tokenizer_name_as_llama_cpp_writes_it():
    """convert_hf_to_gguf.py writes "gpt-2" (llama.cpp refuses "gpt2", which we accept instead)."""
    tokenizer_json(_bpe_meta(pre="gpt-2"), "x.gguf")


def test_llama_bpe_without_add_bos_key_adds_bos_as_llama_cpp_does():
    """llama.cpp (llama-vocab.cpp) sets add_bos for the llama3 / llama-bpe pre-tokenizer when the
    file has no tokenizer.ggml.add_bos_token; we add none."""
    meta = _bpe_meta(pre="llama-bpe", bos_token_id=1)
    assert tokenizer_info(meta).add_bos


def test_a_normal_token_twice_in_the_vocabulary_is_refused(tmp_path):
    """Token 511 renamed to "," (id 432's text): "," encoded as 511 and a generated 432 decoded to
    nothing, so commas vanished from the text and perplexity went 5.84 -> 10.25 (hostile review)."""
    r = gguf.GGUFReader(Q8)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    comma = tokens.index(",")
    last = max(i for i, t in enumerate(types) if t == 1 and i != comma)
    tokens[last] = ","
    src = _mutate(Q8, tmp_path / "dup.gguf", {"tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING)})
    with pytest.raises(ConvertError, match="the token ',' is both id"):
        convert(src, tmp_path / "out")


@pytest.mark.parametrize("types", [[1, 1, 1, 1, 3, 3], [1, 1, 1, 1, 4, 3], [1, 1, 1, 1, 6, 6]],
                         ids=["control", "user_defined_and_control", "byte"])
def test_any_text_two_ids_share_is_refused(types):
    """Two control tokens of one text converted: the earlier id had no token (its logprobs a 500 in
    the daemon) and the vocabulary's last token decoded to nothing (a hostile round)."""
    meta = _bpe_meta(tokens=["a", "b", "ab", "c", "<x>", "<x>"], token_type=types)
    with pytest.raises(ConvertError, match="the token '<x>' is both id 4 and id 5"):
        tokenizer_json(meta, "x.gguf")


@pytest.mark.parametrize("types", [[1, 1, 1, 1, 3, 3, 1], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 5, 1]],
                         ids=["control", "normal", "normal_and_unused"])
def test_empty_tokens_are_named_as_llama_cpp_names_them_and_every_id_keeps_its_token(types):
    """Two empty tokens: the earlier id had no token and the vocabulary's last lost its text (empty control
    tokens), or the file was refused (empty normal ones), where llama.cpp names each [EMPTY_<id>] (a review)."""
    from tokenizers import Tokenizer

    tokens = ["a", "b", "ab", "c", "", "", "d"]
    tok = Tokenizer.from_str(tokenizer_json(_bpe_meta(tokens=tokens, token_type=types), "x.gguf"))
    assert [tok.id_to_token(i) for i in range(7)] == ["a", "b", "ab", "c", "[EMPTY_4]", "[EMPTY_5]", "d"]
    assert tok.encode("abd").ids == [2, 6] and tok.decode([6]) == "d"


def test_a_merge_listed_twice_keeps_its_first_rank_as_llama_cpp_does():
    """The tokenizers library ranks a repeated merge by its last place: "abc" split as a|bc, where
    llama.cpp (its first place) gives ab|c; one repeated merge changed SmolLM2's ids (a hostile round)."""
    from tokenizers import Tokenizer

    for merges, want in ((["a b", "b c"], ["ab", "c"]), (["a b", "b c", "a b"], ["ab", "c"]),
                         (["b c", "a b"], ["a", "bc"]), (["b c", "a b", "b c"], ["a", "bc"])):
        meta = _bpe_meta(tokens=["a", "b", "c", "ab", "bc"], token_type=[1] * 5, merges=merges)
        assert Tokenizer.from_str(tokenizer_json(meta, "x.gguf")).encode("abc").tokens == want, merges


def test_tokens_that_end_a_turn_by_their_text_end_a_generation_as_in_llama_cpp():
    """A file whose EOS is <|endoftext|> and whose chat template ends turns with <|im_end|> (no EOT id):
    llama.cpp stops at both, by their text; here the replies ran on to max_tokens (a hostile round)."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "c", "<|eot_id|>", "<|end|x",
              "<|file_sep|>", "<|fim_pad|>"]
    meta = _bpe_meta(tokens=tokens, token_type=[3, 3, 3, 1, 1, 1, 1, 1, 3, 3, 3], eos_token_id=0, bos_token_id=1)
    assert tokenizer_info(meta).eos_token_ids == (0, 10, 9, 2, 7)  # EOS first (the template's eos_token), the
    meta["tokenizer.ggml.eot_token_id"] = 7  # fill-in-the-middle pad, repository and file separators, the texts
    meta["tokenizer.ggml.fim_pad_token_id"] = 3  # a FIM key's id rather than its texts, as llama.cpp takes it
    assert tokenizer_info(meta).eos_token_ids == (0, 7, 3, 9, 2)


def test_a_metadata_key_given_twice_is_refused(tmp_path):
    """The second value silently won; llama.cpp's reader refuses such a file ("duplicate key")."""
    def kv(key: str, value: int) -> bytes:
        k = key.encode()
        return struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, value)  # type 4: uint32

    path = tmp_path / "twice.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + kv("llama.block_count", 5)
                     + kv("llama.context_length", 512) + kv("llama.block_count", 6))
    with pytest.raises(ValueError, match="'llama.block_count' appears twice"):
        read_header(path)
    with pytest.raises(ConvertError, match="appears twice"):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields, says", [
    ({"llama.attention.key_length": ("8", V.STRING)}, "key_length must be a positive integer, got '8'"),
    ({"llama.attention.key_length": (0, V.UINT32)}, "key_length must be a positive integer, got 0"),
    ({"llama.attention.key_length": (16, V.UINT32), "llama.attention.value_length": (16, V.UINT32)},
     "rope.dimension_count 8 differs from the head size 16 (llama.attention.key_length)"),
    ({"llama.rope.dimension_count": (6, V.UINT32)}, "rope.dimension_count 6 differs from the head size 8"),
])
def test_head_size_metadata_errors_name_the_keys(tmp_path, fields, says):
    """These said "key and value head sizes differ (8 and 8)" (a string against an int) or
    "rope.dimension_count other than 1.0 is not supported" (a ratio under the name of a count)."""
    src = _mutate(Q8, tmp_path / "m.gguf", fields)
    with pytest.raises(ConvertError) as e:
        convert(src, tmp_path / "out")
    assert says in str(e.value)


@pytest.mark.parametrize("case", ["long piece", "nested pieces"])
def test_a_crafted_sentencepiece_vocabulary_is_refused_in_proportion_to_its_size(tmp_path, case):
    """Hostile convert test: a 'llama' vocabulary's merges were built by trying every split of every
    piece, so one 1,000,000-character piece took 2 minutes (quadratic) and pieces z, zz, ... z*1000
    (a 1.7 MB file) 3.2 GB (cubic). Both are refused now, quickly and within a small memory."""
    import resource
    import time

    r = gguf.GGUFReader(Q8)
    toks = list(r.fields["tokenizer.ggml.tokens"].contents())
    scores = list(r.fields["tokenizer.ggml.scores"].contents())
    types = list(r.fields["tokenizer.ggml.token_type"].contents())
    if case == "long piece":
        toks[500] = "a" * 1_000_000
    else:  # new pieces replace the last 300 normal ones: the embedding keeps its rows
        for k, i in enumerate(range(len(toks) - 300, len(toks)), start=1):
            toks[i], scores[i], types[i] = "\u03b6" * k, -1000.0 - k, 1
    src = _mutate(Q8, tmp_path / "crafted.gguf", {"tokenizer.ggml.tokens": (toks, V.ARRAY, V.STRING),
                                                  "tokenizer.ggml.scores": (scores, V.ARRAY, V.FLOAT32),
                                                  "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32)})
    rss0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(ConvertError, match="characters long|nest into more merges"):
        convert(src, tmp_path / "out")
    assert time.perf_counter() - t0 < 30 and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 500_000
    assert not (tmp_path / "out").exists()


# --- metadata read as llama.cpp reads it (a fidelity round against llama.cpp, 2026-12-01) -----------

def _logits(folder: Path, ids=(1, 400, 401, 402, 403)) -> np.ndarray:
    from edgeinfer.engine import Engine
    from edgeinfer.session import DecoderSession

    eng = Engine(DecoderSession(folder))
    return eng.forward(eng.new_cache(64, 0), list(ids), all_logits=True).copy()


@pytest.mark.parametrize("fields", [
    {"llama.rope.scaling.factor": (4.0, V.FLOAT32)},  # no type: llama.cpp's default is linear
    {"llama.rope.scale_linear": (4.0, V.FLOAT32)},  # the older key
], ids=["factor_without_type", "scale_linear"])
def test_a_rope_factor_is_read_as_llama_cpp_reads_it(tmp_path, fields):
    """Both converted with exit 0 and no scaling at all (logits 33-49 from llama.cpp's)."""
    want = convert(_mutate(F32, tmp_path / "typed.gguf", {"llama.rope.scaling.type": ("linear", V.STRING),
                                                          "llama.rope.scaling.factor": (4.0, V.FLOAT32)}),
                   tmp_path / "typed", quant="fp32")
    got = convert(_mutate(F32, tmp_path / "bare.gguf", fields), tmp_path / "bare", quant="fp32")
    assert (got.arch.rope.type, got.arch.rope.factor) == ("linear", 4.0) == (want.arch.rope.type, want.arch.rope.factor)
    assert np.abs(_logits(tmp_path / "bare") - _logits(tmp_path / "typed")).max() == 0


@pytest.mark.parametrize("fields,needle", [
    ({"llama.rope.scaling.attn_factor": (0.5, V.FLOAT32)}, "attn_factor"),  # llama.cpp scales q and k by it
    ({"llama.attention.causal": (False, V.BOOL)}, "non-causal"),  # llama.cpp attends both ways
    ({"llama.attention.causal": (1, V.UINT32)}, "causal must be a boolean, got int 1"),  # (was called non-causal)
    ({"tokenizer.ggml.add_eos_token": (True, V.BOOL)}, "add_eos_token"),  # llama.cpp appends EOS to every prompt
], ids=["attn_factor", "non_causal", "causal_int", "add_eos"])
def test_metadata_that_changes_the_math_we_do_not_build_is_refused_by_name(tmp_path, fields, needle):
    with pytest.raises(ConvertError, match=needle):
        convert(_mutate(F32, tmp_path / "bad.gguf", fields), tmp_path / "out", quant="fp32")
    assert not (tmp_path / "out").exists()


def test_a_sentencepiece_vocabulary_without_special_ids_gets_llama_cpps_defaults(tmp_path):
    src = _mutate(F32, tmp_path / "noids.gguf", {"tokenizer.ggml.bos_token_id": DROP,
                                                 "tokenizer.ggml.eos_token_id": DROP})
    m = convert(src, tmp_path / "out", quant="fp32")
    assert (m.tokenizer.bos_token_id, m.tokenizer.eos_token_ids, m.tokenizer.add_bos) == (1, (2,), True)
    assert edgeinfer.load(tmp_path / "out").tokenizer.encode("x")[0] == 1


@pytest.mark.parametrize("n_tensors, n_kv, says", [(1 << 16 | 1, 0, "65537 tensors"), (0, 1 << 16 | 1, "65537 metadata")])
def test_counts_past_any_real_model_are_refused_before_reading(tmp_path, n_tensors, n_kv, says):
    """A hostile review: 3 million tiny tensor entries (a 114 MB file) took 1.1 GB and 36 s to read
    before the first was refused; the counts are now bounded far above any real model's."""
    import time

    path = tmp_path / "many.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"\0" * (2 << 20))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=says):
        read_header(path)
    assert time.perf_counter() - t0 < 1


def test_a_string_array_past_any_vocabulary_is_refused(tmp_path):
    k = b"tokenizer.ggml.tokens"
    n = (1 << 21) + 1
    path = tmp_path / "vocab.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(k)) + k
                     + struct.pack("<IIQ", 9, 8, n) + struct.pack("<Q", 1) * 2 * n)
    with pytest.raises(ValueError, match="more than the 2097152 read"):
        read_header(path)


def test_an_alignment_given_as_a_bool_is_refused(tmp_path):
    """`general.alignment` True read as 1: the file was misread and caught only later, as a
    "non-finite scale" (a hostile review)."""
    src = _mutate(Q8, tmp_path / "align.gguf", {"general.alignment": (True, V.BOOL)})
    with pytest.raises(ValueError, match="general.alignment True"):
        read_header(src)


def test_a_gguf_without_its_vocabulary_says_so(tmp_path):
    """It said "tokenizer.ggml.bos_token_id must be a token id below 0, got 1" (a hostile review)."""
    src = _mutate(Q8, tmp_path / "novocab.gguf", {"tokenizer.ggml.tokens": DROP})
    with pytest.raises(ConvertError, match="tokenizer.ggml.tokens .the vocabulary. is missing"):
        convert(src, tmp_path / "out")


def test_a_tensor_retyped_smaller_is_refused_by_the_gap_it_leaves(tmp_path):
    """A hostile review: an F32 norm's type changed to F16 in the tensor table (same offsets) converted
    silently into a model of garbage; the half of its bytes that then belong to no tensor show it."""
    import shutil

    src = tmp_path / "retyped.gguf"
    shutil.copy(F32, src)
    _meta, table = read_header(F32)
    raw = bytearray(src.read_bytes())
    norm = next(t for t in table if t.name.endswith("attn_norm.weight"))
    name = norm.name.encode()
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", raw, type_at)[0] == 0  # F32
    struct.pack_into("<I", raw, type_at, 1)  # F16
    src.write_bytes(bytes(raw))
    with pytest.raises(ConvertError, match="belong to no tensor"):
        convert(src, tmp_path / "out")


# --- a hostile round, 2026-12-02 (third) ----------------------------------------------------------

def _scale_of(ts, name: str, value: float, block_bytes: int, block: int):
    return _poison(ts, name, value, block_bytes, block)


@pytest.mark.parametrize("quant", [None, "int8"], ids=["keep", "int8"])
def test_a_flipped_scale_bit_is_refused_when_the_blocks_are_kept_too(tmp_path, quant):
    """One Q8_0 scale 0.0146 -> 955.5 (an exponent bit): weights of 1.2e5. --quant int8 refused the file
    as damaged; the default --quant keep, which takes the blocks over, converted it with rc 0 and the
    text changed."""
    bad = _mutate(Q8, tmp_path / "flip.gguf", tensors=lambda ts: _scale_of(ts, "blk.3.attn_q.weight", 955.5, 34, 109))
    with pytest.raises(ConvertError, match=r"(blk.3.attn_q|layers.3.self_attn.q_proj).weight.*magnitude"):
        convert(bad, tmp_path / "out", **({"quant": quant} if quant else {}))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("alias", ["blk.01.attn_q.weight", "blk.\u0661.attn_q.weight"], ids=["leading_zero", "arabic"])
def test_a_tensor_name_that_names_a_layer_a_second_way_is_refused(tmp_path, alias):
    """"blk.01" (or an Arabic-Indic one) was read as layer 1 beside "blk.1": the later of the two was
    used, and a crafted file changed the model's text with rc 0 (llama.cpp does not read such a name)."""
    def add(ts):
        q2 = next(t for t in ts if t[0] == "blk.2.attn_q.weight")
        return ts + [[alias, q2[1], q2[2], q2[3].copy()]]
    with pytest.raises(ConvertError, match="does not know"):
        convert(_mutate(Q8, tmp_path / "alias.gguf", tensors=add), tmp_path / "out")


@pytest.mark.parametrize("fields,needle", [
    ({"llama.rope.scaling.factor": ([2.0, 3.0], V.ARRAY, V.FLOAT32)}, "must be a single value"),
    ({"llama.attention.sliding_window": ([8, 8], V.ARRAY, V.UINT32)}, "must be a single value"),
    ({"llama.rope.scaling.attn_factor": ([1.0, 1.0], V.ARRAY, V.FLOAT32)}, "must be a single value"),
    ({"tokenizer.ggml.tokens": (list(range(512)), V.ARRAY, V.UINT32)}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": (["llama"], V.ARRAY, V.STRING)}, "tokenizer.ggml.model must be a string"),
    ({"llama.context_length": DROP}, "llama.context_length is missing"),
    ({"llama.attention.layer_norm_rms_epsilon": DROP}, "layer_norm_rms_epsilon is missing"),
    ({"tokenizer.ggml.token_type": ([-1] * 512, V.ARRAY, V.INT32)}, "not a token type"),
], ids=["factor_array", "window_array", "attn_factor_array", "tokens_ints", "model_array", "no_context",
        "no_eps", "token_type_neg"])
def test_metadata_of_the_wrong_shape_or_missing_is_one_line_not_a_guess(tmp_path, fields, needle):
    """Arrays where one value belongs were TypeError / ValueError tracebacks; a missing trained length
    or norm epsilon was guessed (2048: a 512-token model got a 1920-token ring; 1e-6 for 1e-5), where
    llama.cpp refuses the file; token types outside llama.cpp's 0-6 built no merges (18 ids for a
    5-token prompt)."""
    with pytest.raises(ConvertError, match=needle):
        convert(_mutate(Q8, tmp_path / "bad.gguf", fields), tmp_path / "out")


def test_a_string_array_architecture_is_refused_in_one_line(tmp_path):
    """A TypeError traceback (an unhashable list looked up among the architectures)."""
    src = tmp_path / "arch.gguf"
    data = bytearray(Q8.read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key)  # its value: type 8 (string), then the string
    assert struct.unpack_from("<I", data, at)[0] == 8
    n = struct.unpack_from("<Q", data, at + 4)[0]
    value = bytes(data[at + 12:at + 12 + n])
    data[at:at + 12 + n] = struct.pack("<IIQQ", 9, 8, 1, n) + value  # an array of one string
    src.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match="architecture .* is not supported"):
        convert(src, tmp_path / "out")


def test_string_arrays_are_bounded_in_all_not_each(tmp_path):
    """Unused arrays of one-letter strings under the per-array bound took 958 MB for a 110 MB file."""
    k, n = b"junk.a", (1 << 20) + 1
    one = struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, 8, n) + (struct.pack("<Q", 1) + b"x") * n
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + one + one.replace(b"junk.a", b"junk.b"))
    with pytest.raises(ValueError, match="strings in arrays"):
        read_header(path)


def test_names_from_the_file_are_shown_escaped_and_short(tmp_path):
    """An unknown tensor named with terminal escapes cleared the screen and printed a fake line; a
    10 MB name made a 10 MB error line. A file named my_vocab_size.gguf was reported by the keys'
    rewriting as my_llama.vocab_size.gguf."""
    def add(ts):
        t = ts[-1]
        return ts + [["x\x1b[2J\nconverted OK" + "y" * 100_000, t[1], t[2], t[3].copy()]]
    with pytest.raises(ConvertError) as e:
        convert(_mutate(Q8, tmp_path / "esc.gguf", tensors=add), tmp_path / "out")
    msg = str(e.value)
    assert "\x1b" not in msg and "\n" not in msg and len(msg) < 400 and "\\x1b[2J" in msg
    src = _mutate(Q8, tmp_path / "my_vocab_size_test.gguf", {"llama.vocab_size": (500, V.UINT32)})
    with pytest.raises(ConvertError, match="^my_vocab_size_test.gguf metadata"):
        convert(src, tmp_path / "out")


# --- a hostile round, 2026-12-03 ------------------------------------------------------------------

def _retype(src: Path, dst: Path, tensor: str, type_id: int) -> Path:
    """A copy of `src` with one tensor's type number changed in the table (its offset and bytes kept)."""
    raw = bytearray(src.read_bytes())
    name = tensor.encode()
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    struct.pack_into("<I", raw, at + 4 + 8 * struct.unpack_from("<I", raw, at)[0], type_id)
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("type_id", [2, 3, 6, 7, 8], ids=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_last_tensor_retyped_smaller_is_refused_by_the_bytes_after_it(tmp_path, type_id):
    """Only the gaps between tensors were checked: the file's last tensor (an F32 norm, in real files
    too) retyped to a smaller type converted with rc 0 into a model of garbage (a hostile round)."""
    last = max(read_header(F32)[1], key=lambda t: t.offset).name
    with pytest.raises(ConvertError, match=f"the last tensor, '{last}', ends at byte .* belong to no tensor"):
        convert(_retype(F32, tmp_path / "bad.gguf", last, type_id), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("align", [16, 8, 4])
def test_a_smaller_alignment_that_moves_the_data_is_refused(tmp_path, align):
    """general.alignment made smaller: every tensor read a few bytes early, converted with rc 0 (text
    "time time time"); the bytes left after the last tensor show it."""
    src = _mutate(F32, tmp_path / "align.gguf", {"general.alignment": (align, V.UINT32)})
    _meta, table = read_header(src)
    assert min(t.offset for t in table) % 32  # the precondition: the header's end rounds up to another start
    with pytest.raises(ConvertError, match="the last tensor, .* belong to no tensor"):
        convert(src, tmp_path / "out")


@pytest.mark.parametrize("key,value,vtype", [
    ("llama.attention.layer_norm_rms_epsilon", 925353388, V.UINT32),  # 1e-5's float32 bits read as a u32
    ("llama.rope.freq_base", 1176256512, V.INT32),
    ("llama.rope.scaling.factor", 4, V.UINT32),
], ids=["eps_u32", "freq_base_i32", "factor_u32"])
def test_a_float_key_stored_as_an_integer_is_refused(tmp_path, key, value, vtype):
    """The value type changed from FLOAT32 to an integer (a bit or two): the epsilon converted as
    925,353,388 and the model gave "time time time" (a hostile round); llama.cpp refuses it too."""
    with pytest.raises(ConvertError, match=f"{key} must be stored as a float, got int"):
        convert(_mutate(Q8, tmp_path / "bad.gguf", {key: (value, vtype)}), tmp_path / "out")


def test_a_re_quantized_tensor_with_an_infinite_scale_is_refused_without_numpy_warnings(tmp_path):
    """A Q5_1 tensor (dequantized, then re-quantized) whose first scale is infinite: the refusal
    ("holds NaN or infinite values") came after two lines of numpy's RuntimeWarnings (a hostile round)."""
    import warnings

    def q5_1(ts):
        for t in ts:
            if t[0] == "blk.0.ffn_up.weight":
                f = np.random.default_rng(0).standard_normal(t[2], dtype=np.float32) * 0.02
                raw = gguf.quants.quantize(f, gguf.GGMLQuantizationType.Q5_1).view(np.uint8).reshape(-1).copy()
                raw[0:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # the first block's scale
                t[1], t[3] = "Q5_1", raw
        return ts

    src = _mutate(Q8, tmp_path / "inf.gguf", tensors=q5_1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning is an exception here: it must not be raised
        with pytest.raises(ConvertError, match="holds NaN or infinite values"):
            convert(src, tmp_path / "out")


@pytest.mark.parametrize("argv", [[], ["--quant", "int8"], ["--block-size", "64"], ["--quant", "int4", "--recipe", "gptq"]],
                         ids=["no_quant", "int8", "block", "recipe"])
def test_a_gguf_file_via_optimum_is_refused_for_what_it_is(tmp_path, capsys, argv):
    """Without --quant the refusal blamed "the other convert options", none of which were given (a
    hostile round): the CLI's default for a GGUF file (keep) reached the options' check first; and
    with --recipe it blamed --recipe, which changing would not have helped."""
    from edgeinfer.cli import main

    assert main(["convert", str(Q8), "-o", str(tmp_path / "out"), "--via", "optimum", *argv]) == 1
    assert "--via optimum exports Hugging Face model folders only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unknown_tensor_amid_the_data_is_named_not_called_damage(tmp_path):
    """llama-quantize writes rope_freqs.weight between output_norm and token_embd (its weights map is
    sorted by name): the gaps check, run first over the known tensors, called such a file's table
    damaged where the refusal names rope_freqs (a review)."""
    def insert(ts):
        freqs = np.ones(8, np.float32).view(np.uint8).copy()
        return ts[:len(ts) // 2] + [["rope_freqs.weight", "F32", (8,), freqs]] + ts[len(ts) // 2:]

    with pytest.raises(ConvertError, match="'rope_freqs.weight'.*Llama 3.1-style rope scaling is not supported"):
        convert(_mutate(Q8, tmp_path / "freqs.gguf", tensors=insert), tmp_path / "out")

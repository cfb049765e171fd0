"""Hostile source folders for `edgeinfer convert` (found by attacking the converter with damaged and
crafted Hugging Face folders): each is a one-line error before anything harmful happens, with
nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import edgeinfer
from conftest import STORIES_SRC
from test_convert_errors import assert_no_partial, assert_user_error, edit_config, run_convert, src  # noqa: F401


def _header(path: Path) -> tuple[dict, bytes]:
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    import struct

    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("name,how", [("config.json", "zero"), ("tokenizer.json", "zero"), ("chat_template.jinja", "zero"),
                                      ("config.json", "fifo"), ("model.safetensors", "fifo")])
def test_a_special_file_inside_the_source_folder_is_refused_before_it_is_read(capsys, src, tmp_path, name, how):
    """Hostile convert test: a tokenizer file linked to /dev/zero was copied until the disk filled
    (45 GB in 40 s), config.json linked to it grew memory without bound, a FIFO hung convert."""
    import os

    (src / name).unlink(missing_ok=True)
    if how == "zero":
        (src / name).symlink_to("/dev/zero")
    else:
        os.mkfifo(src / name)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, name, "is not a regular file")
    assert not (tmp_path / "out").exists()
    assert_no_partial(tmp_path)


@pytest.mark.parametrize("case", ["deep config", "not utf-8 template", "model_type list", "string offsets",
                                  "index map is a list", "index value not a name", "deep header"])
def test_malformed_folder_files_are_one_line_errors(capsys, src, tmp_path, case):
    """Hostile convert test: each of these ended in a traceback (TypeError, AttributeError,
    UnicodeDecodeError, RecursionError)."""
    deep = "[" * 100_000 + "]" * 100_000
    st = src / "model.safetensors"
    if case == "deep config":
        (src / "config.json").write_text(deep)
    elif case == "not utf-8 template":
        (src / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    elif case == "model_type list":
        edit_config(src, model_type=["llama"])
    elif case == "string offsets":
        header, data = _header(st)
        e = header["model.embed_tokens.weight"]
        e["data_offsets"] = [str(x) for x in e["data_offsets"]]
        _write_header(st, header, data)
    elif case == "index map is a list":  # (an index is read where there is no model.safetensors)
        st.rename(src / "model-1.safetensors")
        (src / "model.safetensors.index.json").write_text('{"weight_map": ["model-1.safetensors"]}')
    elif case == "index value not a name":
        st.rename(src / "model-1.safetensors")
        (src / "model.safetensors.index.json").write_text('{"weight_map": {"a": 5}}')
    else:
        h = deep.encode()
        st.write_bytes(len(h).to_bytes(8, "little") + h)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err)
    assert_no_partial(tmp_path)


def test_overlapping_tensors_are_refused(capsys, src, tmp_path):
    """Hostile convert test: model.norm.weight pointed at another tensor's bytes converted into a
    model that wrote gibberish; the safetensors format forbids overlaps."""
    st = src / "model.safetensors"
    header, data = _header(st)
    other = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"][0]
    norm = header["model.norm.weight"]
    size = norm["data_offsets"][1] - norm["data_offsets"][0]
    norm["data_offsets"] = [other, other + size]
    _write_header(st, header, data)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "overlap")


def test_a_tensor_named_twice_in_a_header_is_refused(capsys, src, tmp_path):
    """Hostile round: a second entry for k_proj, pointing at bytes appended to the data, converted
    silently (JSON keeps the last key; perplexity 5.68 -> 7.72), where two shards naming one tensor
    are refused."""
    import struct

    st = src / "model.safetensors"
    header, data = _header(st)
    name = "model.layers.0.self_attn.k_proj.weight"
    entry = dict(header[name], data_offsets=[len(data), 2 * len(data) - header[name]["data_offsets"][0]])
    h = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(entry)}}}"
    extra = b"\0" * (entry["data_offsets"][1] - entry["data_offsets"][0])
    st.write_bytes(struct.pack("<Q", len(h)) + h.encode() + data + extra)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, f"{name!r} is named twice")


@pytest.mark.parametrize("where", ["trailing", "hole"])
def test_bytes_no_tensor_indexes_are_refused(capsys, src, tmp_path, where):
    """The format indexes every byte of its data (the safetensors library refuses holes and trailing
    bytes): a second copy of a weight could hide there, read by whichever reader looks."""
    st = src / "model.safetensors"
    header, data = _header(st)
    if where == "hole":  # the norm moved to the end, its old bytes left unnamed
        norm = header["model.norm.weight"]
        size = norm["data_offsets"][1] - norm["data_offsets"][0]
        data += data[norm["data_offsets"][0]:norm["data_offsets"][1]]
        norm["data_offsets"] = [len(data) - size, len(data)]
    else:
        data += b"\0" * 64
    _write_header(st, header, data)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "belong to no tensor")


def test_a_dimension_past_64_bits_is_one_line_error(capsys, src, tmp_path):
    """Hostile round: a shape of [2**64, 1] was an OverflowError traceback (numpy's int64 product)."""
    st = src / "model.safetensors"
    header, data = _header(st)
    header["model.layers.0.self_attn.q_proj.weight"]["shape"] = [2 ** 64, 1]
    _write_header(st, header, data)
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "offsets do not match its shape")


def test_an_index_that_reads_outside_the_folder_or_disagrees_with_its_shards_is_refused(capsys, src, tmp_path):
    """Hostile convert test: weight_map values such as ../x or /abs were followed, and a tensor the
    index placed in a shard that lacks it was taken from wherever it was."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(src / "model.safetensors", outside / "model.safetensors")
    shard = "model-00001-of-00001.safetensors"  # (an index is read where there is no model.safetensors)
    (src / "model.safetensors").rename(src / shard)
    header, _ = _header(src / shard)
    for path, needle in ((str(outside / "model.safetensors"), "is not a file name in the model folder"),
                         ("../elsewhere/model.safetensors", "is not a file name in the model folder")):
        (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: path for n in header}}))
        rc, err = run_convert(capsys, src, tmp_path / "out")
        assert_user_error(rc, err, needle)
    # the index names shards, as transformers reads it: a stale entry for a tensor no shard has (the review
    # found such on the Hub) converts; only a tensor the model needs and the listed shard lacks is refused
    listed = {n: shard for n in header if n != "__metadata__"} | {"mtp.fc.weight": shard}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": listed}))
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert rc == 0, err
    listed["lm_head.weight"] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": listed}))
    edit_config(src, tie_word_embeddings=False)
    rc, err = run_convert(capsys, src, tmp_path / "out2")
    assert_user_error(rc, err, "no lm_head.weight, but tie_word_embeddings is false")


def test_an_untied_model_without_its_output_layer_is_refused(capsys, src, tmp_path):
    """Hostile convert test: tie_word_embeddings false and no lm_head.weight converted as a tied
    model (its manifest still saying untied); transformers would start the head at random."""
    edit_config(src, tie_word_embeddings=False)
    for target in ("cpu", "coreml"):  # the portable graph too (the review)
        rc, err = run_convert(capsys, src, tmp_path / "out", "--target", target)
        assert_user_error(rc, err, "no lm_head.weight, but tie_word_embeddings is false")
    edit_config(src, tie_word_embeddings="false")  # a string is not read as true
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "'tie_word_embeddings' must be true or false")


def test_a_finite_but_impossible_weight_is_refused(capsys, src, tmp_path):
    """Hostile convert test: one norm weight of 3e38 (a flipped exponent bit) passed the NaN check
    and every generate of the folder then failed on NaN logits."""
    import numpy as np

    st = src / "model.safetensors"
    header, data = _header(st)
    norm = header["model.norm.weight"]
    assert norm["dtype"] == "F32"
    data = bytearray(data)
    data[norm["data_offsets"][0]:norm["data_offsets"][0] + 4] = np.float32(3e38).tobytes()
    _write_header(st, header, bytes(data))
    for quant in ("fp32", "int8", "int4"):
        rc, err = run_convert(capsys, src, tmp_path / "out", "--quant", quant)
        assert_user_error(rc, err, "model.norm.weight", "magnitude 3e+38")


def test_a_tokenizer_with_more_ids_than_embedding_rows_converts_with_a_note(tmp_path):
    """Hostile convert test: an added token past vocab_size converted without a word, and every
    prompt holding it then failed at generate. The review found such tokenizers are common (an
    added <pad>) and transformers loads them: convert says so, and such a prompt is refused."""
    from edgeinfer.converters import convert

    src = tmp_path / "src"
    shutil.copytree(STORIES_SRC, src)
    (src / "tokenizer.model").unlink()  # tokenizer.json is the tokenizer
    tk = json.loads((src / "tokenizer.json").read_text())
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tk["added_tokens"].append({"id": vocab, "content": "<|extra|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (src / "tokenizer.json").write_text(json.dumps(tk))
    log: list[str] = []
    convert(src, tmp_path / "out", log=log.append)
    assert any(f"ids up to {vocab}, past the model's {vocab} embedding rows" in m for m in log), log
    m = edgeinfer.load(tmp_path / "out")
    assert m.generate("Once upon a time", max_new_tokens=3, seed=1).token_ids
    with pytest.raises(edgeinfer.EdgeInferError, match=str(vocab)):
        m.generate("Once <|extra|>", max_new_tokens=3)
    # and eval, which scored it: an IndexError traceback (int4's Gather read past its table first)
    from edgeinfer.evaluate import perplexity, stream_perplexity

    text = tmp_path / "eval.txt"
    text.write_text("Once upon a time\nOnce <|extra|> there was\n")
    for score in (lambda: perplexity(tmp_path / "out", text), lambda: stream_perplexity(tmp_path / "out", text,
                                                                                          capacity=64)):
        with pytest.raises(edgeinfer.EdgeInferError, match=f"token id {vocab}, outside the model's vocabulary"):
            score()


def test_a_failed_conversion_leaves_no_empty_parent_folders(capsys, src, tmp_path):
    """Hostile convert test: -o dest/a/b/c/model made a/b/c first, and a failure left them behind."""
    (src / "tokenizer.model").write_bytes(b"garbage")  # fails at the tokenizer check, after the graph is written
    rc, err = run_convert(capsys, src, tmp_path / "dest" / "a" / "b" / "c" / "model")
    assert_user_error(rc, err, "tokenizer")
    assert not (tmp_path / "dest").exists()
    (tmp_path / "kept").mkdir()  # a parent that was there before stays
    rc, err = run_convert(capsys, src, tmp_path / "kept" / "a" / "model")
    assert rc == 1 and (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "a").exists()


def test_a_destination_name_of_up_to_255_bytes_converts(capsys, src, tmp_path):
    """Hostile convert test: a legal 240-byte name was refused, "File name too long", because the
    temporary folder beside it added ".partial-PID-RANDOM" to it."""
    for name in ("m" * 240, "\u6a21" * 85):  # 240 bytes; 255 bytes of 3-byte characters (the review)
        dst = tmp_path / name
        rc, err = run_convert(capsys, src, dst)
        assert rc == 0, err
        assert (dst / "edgeinfer.json").exists()
        assert_no_partial(tmp_path)


@pytest.mark.parametrize("value", ['"yes"', '"false"', "1", "[]"])
def test_add_bos_token_must_be_a_bool(capsys, src, tmp_path, value):
    """`"add_bos_token": "false"` was read as true (any non-empty string was), silently (a hostile
    review); a value that is not true, false or null is a one-line error naming the field."""
    path = src / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(cfg | {"add_bos_token": json.loads(value)}))
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "add_bos_token must be true or false")
    assert_no_partial(tmp_path)


def test_an_unsupported_model_type_is_named_not_the_supported_architecture(capsys, src, tmp_path):
    """model_type "gpt2" beside architectures ["LlamaForCausalLM"] said "unsupported architecture
    'LlamaForCausalLM'; supported: LlamaForCausalLM, ..." (a hostile review)."""
    edit_config(src, model_type="gpt2")
    rc, err = run_convert(capsys, src, tmp_path / "out")
    assert_user_error(rc, err, "unsupported architecture 'gpt2'")


def test_a_destination_whose_name_is_not_utf8_is_refused(capsys, src, tmp_path):
    """Hostile round: Latin-1's "modèle" converted (rc 0) into a folder no load could open (ONNX
    Runtime's binding takes only UTF-8 paths: "incompatible constructor arguments")."""
    dst = tmp_path / os.fsdecode(b"mod\xe8le")
    rc, err = run_convert(capsys, src, dst)
    assert_user_error(rc, err, "not valid UTF-8")
    assert not dst.exists()
    assert_no_partial(tmp_path)


def test_a_destination_below_a_link_to_nothing_names_the_link(capsys, src, tmp_path):
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    rc, err = run_convert(capsys, src, tmp_path / "gone" / "out")
    assert_user_error(rc, err, "is a link to nothing")

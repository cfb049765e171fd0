"""A damaged or hostile model folder at load: one clear error, no hang, no unbounded read.

Each case was found by a hostile round (2026-12-01): the tokenizer was read before the integrity
check (a FIFO hung every load, a link to /dev/zero grew memory until killed, one changed byte was a
UnicodeDecodeError traceback); the stamp file was read whole (a FIFO hung, a link to /dev/zero
exhausted memory); the manifest gave RecursionError, OverflowError and ZeroDivisionError
tracebacks, accepted a RoPE theta of 0 or NaN (then blamed broken weights), and `"files": null`
switched the integrity check off.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

import edgeinfer
from conftest import STORIES_SRC, write_manifest
from edgeinfer.cli import main
from edgeinfer.errors import ModelFormatError
from edgeinfer.integrity import STAMP_FILE


@pytest.fixture
def folder(tmp_path, converted):
    d = tmp_path / "model"
    shutil.copytree(converted(STORIES_SRC, "fp32"), d)
    return d


def _edit(folder, change):
    m = json.loads((folder / "edgeinfer.json").read_text())
    change(m)
    write_manifest(folder, m)


def _load_within(folder, seconds=60):
    """load() in a thread: its result or error, and a hang fails the test instead of blocking it."""
    out = {}

    def run():
        try:
            out["model"] = edgeinfer.load(folder, threads=1)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "load() hung"
    return out


@pytest.mark.parametrize("how", ["fifo", "dev_zero", "flipped_byte"])
def test_a_bad_tokenizer_file_is_caught_by_the_integrity_check_before_it_is_read(folder, how):
    p = folder / "tokenizer.model"
    if how == "flipped_byte":
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xAA
        p.write_bytes(bytes(raw))
    else:
        p.unlink()
        os.mkfifo(p) if how == "fifo" else p.symlink_to("/dev/zero")
    out = _load_within(folder)
    assert isinstance(out.get("error"), ModelFormatError), out
    assert "tokenizer.model" in str(out["error"])


@pytest.mark.parametrize("how", ["fifo", "dev_zero", "nested", "big"])
def test_a_bad_stamp_file_is_ignored_and_every_file_hashed(folder, how):
    p = folder / STAMP_FILE
    p.unlink(missing_ok=True)
    if how == "fifo":
        os.mkfifo(p)
    elif how == "dev_zero":
        p.symlink_to("/dev/zero")
    elif how == "nested":
        p.write_text("[" * 100_000)
    else:
        p.write_text(json.dumps({"version": 1, "files": {}, "pad": "x" * (2 << 20)}))
    out = _load_within(folder)
    assert "model" in out, out
    assert out["model"].generate("Once", max_new_tokens=3, temperature=0).usage.completion_tokens == 3


@pytest.mark.parametrize("change,needle", [
    (lambda m: m["architecture"]["rope"].update(theta=10 ** 400), "architecture.rope.theta: expected a finite"),
    (lambda m: m["architecture"]["rope"].update(theta=0), "architecture.rope.theta: must be positive"),
    (lambda m: m["architecture"]["rope"].update(theta=-5.0), "architecture.rope.theta: must be positive"),
    (lambda m: m["architecture"].update(rms_norm_eps=float("nan")), "rms_norm_eps: expected a finite"),
    (lambda m: m["architecture"]["rope"].update(type="llama3", low_freq_factor=4.0, high_freq_factor=4.0),
     "must exceed low_freq_factor"),
    (lambda m: m.update(format_version="1"), "format_version '1' is not a positive integer"),
    (lambda m: m.update(format_version=0), "format_version 0 is not a positive integer"),
    (lambda m: m.update(format_version=True), "format_version True is not a positive integer"),
    (lambda m: m.update(files=None), "bad field files"),
    (lambda m: m.update(files=[]), "bad field files"),
    (lambda m: m.update(files={}), "bad field files"),
    (lambda m: m.update(origin={"format": "gguf", "tensor_types": {"F32": float("nan")}}),
     "origin.tensor_types.F32: expected a count"),
    (lambda m: m["architecture"].update(num_layers=10 ** 12), "architecture.num_layers: must be in 1..4,096"),
    (lambda m: m["architecture"].update(vocab_size=10 ** 9), "architecture.vocab_size: must be in 1..16,777,216"),
    (lambda m: m["architecture"].update(head_dim=0), "architecture.head_dim: must be in 1..4,096"),
])
def test_a_bad_manifest_field_is_one_error_naming_it(capsys, folder, change, needle):
    _edit(folder, change)
    assert main(["inspect", str(folder)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("edgeinfer: error: ") and needle in err, err


def test_a_manifest_whose_layer_count_disagrees_with_its_graph_is_one_short_error(capsys, folder):
    """num_layers edited to the most allowed (every hash still matches, the manifest's own recomputed):
    `inspect --verify` and load say the graph's inputs disagree in a line of a few names (hostile
    round: 3,000,000 layers printed a 190 MB line after 14 s at 1.4 GB; 10**12 ran out of memory)."""
    _edit(folder, lambda m: m["architecture"].update(num_layers=4096))
    assert main(["inspect", "--verify", str(folder)]) == 1
    err = capsys.readouterr()
    text = (err.out + err.err).strip()
    assert "does not take the inputs its edgeinfer.json names" in text and "more" in text and len(text) < 2000, text
    out = _load_within(folder)
    assert isinstance(out.get("error"), ModelFormatError) and len(str(out["error"])) < 1000


def test_a_manifest_nested_past_the_recursion_limit_or_too_large_is_refused(capsys, folder):
    (folder / "edgeinfer.json").write_text("[" * 100_000)
    assert main(["inspect", str(folder)]) == 1
    assert "corrupted" in capsys.readouterr().err
    (folder / "edgeinfer.json").write_text(" " * (17 << 20) + "{}")  # read whole, a 2 GB one was a MemoryError
    assert main(["inspect", str(folder)]) == 1
    assert "a file of at most 16777216 bytes is read here" in capsys.readouterr().err


def test_a_path_the_system_refuses_is_one_error(capsys, tmp_path):
    long = tmp_path / ("x" * 5000)
    assert main(["inspect", str(long)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read" in err and "File name too long" in err, err
    with pytest.raises(ModelFormatError, match="File name too long"):
        edgeinfer.load(long)


def test_ids_past_the_tokenizers_vocabulary_add_no_text():
    """A checkpoint's embedding often has more rows than its tokenizer has tokens (padding); a
    sampled id past the tokenizer was an IndexError traceback mid-reply (SentencePiece)."""
    from edgeinfer.detokenize import Detokenizer

    t = edgeinfer.load(threads=1).tokenizer
    past = t.id_limit + 7
    assert t.decode([400, past, 401]) == t.decode([400, 401]) and t.token_text(past) == ""
    d, e = Detokenizer(t, [1]), Detokenizer(t, [1])
    assert "".join(d.add(i) for i in [400, past, 401]) == "".join(e.add(i) for i in [400, 401]) != ""


def _swapping(monkeypatch, name, dst, others):
    """Wrap edgeinfer.model's `name` so that each of its first len(others) calls first renames the next of
    `others` into `dst`'s place (as `convert --force` does), between two of a load's reads."""
    import edgeinfer.model as model_module

    real, queue = getattr(model_module, name), list(others)

    def swap_then(*args, **kwargs):
        if queue:
            gone = dst.with_name(dst.name + f".old{len(queue)}")
            os.rename(dst, gone)
            os.rename(queue.pop(0), dst)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module, name, swap_then)


@pytest.mark.parametrize("between", ["DecoderSession", "Tokenizer"])
def test_a_folder_replaced_while_it_loads_is_read_again_whole(tmp_path, converted, monkeypatch, between):
    """A conversion renamed into the folder's place after its manifest was read (before the graph: the
    graph and weights of one conversion were checked against the other's hashes, "corrupted; convert
    again", or paired with them and gave garbage; after it: the tokenizer of the other) is loaded whole."""
    dst, other = tmp_path / "model", tmp_path / "other"
    shutil.copytree(converted(STORIES_SRC, "fp32"), dst)
    shutil.copytree(converted(STORIES_SRC, "int8"), other)
    want = edgeinfer.load(other, threads=1).generate("Once upon a time", max_new_tokens=16, temperature=0).token_ids
    _swapping(monkeypatch, between, dst, [other])
    m = edgeinfer.load(dst, threads=1)
    assert m.manifest.quantization.weights == "int8"
    assert m.session.manifest is m.manifest
    assert m.generate("Once upon a time", max_new_tokens=16, temperature=0).token_ids == want


def test_a_portable_folder_replaced_as_its_engine_opens_is_read_again_whole(tmp_path, monkeypatch):
    """A hostile round: a portable engine opens the folder's prefill graph and embeddings after load's
    checked part, so a folder replaced just then ran one conversion's decode graph with the other's
    prefill graph and float16 embeddings: no error, text of neither (4 in ~588 racing loads)."""
    from edgeinfer.converters import convert

    dst, other = tmp_path / "model", tmp_path / "other"
    for folder, quant in ((dst, "fp32"), (other, "int8")):
        convert(STORIES_SRC, folder, quant=quant, target="nnapi", capacity_tokens=64, prefill_tokens=16)
    prompt = list(range(1, 40))  # past one prefill call: the prefill graph runs
    want = edgeinfer.load(other, threads=1).generate(prompt, max_new_tokens=16, temperature=0).token_ids
    _swapping(monkeypatch, "open_engine", dst, [other])
    m = edgeinfer.load(dst, threads=1)
    assert m.manifest.quantization.weights == "int8"
    assert m.generate(prompt, max_new_tokens=16, temperature=0).token_ids == want


def test_a_folder_replaced_at_every_read_is_one_clear_error(tmp_path, converted, monkeypatch):
    dst = tmp_path / "model"
    shutil.copytree(converted(STORIES_SRC, "fp32"), dst)
    others = []
    for i in range(3):
        others.append(tmp_path / f"other{i}")
        shutil.copytree(converted(STORIES_SRC, ("int8", "fp32")[i % 2]), others[-1])
    _swapping(monkeypatch, "DecoderSession", dst, others)
    with pytest.raises(ModelFormatError, match="was replaced while it was being loaded"):
        edgeinfer.load(dst, threads=1)


def test_eval_s_session_says_a_folder_replaced_while_it_opens(tmp_path, converted, monkeypatch):
    """A session opened on its own (eval, bench) reads the manifest itself: a conversion renamed into
    place between that and the graph is named as such, not as a corrupted file."""
    import edgeinfer.session as session_module

    dst, other = tmp_path / "model", tmp_path / "other"
    shutil.copytree(converted(STORIES_SRC, "fp32"), dst)
    shutil.copytree(converted(STORIES_SRC, "int8"), other)
    real = session_module.verify

    def swap_then(*args, **kwargs):
        os.rename(dst, tmp_path / "old")
        os.rename(other, dst)
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "verify", swap_then)
    with pytest.raises(ModelFormatError, match="was replaced while it was being loaded"):
        session_module.DecoderSession(dst, threads=1)


@pytest.mark.parametrize("change", [
    lambda m: m["architecture"]["rope"].update(theta=90000.0),  # one flipped bit in "10000": perplexity 6.08 -> 7.13
    lambda m: m["architecture"].update(max_position_embeddings=712),  # a longer ring accepted
    lambda m: m["files"]["model.onnx"].update(sha256="0" * 64),
    lambda m: m.pop("origin"),  # an optional section gone
])
def test_a_manifest_changed_after_conversion_is_refused_by_its_checksum(capsys, folder, change):
    """Hostile round: the files' hashes covered the graph, weights and tokenizer but not the manifest,
    so a flipped bit in a field changed what loaded, with `inspect --verify` saying "ok" to every file."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    change(m)
    (folder / "edgeinfer.json").write_text(json.dumps(m))  # the checksum as converted
    for cmd in (["inspect", "--verify", str(folder)], ["generate", "-m", str(folder), "Hi"]):
        assert main(cmd) == 1
        err = capsys.readouterr().err
        assert "was changed after conversion" in err and "manifest_sha256" in err, err
    assert isinstance(_load_within(folder).get("error"), ModelFormatError)


def test_a_manifest_edited_by_hand_loads_once_its_checksum_is_deleted(capsys, folder):
    """The escape the refusal names: without the field the manifest reads as an older converter's."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    assert m.pop("manifest_sha256")
    m["default_capacity_tokens"] = 100
    (folder / "edgeinfer.json").write_text(json.dumps(m))
    assert edgeinfer.load(folder, threads=1).capacity_tokens == 100
    assert main(["inspect", "--verify", str(folder)]) == 0
    assert "no manifest_sha256" in capsys.readouterr().out


def test_a_folder_whose_path_is_not_utf8_is_one_clear_error(capsys, folder):
    """Such a folder (made by hand, or by an older convert) failed with ONNX Runtime's "incompatible
    constructor arguments" at load and "MISMATCH edgeinfer.json" from `inspect --verify`."""
    moved = folder.with_name(os.fsdecode(b"mod\xe8le"))
    folder.rename(moved)
    out = _load_within(moved)
    assert isinstance(out.get("error"), ModelFormatError) and "valid UTF-8" in str(out["error"])
    assert main(["generate", "-m", str(moved), "Hi"]) == 1
    assert "valid UTF-8" in capsys.readouterr().err

"""Bad model folders and bad eval input: clear one-line errors from `edgeinfer eval` / `inspect`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import STORIES_FIX, STORIES_SRC, write_manifest
from edgeinfer.cli import main

EVAL_TXT = STORIES_FIX / "eval.txt"


@pytest.fixture
def folder(tmp_path, converted):
    d = tmp_path / "model"
    shutil.copytree(converted(STORIES_SRC, "fp32"), d)
    return d


def one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("edgeinfer: error: "), err
    for n in needles:
        assert n in err, (n, err)


def test_a_bad_thread_count_is_the_callers_error_not_the_models(capsys):
    """It was reported as 'cannot load model.onnx' (a ModelFormatError), after hashing the folder."""
    one_line_error(capsys, ["eval", "-m", str(STORIES_SRC.parent / "stories260K-int8"), "--threads", "0",
                            "--text", str(EVAL_TXT)], "threads must be a positive integer")


def test_missing_folder(capsys, tmp_path):
    one_line_error(capsys, ["eval", "-m", str(tmp_path / "nope"), "--text", str(EVAL_TXT)], "model folder not found")


def test_a_path_that_is_no_folder_says_what_it_is(capsys, tmp_path):
    """-m /dev/null, a FIFO or a link that leads nowhere said "model folder not found" (hostile round)."""
    fifo, loop, dangling = tmp_path / "fifo", tmp_path / "loop", tmp_path / "dangling"
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    for path, what in [("/dev/null", "is a device, not an edgeinfer model folder"),
                       (fifo, "is a FIFO, not an edgeinfer model folder"),
                       (loop, "is a symbolic link that leads nowhere"),
                       (dangling, "is a symbolic link that leads nowhere")]:
        for argv in (["eval", "-m", str(path), "--text", str(EVAL_TXT)], ["inspect", str(path)],
                     ["generate", "Hi", "-m", str(path)]):
            one_line_error(capsys, argv, f"{path} {what}")


def test_not_an_edgeinfer_folder(capsys):
    one_line_error(capsys, ["inspect", str(STORIES_SRC)], "not an edgeinfer model folder", "edgeinfer convert")


def test_newer_format_version(capsys, folder):
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["format_version"] = 99
    write_manifest(folder, m)
    one_line_error(capsys, ["inspect", str(folder)], "format version 99", "upgrade edgeinfer")


def test_corrupted_manifest(capsys, folder):
    (folder / "edgeinfer.json").write_text("{oops")
    one_line_error(capsys, ["inspect", str(folder)], "corrupted")


def test_manifest_missing_field(capsys, folder):
    m = json.loads((folder / "edgeinfer.json").read_text())
    del m["architecture"]["num_layers"]
    write_manifest(folder, m)
    one_line_error(capsys, ["inspect", str(folder)], "corrupted")


def test_missing_model_onnx(capsys, folder):
    (folder / "model.onnx").unlink()
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)], "lacks model.onnx")


@pytest.mark.parametrize("name", ["edgeinfer.json", "model.onnx"])
def test_a_file_linked_in_a_loop_is_said_to_be_one(capsys, folder, name):
    """It was reported as missing: "no edgeinfer.json", "lacks model.onnx"."""
    (folder / name).unlink()
    (folder / name).symlink_to(folder / name)
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)],
                   f"{folder / name} is a symbolic link that leads nowhere")


def test_corrupted_model_onnx(capsys, folder):
    (folder / "model.onnx").write_bytes(b"\x00garbage" * 10)
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)], "model.onnx does not match its size")


def test_corrupted_model_onnx_without_recorded_hashes(capsys, folder):
    """A folder whose manifest lists no files (nothing to verify) still fails cleanly in ONNX Runtime."""
    _forget_hashes(folder)
    (folder / "model.onnx").write_bytes(b"\x00garbage" * 10)
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)], "cannot load")


def test_eval_verifies_weights(capsys, folder):
    data = bytearray((folder / "model.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    (folder / "model.onnx.data").write_bytes(bytes(data))
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)], "model.onnx.data does not match its sha256")


def _forget_hashes(folder):
    """An older folder whose manifest lists no files: load cannot verify, the loaders' own checks run."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    del m["files"]
    write_manifest(folder, m)


def test_truncated_external_data(capsys, folder):
    _forget_hashes(folder)
    data = folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)], "cannot load")


def test_a_graph_onnx_runtime_cannot_load_is_said_in_one_line(tmp_path, converted):
    """An int4 graph whose weights are cut short fails in ONNX Runtime's optimizer, which logged its
    coloured C++ error to fd 2 before our line (capsys does not see fd 2: a subprocess does)."""
    folder = tmp_path / "model"
    shutil.copytree(converted(STORIES_SRC, "int4"), folder)
    _forget_hashes(folder)
    data = folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "eval", "-m", str(folder), "--text", str(EVAL_TXT)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("edgeinfer: error: cannot load") and \
        len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("version,hinted", [("1.22.1", True), ("1.20.0", True), ("0.9", True), ("1.23.0", False),
                                             ("1.32.0", False), ("1.23.0.dev20250101", False), ("2.0", False),
                                             ("unknown", False)])
def test_an_old_runtime_is_named_beside_a_load_error(version, hinted):
    from edgeinfer.session import old_runtime_hint

    hint = old_runtime_hint(version)
    assert bool(hint) == hinted and (not hinted or f"ONNX Runtime {version} is installed" in hint and "1.23" in hint)


def test_a_graph_an_old_runtime_refuses_says_which_runtime_it_needs(capsys, monkeypatch):
    """ONNX Runtime 1.22 refused the bundled model's int8 embedding as 'This is an invalid model'
    (pyproject asked for 1.20): the error now says the runtime, not the folder, is what to change.
    Here that runtime is stood in for: its version, and a session that refuses the graph."""
    import onnxruntime as ort

    def refuse(*a, **k):
        raise ort.capi.onnxruntime_pybind11_state.InvalidGraph(
            "[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model. In Node GatherBlockQuantized")

    monkeypatch.setattr(ort, "__version__", "1.22.1")
    monkeypatch.setattr(ort, "InferenceSession", refuse)
    one_line_error(capsys, ["generate", "Once", "--max-tokens", "2"], "cannot load", "INVALID_GRAPH",
                   "ONNX Runtime 1.22.1 is installed", "need 1.23 or newer")


@pytest.mark.parametrize("version,hinted", [("0.19.1", True), ("0.20.0", False), ("0.23.3", False)])
def test_a_tokenizer_json_an_old_library_cannot_read_names_the_library(folder, monkeypatch, version, hinted):
    """tokenizers 0.19 called stories260K's tokenizer.json (merges as pairs, as 0.20 writes them)
    'corrupted': the error now says the library may be what is old (its version stood in for here)."""
    import tokenizers

    from edgeinfer.errors import ModelFormatError
    from edgeinfer.manifest import read_manifest
    from edgeinfer.tokenizer import Tokenizer

    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE", "merges": [["a", "b"]]')
    monkeypatch.setattr(tokenizers, "__version__", version)
    with pytest.raises(ModelFormatError, match="tokenizer.json is corrupted") as e:
        Tokenizer(folder, read_manifest(folder).tokenizer)
    assert ("tokenizers 0.19.1 is too old to read it" in str(e.value)) == hinted, e.value


@pytest.mark.parametrize("name,kind", [("tokenizer.model", "sentencepiece"), ("tokenizer.json", "hf_tokenizers")])
@pytest.mark.parametrize("content", [b"not a tokenizer", b""])
def test_corrupted_tokenizer(capsys, folder, content, name, kind):
    """An empty tokenizer.model (a hostile round) was taken by SentencePiece as "not initialized": a
    RuntimeError traceback at the first encode, in convert as in load. The folder has both files (its
    source had): each back end, as the manifest names it, reads its own."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["tokenizer"]["kind"] = kind
    write_manifest(folder, m)
    _forget_hashes(folder)
    (folder / name).write_bytes(content)
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT)], f"{name} is corrupted")


def test_missing_text(capsys, folder, tmp_path):
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(tmp_path / "none.txt")], "text file not found")


def test_empty_text(capsys, folder, tmp_path):
    t = tmp_path / "empty.txt"
    t.write_text("\n\n")
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(t)], "no non-empty line")


def test_window_too_small(capsys, folder):
    one_line_error(capsys, ["eval", "-m", str(folder), "--text", str(EVAL_TXT), "--window", "1"], "--window")


def test_a_model_folder_s_escape_sequences_never_reach_the_terminal(tmp_path, capsys):
    """A hostile round: `inspect` printed a manifest's strings as they were (origin.file, tensor types,
    kept blocks, the family; an error quoting a bad entry), so a downloaded folder could retitle the
    terminal, clear it or colour what followed. `power` and `inspect --platform` already escaped the
    device's strings; a folder's are now escaped alike, in inspect's lines and the CLI's errors."""
    import json
    import shutil

    from conftest import ROOT, write_manifest
    from edgeinfer.cli import main

    folder = tmp_path / "evil"
    shutil.copytree(ROOT / "models" / "stories260K-int8", folder)
    m = json.loads((folder / "edgeinfer.json").read_text())
    esc = "\x1b]0;TITLE\x07\x1b[2J\x1b[31m\n"
    m["origin"].update(format="gguf", quant="keep", file="x.gguf" + esc, tensor_types={"F32" + esc: 3},
                       kept_exact=["Q8_0" + esc])
    m["architecture"]["family"] = "llama" + esc
    write_manifest(folder, m)
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, out
    assert "x.gguf\\x1b]0;TITLE\\x07\\x1b[2J\\x1b[31m\\n" in out and "llama\\x1b" in out, out
    assert len(out.splitlines()) == len([ln for ln in out.splitlines() if ln.startswith(("  ", str(folder)))])

    m["quantization"]["int8_tensors"] = ["lm_head" + esc]  # refused, its value quoted in the error
    write_manifest(folder, m)
    assert main(["generate", "-m", str(folder), "Once", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgeinfer: error: ") and "\x1b" not in err and len(err.splitlines()) == 1, err


def test_chat_s_own_error_line_escapes_what_a_template_says(tmp_path, capsys, monkeypatch):
    """A review: chat printed a template's refusal (`raise_exception(...)`, the model folder's words) in
    its own error line, unescaped: a downloaded model could retitle and clear the terminal at every turn."""
    import io
    import json
    import shutil
    import sys

    from conftest import ROOT, write_manifest
    from edgeinfer.cli import main

    folder = tmp_path / "evil"
    shutil.copytree(ROOT / "models" / "stories260K-int8", folder)
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["tokenizer"]["chat_template"] = "{{ raise_exception('\\x1b]0;TITLE\\x07\\x1b[2J') }}"
    write_manifest(folder, m)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n")))
    assert main(["chat", "-m", str(folder), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b]0;TITLE\\x07\\x1b[2J" in err, err


def test_printable_escapes_what_moves_the_terminal_and_keeps_what_prints():
    """Hand-made cases: control and format characters (ESC, a bidirectional override, a line separator)
    escaped; letters and the spaces a path may hold (no-break, narrow no-break, ideographic) kept (a
    review: str.isprintable escaped those, and a user's own path no longer read as typed)."""
    from edgeinfer.terminal import printable

    assert printable("a\x1b[2Jb\x07") == "a\\x1b[2Jb\\x07"
    assert printable("a\nb\tc\u2028d") == "a\\nb\\tc\\u2028d"
    assert printable("\u202eevil") == "\\u202eevil"
    assert printable("モデル\u3000v2 x\u202fAM my\xa0model café") == "モデル\u3000v2 x\u202fAM my\xa0model café"

"""Load checks a model folder's files against edgeinfer.json's sizes and sha256; a stamp file makes
later loads skip the hash of unchanged files; `edgeinfer inspect DIR --verify` always hashes all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import edgeinfer
from conftest import ROOT, write_manifest
from edgeinfer import integrity
from edgeinfer.cli import main

BUNDLED = ROOT / "models" / "stories260K-int8"
PAST_NS = 1_600_000_000 * 10**9  # 2020: older than the stamp's "modified just now" guard


@pytest.fixture
def folder(tmp_path) -> Path:
    """A copy of the bundled model whose files have an old mtime (so a verified load stamps them)."""
    d = tmp_path / "model"
    shutil.copytree(BUNDLED, d, ignore=shutil.ignore_patterns(integrity.STAMP_FILE + "*"))
    for p in d.iterdir():
        os.utime(p, ns=(PAST_NS, PAST_NS))
    return d


@pytest.fixture
def hashes(monkeypatch) -> list:
    """Every file hashed by edgeinfer.integrity, in order."""
    calls: list = []
    real = integrity.sha256_file

    def counting(path, *a, **kw):
        calls.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(integrity, "sha256_file", counting)
    return calls


def listed(folder: Path) -> list:
    return list(json.loads((folder / "edgeinfer.json").read_text())["files"])


def flip_bit(path: Path, offset: int) -> None:
    """Flip one bit in place, keeping size (and, restored, mtime): the damage a stamp cannot see."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def verify_cli(capsys, folder: Path) -> tuple[int, list[str]]:
    rc = main(["inspect", str(folder), "--verify"])
    return rc, capsys.readouterr().out.strip().splitlines()


def test_flipped_bit_in_weights_refused_at_load(capsys, folder):
    """The report: a bit-flipped model.onnx.data loaded and generated garbage with exit 0."""
    flip_bit(folder / "model.onnx.data", 100_000)
    with pytest.raises(edgeinfer.ModelFormatError,
                       match=r"model\.onnx\.data does not match its sha256 in edgeinfer\.json: the file is corrupted"):
        edgeinfer.load(folder)
    rc = main(["generate", "-m", str(folder), "Once", "--max-tokens", "4", "--seed", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "model.onnx.data does not match" in err, err


LOADS = "ok        loads (graph inputs and outputs, tokenizer ids: as the manifest describes)"
MANIFEST_OK = "ok        edgeinfer.json (its manifest_sha256)"


def test_inspect_verify_reports_each_file(capsys, folder):
    rc, lines = verify_cli(capsys, folder)
    assert rc == 0 and lines == [MANIFEST_OK] + [f"ok        {n}" for n in listed(folder)] + [LOADS]
    flip_bit(folder / "model.onnx.data", 1234)
    rc, lines = verify_cli(capsys, folder)
    assert rc == 1 and len(lines) == 1 + len(listed(folder))
    assert "MISMATCH  model.onnx.data: sha256 differs" in lines
    assert sum(line.startswith("ok ") for line in lines) == len(lines) - 1


def test_truncated_file_fails_on_size_before_any_hash(folder, hashes):
    p = folder / "tokenizer.json"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(edgeinfer.ModelFormatError, match=r"tokenizer\.json does not match its size .*19416 bytes"):
        edgeinfer.load(folder)
    assert hashes == []


def test_missing_listed_file(folder):
    (folder / "special_tokens_map.json").unlink()
    with pytest.raises(edgeinfer.ModelFormatError, match="lacks special_tokens_map.json"):
        edgeinfer.load(folder)


def test_stamp_skips_the_hash_until_a_file_changes(folder, hashes):
    names = listed(folder)
    edgeinfer.load(folder)
    assert sorted(hashes) == sorted(names)
    stamps = integrity.read_stamps(folder)
    assert sorted(stamps) == sorted(names)
    hashes.clear()
    edgeinfer.load(folder)
    assert hashes == []  # every file's size, mtime_ns and inode match its stamp: nothing hashed
    os.utime(folder / "model.onnx.data", ns=(PAST_NS, PAST_NS + 1))  # "touch": new mtime, same bytes
    edgeinfer.load(folder)
    assert hashes == ["model.onnx.data"]
    hashes.clear()
    edgeinfer.load(folder)
    assert hashes == []


def test_stamp_does_not_vouch_for_a_copy_or_another_manifest(folder, tmp_path, hashes):
    edgeinfer.load(folder)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)  # same sizes and mtimes, and the stamp file too; new inodes
    hashes.clear()
    edgeinfer.load(copy)
    assert sorted(hashes) == sorted(listed(folder))
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["files"]["tokenizer.model"]["sha256"] = "0" * 64  # the manifest now expects other bytes
    write_manifest(folder, m)
    with pytest.raises(edgeinfer.ModelFormatError, match="tokenizer.model does not match its sha256"):
        edgeinfer.load(folder)


def test_inspect_verify_ignores_the_stamp(capsys, folder, hashes):
    edgeinfer.load(folder)
    flip_bit(folder / "model.onnx", 500)  # size and mtime kept: the stamp still matches
    hashes.clear()
    rc, lines = verify_cli(capsys, folder)
    assert rc == 1 and "MISMATCH  model.onnx: sha256 differs" in lines
    assert sorted(hashes) == sorted(listed(folder))


def test_bad_stamp_file_is_ignored_and_rewritten(folder, hashes):
    (folder / integrity.STAMP_FILE).write_text("{not json")
    edgeinfer.load(folder)
    assert sorted(hashes) == sorted(listed(folder))
    assert sorted(integrity.read_stamps(folder)) == sorted(listed(folder))
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_unwritable_folder_loads_without_a_stamp(folder, hashes, monkeypatch):
    """Tests run as root, where chmod does not stop writes: make the stamp's temp file fail instead."""
    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(integrity.tempfile, "mkstemp", refuse)
    edgeinfer.load(folder)
    edgeinfer.load(folder)
    assert not (folder / integrity.STAMP_FILE).exists()
    assert len(hashes) == 2 * len(listed(folder))  # no stamp: every load hashes


def test_no_stamp_is_written_inside_installed_packages(folder, hashes, monkeypatch):
    """A stamp written into site-packages (the bundled model, installed) outlived `pip install -e .` over
    `pip install .`, and the edgeinfer/ folder it kept was imported as an empty namespace package:
    every `edgeinfer` command then failed (a fresh user's walkthrough of the README)."""
    monkeypatch.setattr(integrity, "installed_dirs", lambda: [folder.parent.resolve()])
    edgeinfer.load(folder)
    edgeinfer.load(folder)
    assert not (folder / integrity.STAMP_FILE).exists()
    assert len(hashes) == 2 * len(listed(folder))  # no stamp there: every load hashes (the bundled model: ~1 ms)
    monkeypatch.undo()
    hashes.clear()
    edgeinfer.load(folder)  # elsewhere: stamped as before
    assert sorted(integrity.read_stamps(folder)) == sorted(listed(folder))


def test_site_packages_is_among_the_installed_dirs():
    import sysconfig

    assert Path(sysconfig.get_paths()["purelib"]).resolve() in integrity.installed_dirs()
    assert not integrity._installed(ROOT)  # the checkout itself is not an installed package


def test_manifest_without_files_loads_unchecked(capsys, folder, hashes):
    m = json.loads((folder / "edgeinfer.json").read_text())
    del m["files"]
    write_manifest(folder, m)
    flip_bit(folder / "tokenizer_config.json", 3)
    edgeinfer.load(folder)
    assert hashes == []
    rc = main(["inspect", str(folder), "--verify"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("edgeinfer: error: ") and "no file checksums" in err


def test_bundled_model_loads_and_verifies(capsys):
    edgeinfer.load()
    rc = main(["inspect", str(BUNDLED), "--verify"])
    assert rc == 0 and capsys.readouterr().out.count("ok ") == len(listed(BUNDLED)) + 2  # + the manifest, "loads"


def test_stamp_file_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    stamp = f"models/stories260K-int8/{integrity.STAMP_FILE}"
    for path in (stamp, stamp + ".abc123.tmp"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert r.returncode == 0, f"{path} is not ignored by .gitignore"


def test_bit_flip_with_mtime_restored_is_caught_at_load(tmp_path, monkeypatch):
    """A write whose mtime is put back with os.utime still changes ctime, which the stamp records."""
    d = tmp_path / "model"
    shutil.copytree(BUNDLED, d, ignore=shutil.ignore_patterns(integrity.STAMP_FILE + "*"))
    data = d / "model.onnx.data"
    old_ns = data.stat().st_mtime_ns - 3_600 * 10**9
    os.utime(data, ns=(old_ns, old_ns))  # an hour old: not "racy", so the first load stamps it
    edgeinfer.load(d)
    assert "model.onnx.data" in integrity.read_stamps(d)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(old_ns, old_ns))  # size, mtime and inode as stamped
    with pytest.raises(edgeinfer.ModelFormatError, match="does not match its sha256"):
        edgeinfer.load(d)


def test_verify_and_load_refuse_a_manifest_that_leaves_out_a_file_or_mislabels_the_graph(capsys, folder):
    """Deleting the weights' entry from `files` must not switch their check off, and a manifest
    whose architecture the graph contradicts fails `inspect --verify` as it fails load (hostile
    review: verify said ok to both)."""
    import json

    manifest = folder / "edgeinfer.json"
    original = manifest.read_text()
    m = json.loads(original)
    del m["files"]["model.onnx.data"]
    write_manifest(folder, m)  # its checksum recomputed: the check behind it
    with pytest.raises(edgeinfer.ModelFormatError, match="holds model.onnx.data, which its edgeinfer.json does not list"):
        edgeinfer.load(folder)
    assert verify_cli(capsys, folder)[0] == 1
    m = json.loads(original)
    m["architecture"]["num_layers"] -= 1
    write_manifest(folder, m)
    rc, lines = verify_cli(capsys, folder)
    assert rc == 1 and lines[-1].startswith("MISMATCH  edgeinfer.json:") and "does not take the inputs" in lines[-1]
    manifest.write_text(original)
    assert verify_cli(capsys, folder) == (0, [MANIFEST_OK] + [f"ok        {n}" for n in listed(folder)] + [LOADS])


def test_a_manifest_that_is_not_a_file_is_a_clear_error(folder):
    """A folder (or a FIFO, which would block the read for ever) named edgeinfer.json."""
    (folder / "edgeinfer.json").unlink()
    (folder / "edgeinfer.json").mkdir()
    with pytest.raises(edgeinfer.ModelFormatError, match="edgeinfer.json is not a file"):
        edgeinfer.load(folder)


def test_inspect_verify_hashes_each_file_once_without_a_stamp(capsys, folder, hashes):
    """A folder with no stamp (one that cannot be written never gets one) had every file hashed twice:
    by the check, then by the session it opens to see that the graph loads."""
    (folder / integrity.STAMP_FILE).unlink(missing_ok=True)
    rc, lines = verify_cli(capsys, folder)
    assert rc == 0 and "ok        loads (graph inputs and outputs, tokenizer ids: as the manifest describes)" in lines
    assert sorted(hashes) == sorted(listed(folder))


def test_inspect_calls_an_absurd_file_size_in_the_manifest_malformed(capsys, folder):
    """A hand-edited entry of 10**30 bytes was added up: "size on disk 999999999999999983222784.00 MB"."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["files"]["model.onnx"]["bytes"] = 10 ** 30
    write_manifest(folder, m)
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "the manifest's entry 'model.onnx' is malformed" in out and "e+" not in out and "9999" not in out, out


@pytest.mark.parametrize("dropped", ["logits", "present.4.value"])
def test_a_graph_that_lacks_an_output_its_manifest_names_is_refused_at_load_and_verify(capsys, folder, dropped):
    """A graph edited to give one output fewer, its manifest's file hashes updated (a hand edit):
    verify said the folder loads, and generate died on ONNX Runtime's error at the first call
    (a traceback; hostile round)."""
    import hashlib

    import onnx

    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    (out,) = [o for o in m.graph.output if o.name == dropped]
    m.graph.output.remove(out)
    onnx.save(m, str(folder / "model.onnx"))
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    data = (folder / "model.onnx").read_bytes()
    manifest["files"]["model.onnx"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_manifest(folder, manifest)
    with pytest.raises(edgeinfer.ModelFormatError, match=f"does not give the outputs .*missing \\['{dropped}'\\]"):
        edgeinfer.load(folder)
    rc, lines = verify_cli(capsys, folder)
    assert rc == 1 and lines[-1].startswith("MISMATCH  edgeinfer.json:") and dropped in lines[-1]


@pytest.mark.parametrize("field,value", [("eos_token_ids", [999]), ("eos_token_ids", [2, -1])])
def test_a_hand_edited_token_id_outside_the_vocabulary_is_named_by_load_and_verify(capsys, folder, field, value):
    """A hostile round: eos_token_ids [999] (vocabulary 512, manifest_sha256 deleted to keep the edit)
    passed `inspect --verify` ("ok loads") and was refused by load as "token id 999 is not in the
    tokenizer's vocabulary", which named no field. Both now name the manifest's field."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["tokenizer"][field] = value
    del m["manifest_sha256"]
    write_manifest(folder, m)
    bad = value[-1]
    with pytest.raises(edgeinfer.ModelFormatError, match=rf"tokenizer\.{field} holds {bad}, outside the tokenizer's"):
        edgeinfer.load(folder)
    rc, lines = verify_cli(capsys, folder)
    assert rc == 1 and f"tokenizer.{field} holds {bad}" in lines[-1] and lines[-1].startswith("MISMATCH")


@pytest.mark.parametrize("size", [-5, True])
def test_a_files_entry_with_a_negative_or_boolean_size_is_a_corrupted_manifest(folder, size):
    """A hostile round: bytes -5 passed the shape check, and load then said "362944 bytes, expected -5"."""
    m = json.loads((folder / "edgeinfer.json").read_text())
    m["files"]["tokenizer.json"]["bytes"] = size
    del m["manifest_sha256"]
    write_manifest(folder, m)
    with pytest.raises(edgeinfer.ModelFormatError, match=r"is corrupted \(bad files entry 'tokenizer.json'\)"):
        edgeinfer.load(folder)

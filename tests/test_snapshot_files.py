"""Snapshot files as a hostile user or an unlucky moment makes them (`PrefixSnapshot.save/load`,
`Model.restore`). Found by a hostile round (2026-12-01): a Ctrl-C while saving left the temporary
file; saving over a device node, a FIFO or through a link replaced it with a regular file; a valid
254-byte name could not be saved (the temporary name ran past the system's limit); a flipped bit in
the zip's directory raised NotImplementedError or RuntimeError, not an EdgeInferError; a 1.2 MB file
unpacked into 1.2 GB before its sizes were checked; a FIFO blocked restore for ever; and a snapshot of
huge finite values made every later request of the model fail until another restore."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
import time
import zipfile

import numpy as np
import pytest

import edgeinfer
import edgeinfer.prefix_cache as prefix_cache
from conftest import STORIES_SRC
from edgeinfer.errors import EdgeInferError, InvalidArgumentError, ModelFormatError


@pytest.fixture(scope="module")
def model(converted):
    return edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=64, threads=1)


PROMPT = [1, 400, 401, 402, 403, 404, 405, 406, 407]


def test_ctrl_c_while_saving_leaves_no_file(model, tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.snapshot(PROMPT, path=tmp_path / "s.npz")
    assert list(tmp_path.iterdir()) == []


def test_a_destination_that_is_not_a_regular_file_is_refused_not_replaced(model, tmp_path):
    snap = model.snapshot(PROMPT)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        snap.save(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    (tmp_path / "store").mkdir()
    (tmp_path / "link.npz").symlink_to(tmp_path / "store" / "target.npz")
    snap.save(tmp_path / "link.npz")  # written through the link: the link stays, its target is the file
    assert (tmp_path / "link.npz").is_symlink() and (tmp_path / "store" / "target.npz").is_file()
    assert prefix_cache.PrefixSnapshot.load(tmp_path / "link.npz").token_ids == tuple(PROMPT)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["target.npz"]


def test_a_long_but_valid_name_can_be_saved(model, tmp_path):
    path = tmp_path / ("s" * 250 + ".npz")
    model.snapshot(PROMPT, path=path)
    assert path.is_file()


def _zip_bytes(model) -> bytes:
    """What `save` writes for a snapshot of PROMPT, as bytes (the same layout, into a buffer)."""
    buf = io.BytesIO()
    snap = model.snapshot(PROMPT)
    meta = {"format": 1, "model": snap.model, "token_ids": list(snap.token_ids), "n_valid": len(PROMPT),
            "next_slot": snap.kv.next_slot, "next_position": len(PROMPT)}
    arrays = {f"k{i}": k for i, k in enumerate(snap.kv.k)} | {f"v{i}": v for i, v in enumerate(snap.kv.v)}
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), positions=snap.kv.positions, **arrays)
    return buf.getvalue()


def test_a_damaged_zip_is_an_edgeinfer_error(model, tmp_path):
    raw = bytearray(_zip_bytes(model))
    central = raw.rfind(b"PK\x01\x02")
    for offset, value in ((central + 10, 99), (central + 8, 0x01), (central + 6, 250)):  # method, encrypted, version
        bad = bytearray(raw)
        bad[offset] = value
        p = tmp_path / f"bad{offset}.npz"
        p.write_bytes(bytes(bad))
        with pytest.raises(EdgeInferError):
            model.restore(p)
    assert model.generate(PROMPT, max_new_tokens=3, temperature=0).usage.completion_tokens == 3


def test_arrays_larger_than_the_ring_are_refused_before_they_are_read(model, tmp_path, monkeypatch):
    spec = model.manifest.arch
    big = tmp_path / "big.npz"
    with zipfile.ZipFile(big, "w", zipfile.ZIP_DEFLATED) as z:
        for name in ["meta", "positions"] + [f"{c}{i}" for c in "kv" for i in range(spec.num_layers)]:
            with z.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                         "shape": (1 << 30, spec.num_kv_heads, spec.head_dim)})
    reads = []
    monkeypatch.setattr(np.lib.format, "read_array", lambda *a, **k: reads.append(1))
    with pytest.raises(InvalidArgumentError, match="does not fit this model's ring of 64"):
        model.restore(big)
    assert reads == []  # refused from the headers: no data read


def test_a_fifo_is_refused_not_read_for_ever(model, tmp_path):
    fifo = tmp_path / "s.npz"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        model.restore(fifo)


def test_metadata_of_the_wrong_types_is_refused(model, tmp_path):
    raw = _zip_bytes(model)
    for change in ({"format": True}, {"token_ids": [1.9] * len(PROMPT)}, {"n_valid": str(len(PROMPT))}):
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            meta = json.loads(np.lib.format.read_array(z.open("meta.npy")).tobytes()) | change
            out = tmp_path / "m.npz"
            with zipfile.ZipFile(out, "w") as w:
                for name in z.namelist():
                    if name == "meta.npy":
                        buf = io.BytesIO()
                        np.lib.format.write_array(buf, np.frombuffer(json.dumps(meta).encode(), np.uint8))
                        w.writestr(name, buf.getvalue())
                    else:
                        w.writestr(name, z.read(name))
        with pytest.raises(InvalidArgumentError):
            model.restore(out)


def test_a_request_that_fails_on_restored_rows_does_not_make_the_next_ones_fail(model, tmp_path):
    """v0 of 3e38 passes the finiteness check; the request on it fails (non-finite logits), and its
    rows were kept as a reusable prefix, so every later prompt starting with BOS failed too."""
    snap = model.snapshot(PROMPT)
    v = (np.full_like(snap.kv.v[0], 3e38),) + snap.kv.v[1:]
    poisoned = prefix_cache.PrefixSnapshot(snap.token_ids, dataclasses.replace(snap.kv, v=v), snap.model)
    model.restore(poisoned)
    with pytest.raises(ModelFormatError):
        model.generate(PROMPT + [500, 501], max_new_tokens=3, temperature=0)
    fresh = edgeinfer.load(model.folder, capacity_tokens=64, threads=1)
    want = fresh.generate([1, 300, 301], max_new_tokens=5, temperature=0).token_ids
    assert model.generate([1, 300, 301], max_new_tokens=5, temperature=0).token_ids == want


def test_a_member_that_unpacks_past_what_the_ring_needs_is_refused_unread(model, tmp_path):
    """A review: a header declaring a huge npy header length (numpy reads it whole), a dtype of
    large items, or a 2-D meta got past the shape check (0.42 MB files, 400-800 MB of memory)."""
    raw = _zip_bytes(model)
    out = tmp_path / "big.npz"
    with zipfile.ZipFile(io.BytesIO(raw)) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as w:
        for name in z.namelist():
            w.writestr(name, z.read(name) + (b"\0" * (4 << 20) if name == "k0.npy" else b""))
    with pytest.raises(InvalidArgumentError, match="unpacked"):
        model.restore(out)


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_LZMA])
def test_a_broken_compressed_stream_is_an_edgeinfer_error(model, tmp_path, method):
    raw = _zip_bytes(model)
    out = tmp_path / "c.npz"
    with zipfile.ZipFile(io.BytesIO(raw)) as z, zipfile.ZipFile(out, "w", method) as w:
        for name in z.namelist():
            w.writestr(name, z.read(name))
    data = bytearray(out.read_bytes())
    start = data.find(b"k0.npy") + 6 + 40  # inside the first array's compressed stream
    data[start:start + 16] = bytes(16)
    out.write_bytes(bytes(data))
    with pytest.raises(InvalidArgumentError):
        model.restore(out)


def test_a_name_planted_beside_the_destination_is_not_followed(model, tmp_path):
    """A review: the temporary name was predictable (pid and thread), and open() followed a link
    planted under it (written through into its target; a FIFO there blocked the save for ever)."""
    import threading

    other = tmp_path / "other.txt"
    other.write_text("keep")
    for name in (f".edgeinfer-snapshot-{os.getpid()}-{threading.get_ident()}.partial",
                 f".s.npz.partial-{os.getpid()}-{threading.get_ident()}"):
        (tmp_path / name).symlink_to(other)
    model.snapshot(PROMPT, path=tmp_path / "s.npz")
    assert other.read_text() == "keep" and (tmp_path / "s.npz").is_file()


def test_a_snapshot_file_has_the_mode_the_umask_gives(model, tmp_path):
    """A review: the file was forced to 0644, readable by everyone under a umask of 077 (a snapshot
    holds what the prompt said)."""
    old = os.umask(0o077)
    try:
        model.snapshot(PROMPT, path=tmp_path / "s.npz")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "s.npz").st_mode) == 0o600


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX modes")
def test_a_snapshot_saved_over_another_keeps_its_mode(model, tmp_path):
    """A hostile round: a file set to 0600 became 0644 when saved again (a new file under the umask,
    renamed over it), its prompt readable by all."""
    p = tmp_path / "s.npz"
    model.snapshot(PROMPT, path=p)
    os.chmod(p, 0o600)
    model.snapshot(PROMPT, path=p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    os.chmod(p, 0o640)
    model.snapshot(path=p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640


@pytest.mark.parametrize("content", [b"hello", b"\x93NUMPY" + b"\0" * 100, b"\x80\x04K\x01."], ids=["text", "npy", "pickle"])
def test_a_file_that_is_not_an_npz_archive_is_refused_without_numpys_pickle_advice(model, tmp_path, content):
    """numpy took such a file for a pickle and said to load it "unsafely" with allow_pickle: advice to
    unpickle an untrusted file, passed on in our message."""
    p = tmp_path / "t.npz"
    p.write_bytes(content)
    with pytest.raises(EdgeInferError, match="not a .npz archive") as e:
        model.restore(p)
    assert "pickle" not in str(e.value)


def test_a_snapshot_of_another_model_says_so(model, tmp_path):
    """Restoring stories260K's snapshot into SmolLM2 said it was "not a prefix snapshot edgeinfer can read
    (ValueError: it holds 5 layers, the model 30)": it is one, of another model (a fresh user's walkthrough).
    Another layer count, or rows of another width, now say so."""
    good = tmp_path / "good.npz"
    model.snapshot(PROMPT, path=good)
    with np.load(good) as z:
        arrays = {name: z[name] for name in z.files}
    layers = model.manifest.arch.num_layers
    more = dict(arrays, **{f"k{layers}": arrays["k0"], f"v{layers}": arrays["v0"]})
    np.savez(tmp_path / "layers.npz", **more)
    with pytest.raises(InvalidArgumentError, match=rf"is a snapshot of another model: .*it holds {layers + 1} layers, "
                                                   rf"this model {layers}"):
        model.restore(tmp_path / "layers.npz")
    wide = {name: (np.concatenate([a, a], -1) if name[0] in "kv" else a) for name, a in arrays.items()}
    np.savez(tmp_path / "wide.npz", **wide)
    with pytest.raises(InvalidArgumentError, match=r"is a snapshot of another model: .*its rows are"):
        model.restore(tmp_path / "wide.npz")
    model.restore(good)  # the model's own still restores


def test_a_good_snapshot_too_long_for_this_ring_says_so(converted, model, tmp_path):
    """A snapshot saved from a larger ring, restored after the app was reconfigured with a smaller one,
    was "not a prefix snapshot edgeinfer can read" (a long-running app's review: an app deletes files
    it cannot read); it is a good file that does not fit, and still restores into a ring that holds it."""
    big = edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=256, threads=1)
    ids = [1] + [400 + i % 50 for i in range(99)]
    big.snapshot(ids, path=tmp_path / "s.npz")
    with pytest.raises(InvalidArgumentError, match=r"holds a prefix of 100 tokens, which does not fit this model's "
                                                   r"ring of 64: load the model with capacity_tokens of at least 100"):
        model.restore(tmp_path / "s.npz")
    big.restore(tmp_path / "s.npz")


def test_a_writer_killed_mid_save_leaves_a_file_the_next_save_removes(model, tmp_path, monkeypatch):
    """kill -9 during save left a .partial of 4-16 MB beside the snapshot for ever, one per kill (a
    long-running app's review). The next save to that destination removes its own stale ones (older
    than STALE_PARTIAL_S: a younger one may be another writer's at work); nothing else is touched.
    The file and the rename are synced to the disk (a power cut leaves the old file or the new)."""
    import hashlib
    import subprocess
    import sys

    dest = tmp_path / "sys.npz"
    code = (f"import edgeinfer, numpy as np, os\n"
            f"m = edgeinfer.load({str(model.folder)!r}, capacity_tokens=64, threads=1)\n"
            f"s = m.snapshot({PROMPT!r})\n"
            f"real = np.savez\n"
            f"def killed(f, **a):\n    real(f, **a); f.flush(); os.kill(os.getpid(), 9)\n"
            f"np.savez = killed\n"
            f"s.save({str(dest)!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert r.returncode == -9, r.stderr.decode()
    (left,) = tmp_path.glob("*.partial")
    stem = ".edgeinfer-snapshot-" + hashlib.sha256(b"sys.npz").hexdigest()[:12]
    assert left.name.startswith(stem + ".") and not dest.exists()
    young = tmp_path / f"{stem}.0123456789abcdef.partial"  # another writer's, at work
    young.write_bytes(b"x")
    other = tmp_path / ".edgeinfer-snapshot-000000000000.feedfacefeedface.partial"  # another destination's
    other.write_bytes(b"x")
    old = time.time() - prefix_cache.STALE_PARTIAL_S - 5
    for p in (left, other):
        os.utime(p, (old, old))
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_IFMT(os.fstat(fd).st_mode)), real_fsync(fd)))
    model.snapshot(PROMPT, path=dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.name, young.name, "sys.npz"])
    assert synced == [stat.S_IFREG, stat.S_IFDIR]  # the file, then the folder that holds the rename
    assert prefix_cache.PrefixSnapshot.load(dest).token_ids == tuple(PROMPT)


@pytest.mark.parametrize("before,after", [(b"'shape': (", b"'shape': )"), (b"'descr': '<f4'", b"'descr': ',f4'")])
def test_a_damaged_array_header_is_an_edgeinfer_error(model, tmp_path, before, after):
    """Hostile round: one flipped byte in a member's .npy header reached numpy's header parser, whose
    tokenize.TokenError and SyntaxError came out of restore as themselves (614 of 3,000 random edits)."""
    p = tmp_path / "s.npz"
    model.snapshot(PROMPT, path=p)
    raw = p.read_bytes()
    assert before in raw  # the members are stored, not compressed: the header is there as written
    p.write_bytes(raw.replace(before, after, 1))
    with pytest.raises(edgeinfer.InvalidArgumentError, match="not a prefix snapshot edgeinfer can read"):
        model.restore(p)


def test_a_folder_whose_manifest_lists_no_files_takes_and_makes_no_snapshots(converted, tmp_path):
    """A hostile round: a folder whose manifest lists no files (edited by hand; loaded unchecked) had the
    fingerprint of no files at all, the same for every such folder, so `restore` took the rows of
    another model's snapshot. Such a folder now refuses snapshots, before anything is done for one."""
    import shutil

    folder = tmp_path / "int8"  # another model with the fp32 one's ring geometry (float32 KV)
    shutil.copytree(converted(STORIES_SRC, "int8"), folder)
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    manifest.pop("files")
    manifest.pop("manifest_sha256", None)
    (folder / "edgeinfer.json").write_text(json.dumps(manifest))
    b = edgeinfer.load(folder, capacity_tokens=64, threads=1)
    b.generate(PROMPT, max_new_tokens=2, temperature=0)
    held = list(b.held)
    a = edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=64, threads=1)
    a.snapshot(PROMPT, path=tmp_path / "a.npz")
    for call in (lambda: b.restore(tmp_path / "a.npz"), lambda: b.snapshot([1, 5, 6]), b.snapshot, b.fingerprint):
        with pytest.raises(InvalidArgumentError, match="manifest lists no files"):
            call()
    assert b.held == held


def test_a_bad_destination_is_refused_before_the_cache_is_emptied_for_the_prefix(model, tmp_path):
    """A hostile round: `snapshot(prefix, path=...)` prefilled the prefix (the held prompt gone) before
    it refused the path; "x.npz/" was written as the file x.npz; `restore(None)` did not say that a
    PrefixSnapshot is taken."""
    model.generate(PROMPT, max_new_tokens=2, temperature=0)
    held = list(model.held)
    (tmp_path / "folder").mkdir()
    for bad, error in ((7, edgeinfer.InvalidArgumentTypeError), (str(tmp_path / "x.npz") + "/", "names a folder"),
                       (str(tmp_path / "x.npz") + "/.", "names a folder"), (tmp_path / "folder", "is a folder"),
                       (tmp_path / "nope" / "s.npz", "its folder does not exist"),
                       (str(tmp_path / "a\0b.npz"), "cannot write the snapshot"),
                       ("/proc/s.npz", "cannot write the snapshot")):  # no file can be made there (a review)
        with pytest.raises(error if isinstance(error, type) else InvalidArgumentError,
                           match=None if isinstance(error, type) else error):
            model.snapshot([1, 5, 6], path=bad)
        assert model.held == held, bad
    assert [p.name for p in tmp_path.iterdir()] == ["folder"] and not any((tmp_path / "folder").iterdir())
    with pytest.raises(InvalidArgumentError, match="names a folder"):
        model.snapshot().save(str(tmp_path / "x.npz") + "/")
    with pytest.raises(edgeinfer.InvalidArgumentTypeError, match="or a PrefixSnapshot"):
        model.restore(None)

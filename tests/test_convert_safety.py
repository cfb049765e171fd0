"""`edgeinfer convert` never deletes what it should not, and never shows a traceback for an OS error.

`--force` replaces only an existing edgeinfer model folder (or an empty folder), never the source
folder, a folder holding it (also through symlinks) or the current folder, and never a file.
Any OSError while converting (permission, not a folder, read-only, full disk) is one line, exit 1,
no temporary folder left behind, an existing destination untouched.
"""

from __future__ import annotations

import errno
import importlib
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import TINY
from edgeinfer.cli import main
from edgeinfer.errors import ConvertError

SRC = TINY / "llama2_gqa_tied"


@pytest.fixture
def work(tmp_path) -> Path:
    """tmp/work holding a Hugging Face folder `src` and a file of the user's, `notes.txt`."""
    w = tmp_path / "work"
    w.mkdir()
    shutil.copytree(SRC, w / "src", ignore=shutil.ignore_patterns("reference.npz"))
    (w / "notes.txt").write_text("mine")
    return w


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_convert(capsys, src, dst, *extra: str) -> tuple[int, str]:
    rc = main(["convert", str(src), "-o", str(dst), "-q", *extra])
    return rc, capsys.readouterr().err


def assert_user_error(rc: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("edgeinfer: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _dead_pid() -> int:
    """The pid of a process that has ended (a leftover's conversion, killed)."""
    import subprocess
    import sys

    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def assert_no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def model_folder(path: Path) -> Path:
    path.mkdir()
    (path / "edgeinfer.json").write_text("{}")
    (path / "model.onnx").write_bytes(b"old")
    return path


def test_force_refuses_the_parent_of_the_source(capsys, work):
    """The report: `convert SRC -o PARENT_OF_SRC --force` deleted the checkpoint and its neighbours."""
    before = snapshot(work)
    rc, err = run_convert(capsys, work / "src", work, "--force")
    assert_user_error(rc, err, "contains the source folder")
    assert snapshot(work) == before
    assert_no_leftovers(work.parent)


def test_force_refuses_an_ancestor_of_the_source_even_if_it_is_a_model_folder(capsys, work):
    (work / "edgeinfer.json").write_text("{}")
    before = snapshot(work)
    rc, err = run_convert(capsys, work / "src", work, "--force")
    assert_user_error(rc, err, "contains the source folder")
    assert snapshot(work) == before


def test_force_refuses_the_source_itself(capsys, work):
    before = snapshot(work)
    rc, err = run_convert(capsys, work / "src", work / "src", "--force")
    assert_user_error(rc, err, "must differ from the source")
    assert snapshot(work) == before


@pytest.mark.parametrize("via", ["dst_link", "src_link"])
def test_force_refuses_an_ancestor_through_a_symlink(capsys, work, tmp_path, via):
    before = snapshot(work)
    link = tmp_path / via
    if via == "dst_link":  # DST is a link to the folder holding SRC
        link.symlink_to(work, target_is_directory=True)
        src, dst = work / "src", link
    else:  # SRC is reached through a link; DST is the folder holding the real SRC
        link.symlink_to(work / "src", target_is_directory=True)
        src, dst = link, work
    rc, err = run_convert(capsys, src, dst, "--force")
    assert_user_error(rc, err, "contains the source folder")
    assert snapshot(work) == before and link.is_symlink()


def test_force_refuses_a_folder_that_is_not_a_model_folder(capsys, work, tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"meow")
    rc, err = run_convert(capsys, work / "src", other, "--force")
    assert_user_error(rc, err, "not an edgeinfer model folder", "edgeinfer.json")
    assert snapshot(other) == {"cat.jpg": b"meow"}
    assert_no_leftovers(tmp_path)


def test_force_replaces_a_model_folder_or_an_empty_folder(capsys, work, tmp_path):
    old = model_folder(tmp_path / "model")
    rc, err = run_convert(capsys, work / "src", old, "--force")
    assert rc == 0, err
    assert (old / "model.onnx").read_bytes() != b"old" and (old / "model.onnx.data").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = run_convert(capsys, work / "src", empty, "--force")
    assert rc == 0, err
    assert (empty / "edgeinfer.json").exists()
    assert_no_leftovers(tmp_path)


def test_force_through_a_link_replaces_the_link_not_its_target(capsys, work, tmp_path):
    target = model_folder(tmp_path / "model")
    (tmp_path / "current").symlink_to(target, target_is_directory=True)
    rc, err = run_convert(capsys, work / "src", tmp_path / "current", "--force")
    assert rc == 0, err
    assert not (tmp_path / "current").is_symlink() and (tmp_path / "current" / "model.onnx.data").exists()
    assert (target / "model.onnx").read_bytes() == b"old"
    assert_no_leftovers(tmp_path)


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_destination_that_is_a_file(capsys, work, force):
    f = work / "notes.txt"
    rc, err = run_convert(capsys, work / "src", f, *force)
    assert_user_error(rc, err, "is a file, not a folder")
    assert f.read_text() == "mine"
    assert_no_leftovers(work)


def test_dot_with_force_in_the_folder_holding_the_source(capsys, work, monkeypatch):
    monkeypatch.chdir(work)
    before = snapshot(work)
    rc, err = run_convert(capsys, "src", ".", "--force")
    assert_user_error(rc, err, "contains the source folder")
    assert "Traceback" not in err and snapshot(work) == before


def test_dot_with_force_in_a_model_folder(capsys, work, tmp_path, monkeypatch):
    """Even a model folder is not replaced while it is the current folder (the shell would sit in a deleted folder)."""
    cwd = model_folder(tmp_path / "model")
    monkeypatch.chdir(cwd)
    rc, err = run_convert(capsys, work / "src", ".", "--force")
    assert_user_error(rc, err, "the current folder")
    assert (cwd / "model.onnx").read_bytes() == b"old"


def test_parent_is_a_file(capsys, work):
    rc, err = run_convert(capsys, work / "src", work / "notes.txt" / "sub")
    assert_user_error(rc, err, "notes.txt is a file, not a folder")
    assert_no_leftovers(work)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_unwritable_parent(capsys, work):
    rc, err = run_convert(capsys, work / "src", "/proc/edgeinfer-out")
    assert_user_error(rc, err, "cannot convert into /proc/edgeinfer-out")


@pytest.mark.parametrize("code,needle", [
    (errno.EACCES, "Permission denied"),
    (errno.EROFS, "Read-only file system"),
    (errno.ENOTDIR, "Not a directory"),
    (errno.ENOSPC, "disk full"),
])
def test_os_error_half_way_is_one_line(capsys, monkeypatch, work, tmp_path, code, needle):
    from edgeinfer.converters import onnx_writer

    dst = model_folder(tmp_path / "model")
    real_add, count = onnx_writer.WeightWriter.add, [0]

    def add(self, name, array):
        count[0] += 1
        if count[0] > 3:
            raise OSError(code, os.strerror(code), str(tmp_path / "x"))
        return real_add(self, name, array)

    monkeypatch.setattr(onnx_writer.WeightWriter, "add", add)
    rc, err = run_convert(capsys, work / "src", dst, "--force")
    assert_user_error(rc, err, needle)
    assert (dst / "model.onnx").read_bytes() == b"old"
    assert_no_leftovers(tmp_path)


def test_a_full_disk_names_what_a_killed_conversion_left(capsys, monkeypatch, work, tmp_path):
    """A conversion killed outright (SIGKILL, the OOM killer) left a 52 MB `.smol.partial-PID` that is
    swept only after an hour; the rerun then failed with "disk full ... nothing was written" and did not
    mention the folder holding the space (a hostile round). It is named now; one of a conversion still
    running (this process) is not."""
    import subprocess
    import sys

    from edgeinfer.converters import onnx_writer

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    left = tmp_path / f".model.partial-{dead}-0a1b2c3d"
    left.mkdir()
    (left / "model.onnx.data").write_bytes(b"x" * 1000)
    for p in (left / "model.onnx.data", left):
        os.utime(p, (time.time() - 120,) * 2)
    (tmp_path / f".model.partial-{os.getpid()}-99999999").mkdir()  # a running conversion's: not named
    (tmp_path / f".model.partial-{dead}-77777777").mkdir()  # changed just now: perhaps another container's

    def add(self, name, array):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x"))

    monkeypatch.setattr(onnx_writer.WeightWriter, "add", add)
    rc, err = run_convert(capsys, work / "src", tmp_path / "model")
    assert_user_error(rc, err, "disk full while writing model: nothing was written; beside it, "
                      f".model.partial-{dead}-0a1b2c3d, left by a conversion no longer running here and untouched "
                      "for a minute, holds space: remove it unless another machine or container is converting")
    assert "99999999" not in err and "77777777" not in err


def test_no_process_is_asked_about_on_windows(monkeypatch):
    """os.kill(pid, 0) is TerminateProcess on Windows: asking whether a leftover's process was gone
    would have ended whatever process had that number (a review)."""
    from edgeinfer.converters import destination

    monkeypatch.setattr(destination.sys, "platform", "win32")
    monkeypatch.setattr(destination.os, "kill", lambda *a: pytest.fail("os.kill called on Windows"))
    assert destination._gone(1) is False


def test_os_error_at_the_final_rename_is_a_convert_error(monkeypatch, work, tmp_path):
    """The Python API raises ConvertError too, not OSError, and cleans up."""
    convert_module = importlib.import_module("edgeinfer.converters.convert")

    def refuse(tmp, dst, force=True):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(convert_module, "_replace_atomically", refuse)
    with pytest.raises(ConvertError, match="Permission denied"):
        convert_module.convert(work / "src", tmp_path / "out", quant="fp32")
    assert not (tmp_path / "out").exists()
    assert_no_leftovers(tmp_path)


def test_force_refuses_a_model_folder_holding_files_no_conversion_wrote(capsys, work, tmp_path):
    """A saved prefix snapshot or notes inside a model folder: --force replacing the folder would
    delete them with it (hostile review); it is refused, naming them, and nothing changes."""
    dst = tmp_path / "model"
    assert run_convert(capsys, work / "src", dst)[0] == 0
    (dst / "system.npz").write_bytes(b"a snapshot")
    (dst / "notes").mkdir()
    before = snapshot(dst)
    rc, err = run_convert(capsys, work / "src", dst, "--force")
    assert_user_error(rc, err, "also holds notes, system.npz", "move it out first")
    assert snapshot(dst) == before
    (dst / "system.npz").unlink()
    (dst / "notes").rmdir()
    (dst / ".DS_Store").write_bytes(b"Finder")  # a desktop's own clutter is not the user's work
    import edgeinfer

    edgeinfer.load(dst)  # its verification stamp is the converter's own: not in the way
    assert run_convert(capsys, work / "src", dst, "--force")[0] == 0
    assert_no_leftovers(tmp_path)


def test_a_destination_that_links_to_nothing_is_refused_before_any_work(capsys, work, tmp_path, monkeypatch):
    convert_module = importlib.import_module("edgeinfer.converters.convert")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(convert_module, "temp_folder", lambda dst: pytest.fail("work began"))
    assert_user_error(*run_convert(capsys, work / "src", tmp_path / "dangling"), "is a link to nothing")


@pytest.mark.parametrize("existing", [False, True])
def test_every_file_is_on_the_disk_before_the_model_is_renamed_into_place(monkeypatch, work, tmp_path, existing):
    """A power cut after `convert` returns must not leave a model folder of empty or partly written
    files (the page cache was not flushed): each written file and the folder are fsynced before the
    rename, the folder holding the destination after it, and (with --force) the old model is removed
    only after that."""
    convert_module = importlib.import_module("edgeinfer.converters.convert")
    dst = tmp_path / "out"
    if existing:
        model_folder(dst)
    events = []
    real_fsync, real_replace, real_rename, real_rmtree = os.fsync, os.replace, os.rename, shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a), str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a), str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: (events.append(("rmtree", str(p))),
                                                              real_rmtree(p, *a, **k))[1])
    destination = importlib.import_module("edgeinfer.converters.destination")
    real_exchange = destination._exchange
    monkeypatch.setattr(destination, "_exchange", lambda a, b: (events.append(("rename", str(a), str(b))),
                                                                real_exchange(a, b))[1])
    convert_module.convert(work / "src", dst, quant="fp32", force=existing)
    publish = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(dst))
    tmp = events[publish][1]
    synced_before = {e[1] for e in events[:publish] if e[0] == "fsync"}
    written = {str(Path(tmp) / p.relative_to(dst)) for p in dst.rglob("*")} | {tmp}
    assert written <= synced_before, written - synced_before
    assert ("fsync", str(tmp_path)) in events[publish:]
    if existing:
        removed = next(i for i, e in enumerate(events) if e[0] == "rmtree" and (".old-" in e[1] or e[1] == tmp))
        assert events.index(("fsync", str(tmp_path)), publish) < removed
    assert_no_leftovers(tmp_path)


@pytest.mark.parametrize("manifest", ['{"format": 1, "arch', '{"my": "settings"}', "[]", "{}", '{"files": []}'])
def test_force_keeps_user_files_beside_a_manifest_that_lists_none(capsys, work, tmp_path, manifest):
    """A model folder whose edgeinfer.json was damaged, or a project folder holding an edgeinfer.json
    of its own: the user's files there were deleted by --force, because a manifest that could not
    be read (or listed no files) counted nothing as theirs (a hostile review). Now only the names a
    conversion writes may be replaced without a file list; anything else is refused, by name."""
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "edgeinfer.json").write_text(manifest)
    (dst / "model.onnx").write_bytes(b"old")
    (dst / "notes.txt").write_text("mine")
    (dst / "experiments").mkdir()
    (dst / "experiments" / "run1.csv").write_text("1,2")
    before = snapshot(dst)
    rc, err = run_convert(capsys, work / "src", dst, "--force")
    assert_user_error(rc, err, "experiments", "notes.txt", "which no conversion wrote")
    assert snapshot(dst) == before
    assert_no_leftovers(tmp_path)


def test_force_keeps_files_that_only_look_like_desktop_or_stamp_clutter(capsys, work, tmp_path):
    """`._budget.xlsx` with no budget.xlsx beside it is not macOS's AppleDouble file, and
    `.edgeinfer-verified.json.backup.tmp` is not the stamp's temporary file: both are the user's."""
    dst = tmp_path / "model"
    assert run_convert(capsys, work / "src", dst)[0] == 0
    for name in ("._budget.xlsx", ".edgeinfer-verified.json.backup.tmp"):
        (dst / name).write_text("precious")
        rc, err = run_convert(capsys, work / "src", dst, "--force")
        assert_user_error(rc, err, name)
        (dst / name).unlink()
    (dst / "._model.onnx").write_text("Finder's")  # beside the file it describes: clutter, replaced
    (dst / ".DS_Store").write_text("Finder's")
    assert run_convert(capsys, work / "src", dst, "--force")[0] == 0
    assert_no_leftovers(tmp_path)


def test_force_takes_a_stamp_s_temporary_file_made_while_it_looks_for_the_load_s(capsys, work, tmp_path, monkeypatch):
    """A hostile round: the stamp's temporary files were listed first and the folder second, so one a
    loading process wrote in between was taken for the user's, and --force refused (1 in ~110)."""
    dst = tmp_path / "model"
    assert run_convert(capsys, work / "src", dst)[0] == 0
    real = Path.iterdir

    def listing_as_a_load_stamps(self):
        if self == dst:
            (dst / ".edgeinfer-verified.json.a1b2c3d4.tmp").write_text("{}")  # mkstemp's name, as a load writes
        return real(self)

    monkeypatch.setattr(Path, "iterdir", listing_as_a_load_stamps)
    rc, err = run_convert(capsys, work / "src", dst, "--force")
    assert rc == 0, err


def test_force_swaps_the_old_model_for_the_new_in_one_step(capsys, work, tmp_path, monkeypatch):
    """--force moved the old model aside, then the new one in: a process killed between the two
    renames (the OOM killer, a power cut) left no model at DST. Where the system can exchange two
    names atomically (Linux renameat2, macOS renamex_np) DST is never missing."""
    dst = model_folder(tmp_path / "model")
    seen = []
    real_replace, real_rename = os.replace, os.rename
    for name, real in (("replace", real_replace), ("rename", real_rename)):
        monkeypatch.setattr(os, name, lambda a, b, real=real: (seen.append(os.path.lexists(dst)), real(a, b),
                                                               seen.append(os.path.lexists(dst)))[1])
    assert run_convert(capsys, work / "src", dst, "--force")[0] == 0
    assert all(seen) and (dst / "model.onnx").read_bytes() != b"old"
    assert_no_leftovers(tmp_path)


def test_an_old_model_that_cannot_be_removed_is_named_not_left_unsaid(capsys, work, tmp_path, monkeypatch):
    """--force over a model folder that could not be deleted (mode 0555, as another user) swapped the
    models, then left the old one, as large as the model, hidden beside DST as `.model.partial-...`
    with exit 0 and no word (a hostile round). It is still left (the conversion succeeded), but said."""
    from edgeinfer.converters import destination

    dst = model_folder(tmp_path / "model")
    real = shutil.rmtree

    def unremovable(path, ignore_errors=False, **kwargs):
        if (Path(path) / "model.onnx").is_file() and (Path(path) / "model.onnx").read_bytes() == b"old":
            if ignore_errors:
                return
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "model.onnx"))
        real(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(destination.shutil, "rmtree", unremovable)
    rc, err = run_convert(capsys, work / "src", dst, "--force")
    assert rc == 0 and (dst / "model.onnx").read_bytes() != b"old", err
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".model.")]
    assert len(left) == 1 and (left[0] / "model.onnx").read_bytes() == b"old"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: warning: the model that") and \
        f"it is left at {left[0]}: remove it by hand" in lines[0] and "Permission denied" in lines[0], err


def test_parents_made_before_the_disk_filled_are_removed(capsys, work, tmp_path, monkeypatch):
    """-o a/b/c/out on a file system with room for two folders: "disk full ... nothing was written",
    and a/ and a/b/ were left (a hostile round)."""
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name == "c":  # its parents made first, as mkdir(parents=True) makes them
            real(self.parent, parents=True, exist_ok=True)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    rc, err = run_convert(capsys, work / "src", tmp_path / "a" / "b" / "c" / "out")
    assert_user_error(rc, err, "disk full", "nothing was written")
    assert not (tmp_path / "a").exists()


def test_a_model_stranded_between_two_renames_is_put_back(capsys, work, tmp_path, monkeypatch):
    """Where no exchange exists, the two renames remain; a conversion killed between them left
    `.DST.old-PID` and no DST. The next conversion into DST puts the old model back first (so it
    is refused without --force, the model intact), and a later --force replaces it as usual."""
    destination = importlib.import_module("edgeinfer.converters.destination")
    dst = tmp_path / "model"
    stranded = tmp_path / f".model.old-{_dead_pid()}-0a1b2c3d"
    assert run_convert(capsys, work / "src", stranded)[0] == 0  # a whole model, as the first rename left it
    before = snapshot(stranded)
    rc = main(["convert", str(work / "src"), "-o", str(dst)])
    out, err = capsys.readouterr()
    assert rc == 1 and "destination exists" in err and f"put back {dst}" in out + err
    assert not stranded.exists() and snapshot(dst) == before
    monkeypatch.setattr(destination, "_exchange", lambda a, b: False)  # the two-rename path
    (dst / "model.onnx").write_bytes(b"old")  # (its stamp then says the folder changed: it is rewritten)
    assert run_convert(capsys, work / "src", dst, "--force")[0] == 0
    assert (dst / "model.onnx").read_bytes() != b"old"
    assert_no_leftovers(tmp_path)


def test_a_half_removed_old_model_is_not_put_back(capsys, work, tmp_path):
    """A review: where renames are not atomic swaps, a `.DST.old-PID` whose removal (after a finished
    swap) was cut short is missing files; if DST was later deleted, it was put back half gone."""
    stranded = tmp_path / f".model.old-{_dead_pid()}-0a1b2c3d"
    assert run_convert(capsys, work / "src", stranded)[0] == 0
    (stranded / "model.onnx.data").unlink()
    assert run_convert(capsys, work / "src", tmp_path / "model")[0] == 0  # converts; nothing put back
    assert stranded.exists() and (tmp_path / "model" / "model.onnx.data").exists()


def test_long_destination_names_that_begin_alike_keep_their_leftovers_apart(tmp_path):
    """A review: hidden names kept only the first 100 bytes of DST's name, so a model stranded beside
    "m...mA" was put back as "m...mB". Past 100 bytes the name ends in a hash of the whole."""
    destination = importlib.import_module("edgeinfer.converters.destination")
    a, b = tmp_path / ("m" * 100 + "A"), tmp_path / ("m" * 100 + "B")
    assert destination._hidden(a) != destination._hidden(b)
    assert destination._hidden(tmp_path / "short") == ".short"
    stranded = tmp_path / f"{destination._hidden(a)}.old-{_dead_pid()}-0a1b2c3d"
    stranded.mkdir()
    destination._restore_stranded(b, print)
    assert stranded.exists() and not b.exists()


def test_windows_takes_the_two_rename_path_and_a_flushable_handle(monkeypatch, tmp_path):
    """A review: on Windows ctypes.CDLL(None) is a TypeError (the swap crashed instead of falling
    back), and os.fsync needs a handle that may write."""
    destination = importlib.import_module("edgeinfer.converters.destination")
    durable = importlib.import_module("edgeinfer.durable")
    monkeypatch.setattr(destination.sys, "platform", "win32")
    assert destination._exchange(tmp_path / "a", tmp_path / "b") is False
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a: (opened.append(flags), real_open(p, flags, *a))[1])
    (tmp_path / "f").write_text("x")
    durable.sync_file(tmp_path / "f")
    assert opened == [os.O_RDWR]


def test_files_written_into_the_destination_while_converting_are_not_deleted(capsys, work, tmp_path, monkeypatch):
    """A review: --force decided what it may delete before the minutes of converting; a prefix
    snapshot a daemon saved into DST meanwhile was deleted at the swap. It is checked again there."""
    convert_module = importlib.import_module("edgeinfer.converters.convert")
    dst = tmp_path / "model"
    assert run_convert(capsys, work / "src", dst)[0] == 0
    real = convert_module._replace_atomically

    def late_write(tmp, d, force=True):
        (d / "system.npz").write_bytes(b"snapshot")
        return real(tmp, d, force)

    monkeypatch.setattr(convert_module, "_replace_atomically", late_write)
    rc, err = run_convert(capsys, work / "src", dst, "--force")
    assert_user_error(rc, err, "system.npz", "written while converting")
    assert (dst / "system.npz").read_bytes() == b"snapshot"
    assert_no_leftovers(tmp_path)


def test_a_user_s_folders_that_merely_look_like_leftovers_are_never_touched(capsys, work, tmp_path):
    """A hostile round: the sweep of killed conversions' leftovers took any `.DST.old-DIGITS` or
    `.DST.partial-DIGITS-...` beside DST whose "pid" was not running and that was an hour old, so a
    dated backup (`.model.old-20231105`) was deleted; and one holding a whole model was renamed into a
    missing DST, which `--force` then replaced. Only the names a conversion makes count: a pid this
    system can have, then 8 hex digits."""
    dead = _dead_pid()
    backup = tmp_path / ".model.old-20231105"
    assert run_convert(capsys, work / "src", backup)[0] == 0  # a whole model, the user's backup of it
    theirs = [tmp_path / ".model.partial-20240101-mine", tmp_path / f".model.old-{dead}",
              tmp_path / f".model.partial-{dead}-0a1b2c3", tmp_path / f".model.old-0{dead}-0a1b2c3d",
              tmp_path / f".model.partial-{dead}-0A1B2C3D"]
    for folder in theirs:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    hour_ago = time.time() - 7200
    for folder in [backup, *theirs]:
        for q in [*folder.iterdir(), folder]:
            os.utime(q, (hour_ago, hour_ago))
    before = {p.name: snapshot(p) for p in [backup, *theirs]}
    ours = tmp_path / f".model.partial-{dead}-0a1b2c3d"  # a killed conversion's: swept
    ours.mkdir()
    (ours / "model.onnx.data").write_bytes(b"x")
    for q in (ours / "model.onnx.data", ours):
        os.utime(q, (hour_ago, hour_ago))
    assert run_convert(capsys, work / "src", tmp_path / "model")[0] == 0  # DST was missing: nothing put back
    assert run_convert(capsys, work / "src", tmp_path / "model", "--force")[0] == 0
    assert {p.name: snapshot(p) for p in [backup, *theirs]} == before and not ours.exists()


def test_leftover_names_take_ascii_pids_of_any_host_only(tmp_path):
    """A review: `isdigit` took "²" (then int() raised: every conversion into DST a traceback) and
    Arabic-Indic digits as a pid; and this machine's own pid_max (32,768 here) missed another host's
    leftovers in a shared folder, whose stranded model was then never put back."""
    destination = importlib.import_module("edgeinfer.converters.destination")
    prefix = ".model.old-"
    assert destination._leftover_pid(prefix + "40000-0a1b2c3d", prefix) == 40000  # another host's (pid_max 2**22)
    assert destination._leftover_pid(prefix + f"{1 << 22}-0a1b2c3d", prefix) == 1 << 22
    for theirs in ("²-deadbeef", "١٢٣٤-deadbeef", f"{(1 << 22) + 1}-0a1b2c3d", "20231105", "2023-11-05", "7-0A1B2C3D",
                   "07-0a1b2c3d", "7-0a1b2c3", "7-0a1b2c3d0", "-0a1b2c3d"):
        assert destination._leftover_pid(prefix + theirs, prefix) is None, theirs
    (tmp_path / ".model.old-²-deadbeef").mkdir()
    destination._restore_stranded(tmp_path / "model", print)  # (raised ValueError)
    assert destination._orphans(tmp_path / "model") == []


def test_force_from_a_removed_working_folder_with_a_relative_source(capsys, work, tmp_path, monkeypatch):
    """A review: with the working folder removed, `convert ../src -o /abs/out --force` was refused with a
    bare "No such file or directory": the source's absolute name cannot be made, to check that DST does
    not hold it. It is refused in words now; the source named absolutely converts."""
    model = tmp_path / "model"
    assert run_convert(capsys, work / "src", model)[0] == 0
    gone = work / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    rc, err = run_convert(capsys, Path("../src"), model, "--force")
    assert_user_error(rc, err, "the current folder no longer exists: give the source '../src' as an absolute path")
    assert run_convert(capsys, work / "src", model, "--force")[0] == 0

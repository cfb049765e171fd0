"""A model folder's files against the sizes and sha256 that `convert` wrote in edgeinfer.json.

`verify(folder, files)` runs at every load: sizes first (one stat each), then sha256. A full hash
of a large model costs about a second per GB, so after a successful one a stamp file
(`.edgeinfer-verified.json`, beside the model) records each file's (size, mtime_ns, ctime_ns,
inode, sha256); a later load skips the hash of a file whose stat still matches its stamp and whose
stamped sha256 equals the manifest's. A stamp does not catch a change that keeps size, mtime,
ctime and inode (bit rot on disk): `check(folder, files)`, behind `edgeinfer inspect DIR --verify`, always
hashes everything. A folder that cannot be written simply gets no stamp, and neither does one inside
installed packages (`installed_dirs`: site-packages, where the bundled models live once installed):
a file there that pip did not install outlives an uninstall or a reinstall, and the `edgeinfer/`
folder it keeps was then imported as an empty namespace package ahead of an editable install
(`cannot import name '__version__'`: the README's two set-up steps, a few seconds apart).

A load reads a folder's files one by one (manifest, hashes, graph, weights, tokenizer), by path, and
`convert --force` may rename another conversion into place between two of those reads: the graph of
one with the weights of the other ran and gave garbage. `folder_identity` tells the conversions
apart (the folder's inode and its manifest's), so a loader compares it before and after reading and
reads again when it changed (`LOAD_ATTEMPTS` times), instead of calling the files corrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import stat
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from edgeinfer import small_files
from edgeinfer.errors import ModelFormatError
from edgeinfer.manifest import MANIFEST_FILE

LOAD_ATTEMPTS = 3  # a folder replaced while being read is read again, this many times in all
STAMP_FILE = ".edgeinfer-verified.json"
STAMP_VERSION = 1
RACY_NS = 2_000_000_000  # a file modified this recently may change again within the same mtime tick


def folder_identity(folder: Path | str) -> tuple | None:
    """What tells one conversion's folder from the next at the same path (a `convert --force` renames
    a whole new folder into place): the folder's device and inode and its manifest's inode, mtime and
    size; None when either cannot be read. (The folder's own mtime is not in it: a load writes its stamp there.)"""
    try:
        d, m = os.stat(folder), os.stat(Path(folder) / MANIFEST_FILE)
    except (OSError, ValueError):
        return None
    return d.st_dev, d.st_ino, m.st_ino, m.st_mtime_ns, m.st_size


def replaced_while_loading(folder: Path | str) -> str:
    return (f"{folder} was replaced while it was being loaded (another conversion was renamed into its place: "
            f"a convert --force?); load it again once that is done")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The file's sha256 as lowercase hex, read in `chunk`-byte pieces."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# what a converter lists whenever the folder holds it: graphs, their weights, the tokenizer
MUST_LIST = ("*.onnx", "*.onnx.data", "*.ort", "*.npy", "tokenizer.model", "tokenizer.json")


def _entries(folder: Path, files: dict, named: Iterable[str] = ()) -> dict:
    """`files` checked for shape (plain file names -> {"bytes": int, "sha256": str}) and for what
    it leaves out: a graph, weights or tokenizer file in the folder that it does not list, or a file
    the manifest names elsewhere (`named`: `Manifest.named_files`), would go unchecked (an entry
    deleted from the manifest must not switch the check off)."""
    if not isinstance(files, dict):
        raise ModelFormatError(f"{folder / MANIFEST_FILE} is corrupted (bad files section)")
    for name, want in files.items():
        if (not isinstance(name, str) or not name or "\0" in name or Path(name).name != name or name in (".", "..")
                or not isinstance(want, dict)
                or not isinstance(want.get("bytes"), int) or isinstance(want["bytes"], bool) or want["bytes"] < 0
                or not isinstance(want.get("sha256"), str)):
            raise ModelFormatError(f"{folder / MANIFEST_FILE} is corrupted (bad files entry {name!r})")
    unnamed = sorted(set(named) - set(files))
    if unnamed:
        raise ModelFormatError(f"{folder / MANIFEST_FILE} names {', '.join(unnamed)} but does not list it in its "
                               "files (so nothing would check it): convert again")
    unlisted = sorted({p.name for pattern in MUST_LIST for p in folder.glob(pattern)} - set(files))
    if unlisted:
        raise ModelFormatError(f"{folder} holds {', '.join(unlisted)}, which its {MANIFEST_FILE} does not list "
                               "(so nothing would check it): move it out of the folder, or convert again")
    return files


def _stat(folder: Path, name: str) -> os.stat_result:
    try:
        st = os.stat(folder / name)
    except FileNotFoundError:
        raise ModelFormatError(f"{folder} lacks {name} (listed in {MANIFEST_FILE}); convert again") from None
    except OSError as e:
        raise ModelFormatError(f"cannot read {folder / name}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{folder / name} is not a regular file")
    return st


def _size_problem(st: os.stat_result, want: dict) -> str | None:
    if st.st_size != want["bytes"]:
        return f"{st.st_size} bytes, expected {want['bytes']}"
    return None


def _hash(folder: Path, name: str) -> str:
    try:
        return sha256_file(folder / name)
    except OSError as e:
        raise ModelFormatError(f"cannot read {folder / name}: {e.strerror or e}") from None


def _mismatch(folder: Path, name: str, what: str, detail: str = "") -> ModelFormatError:
    return ModelFormatError(f"{folder / name} does not match its {what} in {MANIFEST_FILE}{detail}: the file is "
                            "corrupted or was changed; convert again")


def _stamp(st: os.stat_result, sha256: str) -> dict:
    # ctime too: a write followed by os.utime() restores mtime, but not ctime (the kernel sets it)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino,
            "sha256": sha256}


MAX_STAMP_BYTES = 1024 * 1024  # a stamp holds a line or two per file


def read_stamps(folder: Path | str) -> dict:
    """The stamp file's entries (name -> stamp); {} when it is absent, unreadable, not a small regular
    file of JSON (a FIFO, a link to /dev/zero, nesting past the recursion limit) or not ours: then
    every file is hashed."""
    path = Path(folder) / STAMP_FILE
    try:
        d = small_files.parse_json(small_files.read_bytes(path, MAX_STAMP_BYTES, ValueError), path, ValueError)
        return d["files"] if d.get("version") == STAMP_VERSION and isinstance(d.get("files"), dict) else {}
    except (ValueError, AttributeError, KeyError):
        return {}


def installed_dirs() -> list[Path]:
    """Where installed packages live (purelib, platlib, the user's site-packages): no stamp is
    written under them."""
    paths = sysconfig.get_paths()
    dirs = [paths.get("purelib"), paths.get("platlib"), *getattr(site, "getsitepackages", list)()]  # (absent
    # from some virtualenv builds' site module)
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d).resolve() for d in dict.fromkeys(dirs) if d]


def _installed(folder: Path) -> bool:
    try:
        where = folder.resolve()
    except OSError:
        return False
    return any(where.is_relative_to(d) for d in installed_dirs())


def _write_stamps(folder: Path, stamps: dict) -> None:
    """Atomically replace the stamp file (temp file + os.replace); silently nothing if we cannot write."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=STAMP_FILE + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": STAMP_VERSION, "files": stamps}, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / STAMP_FILE)
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def verify(folder: Path | str, files: dict, named: Iterable[str] = ()) -> None:
    """Raise ModelFormatError unless every file in `files` (edgeinfer.json's "files": name ->
    {"bytes", "sha256"}) is present with that size and sha256. Empty `files` (an older manifest):
    nothing to check. Stamped files whose stat is unchanged are not hashed again; after hashing,
    the stamp file is rewritten (never an error if that fails; never inside installed packages)."""
    folder = Path(folder)
    if not files:
        return
    stats = {}
    for name, want in _entries(folder, files, named).items():
        stats[name] = _stat(folder, name)
        problem = _size_problem(stats[name], want)
        if problem:
            raise _mismatch(folder, name, "size", f" ({problem})")
    old = read_stamps(folder)
    new, hashed = {}, False
    for name, want in files.items():
        st = stats[name]
        if old.get(name) == _stamp(st, want["sha256"]):
            new[name] = old[name]
            continue
        if _hash(folder, name) != want["sha256"]:
            raise _mismatch(folder, name, "sha256")
        hashed = True
        if time.time_ns() - st.st_mtime_ns >= RACY_NS:
            new[name] = _stamp(st, want["sha256"])
    if hashed and new and not _installed(folder):
        _write_stamps(folder, new)


def check(folder: Path | str, files: dict, named: Iterable[str] = ()) -> Iterator[tuple[str, str | None]]:
    """Full check, stamps ignored: yield (name, None) for a good file, (name, problem) otherwise,
    in the manifest's order, hashing each file as it comes."""
    folder = Path(folder)
    for name, want in _entries(folder, files, named).items():
        try:
            st = os.stat(folder / name)
        except OSError as e:
            yield name, "missing" if isinstance(e, FileNotFoundError) else f"cannot read ({e.strerror or e})"
            continue
        problem = _size_problem(st, want) if stat.S_ISREG(st.st_mode) else "not a regular file"
        if problem is None:
            try:
                problem = None if sha256_file(folder / name) == want["sha256"] else "sha256 differs"
            except OSError as e:
                problem = f"cannot read ({e.strerror or e})"
        yield name, problem


__all__ = ["STAMP_FILE", "check", "read_stamps", "sha256_file", "verify"]

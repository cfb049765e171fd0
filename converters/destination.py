"""Where a conversion writes: the destination's checks, the temporary folder it is built in, and the
atomic replacement of the destination by it (shared by `convert` and `optimum_export`).

Refusals happen before any work: a destination that is a file, the root, a link to nothing, or
(with force) one that is not a model folder, holds the source or the current folder, or holds
files no conversion wrote. The temporary folder is `.DST.partial-PID-RANDOM` next to `dst`; it
is renamed into place at the end, and `dst` is replaced only then, its files on the disk first.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

from edgeinfer.durable import sync_folder, sync_tree
from edgeinfer.errors import ConvertError, warn_user
from edgeinfer.integrity import STAMP_FILE
from edgeinfer.manifest import MANIFEST_FILE


def absolute(dst: Path | str) -> Path:
    """The destination as one normalised absolute path, for its checks and its writing alike ("missing/../x"
    or "link/.." must not be checked as one folder and replaced as another). ConvertError for a relative
    one from a working folder removed since (it was a traceback; a hostile round)."""
    try:
        return Path(os.path.abspath(dst))
    except FileNotFoundError:
        raise ConvertError(f"the current folder no longer exists: give the destination {os.fspath(dst)!r} as an "
                           "absolute path") from None


def _check_destination(src: Path, dst: Path, force: bool, log=lambda msg: None) -> None:
    """Refuse, before any work, a destination that `convert` must not create or replace.

    DST must be a folder path whose nearest existing ancestor is a folder. An existing DST is
    replaced only with `force`, and only if it is an edgeinfer model folder (has edgeinfer.json)
    or an empty folder; never if it is, or contains, the source folder or the current folder
    (compared both as resolved paths, through symlinks, and as written).
    """
    try:  # a name in another encoding (Latin-1's "mod\xe8le") converted, and then nothing could load it
        os.fspath(dst).encode("utf-8")
    except UnicodeEncodeError:
        raise ConvertError(f"destination {os.fspath(dst)!r} is not valid UTF-8: ONNX Runtime opens only UTF-8 paths, "
                           "so no edgeinfer could load it; choose another name") from None
    _restore_stranded(dst, log)
    if dst.exists() and not dst.is_dir():
        raise ConvertError(f"destination is a file, not a folder: {dst}")
    if dst.parent == dst:  # "/": no folder to build it beside, and never one to replace
        raise ConvertError(f"the destination cannot be the root folder {dst}")
    dangling = next((p for p in Path(os.path.abspath(dst)).parents if p.is_symlink() and not p.exists()), None)
    if dangling is not None:  # it was "File exists" (making the folders above through it)
        raise ConvertError(f"cannot create {dst}: {dangling} is a link to nothing ({os.readlink(dangling)})")
    above = next(p for p in Path(os.path.abspath(dst)).parents if p.exists())
    if not above.is_dir():
        raise ConvertError(f"cannot create {dst}: {above} is a file, not a folder")
    if dst.is_symlink() and not dst.exists():
        raise ConvertError(f"destination {dst} is a link to nothing ({os.readlink(dst)}): remove it or choose another")
    if not dst.exists():
        return
    if not force:
        raise ConvertError(f"destination exists: {dst} (use --force to replace it)")
    real = dst.resolve()
    try:
        src_real = src.resolve()
    except FileNotFoundError:  # a relative source from a working folder removed since: it may still open (through
        # "..") but has no absolute name to compare, and DST could hold it (a review)
        raise ConvertError(f"the current folder no longer exists: give the source {os.fspath(src)!r} as an absolute "
                           "path to replace a model with --force") from None
    if real == src_real:
        raise ConvertError("destination must differ from the source folder")
    try:
        cwd = [("the current folder", Path.cwd())]
    except FileNotFoundError:  # removed since: nothing of it is left to delete
        cwd = []
    for what, p in [("the source folder", src), *cwd]:
        if any(real == q or real in q.parents for q in (p.resolve(), Path(os.path.abspath(p)))):
            raise ConvertError(f"destination {dst} is or contains {what}: --force would delete it")
    if not (dst / MANIFEST_FILE).is_file() and any(dst.iterdir()):
        raise ConvertError(f"destination {dst} is not an edgeinfer model folder (no {MANIFEST_FILE}): --force "
                           "replaces only a model folder or an empty folder; remove it yourself or choose another")
    theirs = _not_the_converters(dst)
    if theirs:
        raise ConvertError(f"{dst} also holds {', '.join(theirs[:5])}{' ...' if len(theirs) > 5 else ''}, which no "
                           "conversion wrote: --force would delete it; move it out first")


def _not_the_converters(folder: Path) -> list[str]:
    """What in a model folder its manifest does not list (a user's notes, a saved prefix snapshot):
    names, sorted. A manifest that cannot be read, or lists no files (an older converter's, a damaged
    one, a user's own edgeinfer.json), lists nothing: then anything but the names some conversion
    writes (`CONVERTER_NAMES`) counts, and a sub-folder always does."""
    try:
        listed = json.loads((folder / MANIFEST_FILE).read_text()).get("files") or {}
    except (OSError, ValueError, AttributeError):
        listed = {}
    ours = (set(listed) if isinstance(listed, dict) and listed else set(CONVERTER_NAMES)) | {MANIFEST_FILE, STAMP_FILE}
    return sorted(p.name for p in folder.iterdir()  # one listing: a stamp's temporary file made after a separate
                  if p.name not in ours and not _stamp_temp(p.name)  # glob of them was a user's file (a load
                  and not _os_clutter(folder, p.name) or p.is_dir() and not p.is_symlink())  # then: a hostile round)


CONVERTER_NAMES = ("model.onnx", "model.onnx.data", "prefill.onnx", "embeddings.npy", "model.ort", "prefill.ort",
                   "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")  # every file any conversion writes


def _stamp_temp(name: str) -> bool:
    """The verification stamp's temporary files (integrity.py: mkstemp's 8 characters between
    `.edgeinfer-verified.json.` and `.tmp`), not a user's file that starts and ends alike."""
    if not (name.startswith(STAMP_FILE + ".") and name.endswith(".tmp")):
        return False
    middle = name[len(STAMP_FILE) + 1:-len(".tmp")]
    return len(middle) == 8 and all(c in "abcdefghijklmnopqrstuvwxyz0123456789_" for c in middle)


def _os_clutter(folder: Path, name: str) -> bool:
    """Files a desktop makes by itself in any folder it shows (Finder, Explorer): not the user's work.
    `._NAME` (macOS's AppleDouble) only beside a NAME it describes."""
    if name.startswith("._"):
        return (folder / name[2:]).exists()
    return name in (".DS_Store", "Thumbs.db", "desktop.ini")


def _os_error(e: OSError, dst: Path) -> ConvertError:
    """One line for an OSError met while converting (full disk, permission, read-only, not a folder)."""
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        left = [p.name for p in _orphans(dst, quiet_s=LEFT_QUIET_S)]  # (their space went unsaid)
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        return ConvertError(f"disk full while writing {dst.name}: nothing was written" + (
            f"; beside it, {', '.join(left[:3])}{more}, left by a conversion no longer running here and untouched "
            f"for a minute, hold{'s' if len(left) == 1 else ''} space: remove {'it' if len(left) == 1 else 'them'} "
            "unless another machine or container is converting into that folder" if left else ""))
    where = f": {e.filename}" if e.filename is not None else ""
    return ConvertError(f"cannot convert into {dst}: {e.strerror or e}{where}")


def temp_folder(dst: Path) -> tuple[Path, list[Path]]:
    """A new, empty folder next to `dst` for building it: `.DST.partial-PID-RANDOM`, unique to this
    call (two threads converting into one destination never share one), made with the permissions
    the umask gives a new folder (mkdtemp's are 0700: a daemon's own user could not read the
    result). dst's missing parents are made first; returns (the folder, the parents made), both for
    `discard`. Those that a conversion killed outright left behind are removed first: their process
    is gone and nothing in them changed for `ORPHAN_AGE_S` (a conversion on another host or in
    another container sharing the folder shows no process here)."""
    made = _make_parents(dst)
    try:
        _remove_orphans(dst)
        for _ in range(100):
            tmp = dst.parent / f"{_hidden(dst)}.partial-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                tmp.mkdir(0o777)  # the kernel applies the umask: no process-wide umask change (threads)
                return tmp, made
            except FileExistsError:
                continue
        raise ConvertError(f"cannot make a temporary folder beside {dst}")
    except BaseException:
        _remove_made(made)
        raise


def discard(tmp: Path, made: list[Path]) -> None:
    """Remove `temp_folder`'s folder (gone already once renamed into place) and, after a failure,
    the parents it made (after a success dst is in them, and they stay)."""
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_made(made)


ORPHAN_AGE_S = 3600
HIDDEN_NAME_BYTES = 100  # of dst's name in the hidden folders' names (255 bytes are legal, plus ".partial-PID-X" not)


def _hidden(dst: Path) -> str:
    """The start of the names of the hidden folders made beside `dst`: ".NAME", or for a name past
    HIDDEN_NAME_BYTES bytes its first bytes then "~" and a hash of the whole name (two long names that
    begin alike shared one prefix, and a stranded model of one was put back as the other; a review).
    A character cut at the limit, or a byte that is not UTF-8, is left out."""
    raw = os.fsencode(dst.name)
    if len(raw) <= HIDDEN_NAME_BYTES:
        return "." + raw.decode("utf-8", "ignore")
    return "." + raw[:HIDDEN_NAME_BYTES].decode("utf-8", "ignore") + "~" + hashlib.sha256(raw).hexdigest()[:12]


def _make_parents(dst: Path) -> list[Path]:
    """Make dst's missing parent folders; returns those made, outermost first, for `_remove_made`."""
    missing = []
    for parent in dst.parents:
        if parent.exists():
            break
        missing.append(parent)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except BaseException:  # made a/ and a/b/, then no room for a/b/c/: "nothing was written" left them
        _remove_made(missing[::-1])
        raise
    return missing[::-1]


def _remove_made(folders: list[Path]) -> None:
    """Remove the folders `_make_parents` made, innermost first, while they are empty (a failed
    conversion leaves no empty a/b/c behind; one another process filled meanwhile is kept)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except FileNotFoundError:  # never made (mkdir failed there) or removed already: its parents may be
            continue
        except OSError:
            return


def _remove_orphans(dst: Path) -> None:
    """Remove what conversions into `dst` that were killed outright left beside it: their `.partial-`
    folders, and `.old-` folders (a replaced model whose removal was cut short; one that DST lacks
    was put back by `_restore_stranded` first), once their process is gone and nothing in them
    changed for ORPHAN_AGE_S."""
    for p in _orphans(dst, quiet_s=ORPHAN_AGE_S):  # gone here; untouched for an hour: gone anywhere (a
        shutil.rmtree(p, ignore_errors=True)  # conversion on another host sharing the folder)


LEFT_QUIET_S = 60  # a folder named in a full disk's error was untouched this long (not a live conversion's)


def _newest_change(folder: Path) -> float:
    """The latest modification time of `folder` and the files in it (OSError if it cannot be read)."""
    return max([folder.stat().st_mtime] + [q.stat().st_mtime for q in folder.iterdir()])


def _orphans(dst: Path, quiet_s: float = 0) -> list[Path]:
    """The `.partial-` and `.old-` folders beside `dst` whose conversion's process is not running here
    and that nothing changed in for `quiet_s` (a conversion in another pid namespace looks gone here)."""
    found = []
    for kind in ("partial", "old"):
        prefix = f"{_hidden(dst)}.{kind}-"
        try:
            candidates = sorted(dst.parent.glob(glob.escape(prefix) + "*"))
        except OSError:
            continue
        for p in candidates:
            pid = _leftover_pid(p.name, prefix)
            if not (pid is not None and pid != os.getpid() and p.is_dir() and not p.is_symlink() and _gone(pid)):
                continue
            try:
                if time.time() - _newest_change(p) >= quiet_s:
                    found.append(p)
            except OSError:
                continue
    return found


def _leftover_pid(name: str, prefix: str) -> int | None:
    """The pid in the name of a hidden folder a conversion made beside DST (`prefix`: ".DST.partial-"
    or ".DST.old-", then PID-XXXXXXXX: ASCII digits that a pid can be on any host (`PID_CEILING`), no
    leading zero, and 8 lower-case hex digits), or None for any other name. A user's own folder that
    merely begins alike (a dated backup, ".model.old-20231105") is not taken for a leftover: the sweep
    deleted such folders, and a whole model among them was renamed into DST (a hostile round)."""
    pid, sep, token = name[len(prefix):].partition("-")
    if not (name.startswith(prefix) and sep and pid.isascii() and pid.isdigit() and pid[0] != "0"
            and len(token) == 8 and all(c in "0123456789abcdef" for c in token)):
        return None  # (isdigit alone took "²", then int() raised, and Arabic-Indic digits as a pid; a review)
    return int(pid) if int(pid) <= PID_CEILING else None


PID_CEILING = 1 << 22  # the largest pid_max Linux allows (macOS's pids stay under 100,000): a pid of any host
# that may share the folder, where this machine's own pid_max (32,768 here) would miss another host's leftovers


def _replace_atomically(tmp: Path, dst: Path, force: bool = True) -> None:
    """Rename the finished `tmp` to `dst`. Without `force`, a `dst` that appeared meanwhile (another
    conversion into it finished first) is left alone: ConvertError, and `tmp` is removed by the caller.
    Every file in `tmp` is on the disk before the rename, and the rename before this returns (fsync:
    a power cut leaves the old model or the new one, never a named folder of empty files)."""
    sync_tree(tmp)
    if force and dst.is_dir() and not dst.is_symlink():  # again: the check before the minutes of converting
        theirs = _not_the_converters(dst)  # could not see files written into DST meanwhile (a daemon's snapshot)
        if theirs:
            raise ConvertError(f"{dst} now also holds {', '.join(theirs[:5])}, written while converting, which no "
                               "conversion wrote: --force would delete it; move it out first")
    old = _rename_into_place(tmp, dst, force)
    sync_folder(dst.parent)
    if old is None:
        return
    if old.is_symlink():
        old.unlink()  # DST was a link to a model folder: the link is replaced, its target left alone
        return
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(old):  # (an unwritable old model: it was left, hidden, as large as the model, unsaid)
        try:
            shutil.rmtree(old)  # once more, for the reason
            return
        except OSError as e:
            reason = f"{e.strerror or e}: {e.filename}" if e.filename else str(e.strerror or e)
        warn_user(f"the model that {dst} held could not be removed ({reason}); it is left at {old}: "
                  "remove it by hand")


def _rename_into_place(tmp: Path, dst: Path, force: bool) -> Path | None:
    """Rename `tmp` to `dst`; returns the name the replaced `dst` was moved to (None: there was none)."""
    if not force:
        try:
            os.rename(tmp, dst)  # fails if dst exists and is not an empty folder: never replaces one
        except OSError as e:
            if os.path.lexists(dst) and e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise ConvertError(f"destination exists: {dst} (another conversion created it meanwhile; use "
                                   "--force to replace it)") from None
            raise
        return None
    if not os.path.lexists(dst):
        os.replace(tmp, dst)
        return None
    if _exchange(tmp, dst):  # one step: there is no moment without a model at dst
        return tmp
    # two steps: a process killed between them leaves the old model at `old`, which the next conversion
    # into dst puts back (`_restore_stranded`)
    old = dst.parent / f"{_hidden(dst)}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.replace(dst, old)
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.replace(old, dst)
        raise
    return old


RENAME_EXCHANGE = 2  # Linux renameat2's flag; macOS renamex_np's RENAME_SWAP has the same value
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`, macOS
    `renamex_np(RENAME_SWAP)`); False where the system or the file system cannot, and nothing changed."""
    if sys.platform == "win32":  # no such call (and ctypes.CDLL(None) is a TypeError there)
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform == "darwin":
            fn, args = libc.renamex_np, (os.fsencode(a), os.fsencode(b), RENAME_EXCHANGE)
        else:
            fn, args = libc.renameat2, (AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    except (OSError, AttributeError, TypeError):  # no such call in this C library (an older glibc, musl)
        return False
    if fn(*args) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the kernel or this file system has no exchange: two renames instead
    raise OSError(err, os.strerror(err), str(b))


def _restore_stranded(dst: Path, log) -> None:
    """Put back a model that a conversion killed between its two renames left as `.DST.old-PID-RANDOM`
    (only where `_exchange` is not available), when DST is missing and that process is gone."""
    if os.path.lexists(dst):
        return
    prefix = f"{_hidden(dst)}.old-"
    for p in sorted(dst.parent.glob(glob.escape(prefix) + "*")) if dst.parent.is_dir() else ():
        pid = _leftover_pid(p.name, prefix)
        if pid is None or pid == os.getpid() or not _gone(pid) or not _whole_model(p):
            continue  # (a model whose removal after a finished swap was cut short is half gone: not put back)
        try:
            os.rename(p, dst)
        except OSError:
            continue
        log(f"note: put back {dst}, which a conversion stopped half-way through replacing it had left as {p.name}")
        return


def _whole_model(folder: Path) -> bool:
    """Every file `folder`'s manifest lists is there, at its size (the old model a conversion moved
    aside, whole), not one whose removal had begun."""
    try:
        listed = json.loads((folder / MANIFEST_FILE).read_text()).get("files")
        return bool(listed) and isinstance(listed, dict) and all(
            (folder / name).is_file() and (folder / name).stat().st_size == entry.get("bytes")
            for name, entry in listed.items())
    except (OSError, ValueError, AttributeError):
        return False


def _gone(pid: int) -> bool:
    """Whether process `pid` is not running here. On Windows never said (os.kill(pid, 0) there is
    TerminateProcess: it would end whatever process has that number; a review)."""
    if sys.platform == "win32":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False

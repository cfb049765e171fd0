"""Getting written files onto the disk before a rename publishes them (fsync), so that a power cut
leaves the old version or the new one, never a renamed file or folder whose contents were still in
the page cache (an empty or partly written model on the next boot).

The order that makes a publish durable: `sync_file` (or `sync_tree`) the new data, rename it into
place, then `sync_folder` the folder that holds the name. Where a file system cannot fsync a folder
(some network and Windows file systems), that step is skipped: it is the best that system allows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def sync_file(path: Path) -> None:
    """fsync the regular file `path` (its data and size reach the disk). OSError if it cannot be opened
    or synced: a caller publishing it should fail rather than publish data that may not be there."""
    fd = os.open(path, os.O_RDWR if sys.platform == "win32" else os.O_RDONLY)  # Windows flushes only a
    # handle that may write (FlushFileBuffers); POSIX syncs any, and needs no write permission for it
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """fsync a folder (the names made, renamed or removed in it reach the disk); nothing where folders
    cannot be opened or synced so (Windows)."""
    if sys.platform == "win32":
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """`sync_file` every regular file under `folder` (links are not followed), then every folder in
    it, innermost first, and `folder` itself."""
    folders = []
    for root, dirs, files in os.walk(folder):
        folders.append(Path(root))
        for name in files:
            p = Path(root) / name
            if p.is_file() and not p.is_symlink():
                sync_file(p)
    for f in reversed(folders):
        sync_folder(f)

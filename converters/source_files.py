"""Reading a source folder's own files: regular files only, of bounded size, decoded and parsed
with one-line errors.

A model folder comes from elsewhere (a clone, a download, an archive), so a file in it may be a
link to /dev/zero (copied until the disk filled, or read until memory ran out), a FIFO (read for
ever), text that is not UTF-8, or JSON nested past Python's recursion limit. Each is a
ConvertError that names the file, raised before anything is read from it.
"""

from __future__ import annotations

from pathlib import Path

from edgeinfer import small_files
from edgeinfer.errors import ConvertError

MAX_TEXT_BYTES = small_files.MAX_TEXT_BYTES


def regular_file(path: Path) -> int:
    """The size of `path`, a regular file (a link to one is followed); ConvertError for a device, a
    FIFO, a folder or a file that cannot be read."""
    return small_files.regular_file(path, ConvertError)


def read_bytes(path: Path, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The whole of regular file `path`, refused past `limit` bytes (also if it grows meanwhile)."""
    return small_files.read_bytes(path, limit, ConvertError)


def read_text(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """Regular file `path` as UTF-8 text."""
    return small_files.read_text(path, limit, ConvertError)


def parse_json(text: str | bytes, where: Path | str) -> object:
    """JSON `text` (from `where`, named in the error); nesting past the recursion limit is an error too."""
    return small_files.parse_json(text, where, ConvertError)


def read_json(path: Path, limit: int = MAX_TEXT_BYTES) -> object:
    return parse_json(read_text(path, limit), path)

"""Reading a source folder's own files: regular files only, of bounded size, decoded and parsed
with one-line errors.

A model folder comes from elsewhere (a clone, a download, an archive), so a file in it may be a
link to /dev/zero (copied until the disk filled, or read until memory ran out), a FIFO (read for
ever), text that is not UTF-8, or JSON nested past Python's recursion limit. Each is a
ConvertError that names the file, raised before anything is read from it.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from edgeinfer.errors import ConvertError

MAX_TEXT_BYTES = 256 * 1024 * 1024  # settings and tokenizer files: the largest tokenizer.json is ~20 MB


def regular_file(path: Path) -> int:
    """The size of `path`, a regular file (a link to one is followed); ConvertError for a device, a
    FIFO, a folder or a file that cannot be read."""
    try:
        st = path.stat()
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConvertError(f"{path} is not a regular file (a device, FIFO or folder, or a link to one): not read")
    return st.st_size


def read_bytes(path: Path, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The whole of regular file `path`, refused past `limit` bytes (also if it grows meanwhile)."""
    size = regular_file(path)
    if size > limit:
        raise ConvertError(f"{path} is {size} bytes: a settings or tokenizer file of at most {limit} bytes is read")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConvertError(f"{path} grew past {limit} bytes while it was read")
    return data


def read_text(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """Regular file `path` as UTF-8 text."""
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConvertError(f"{path} is not UTF-8 text (byte {e.start})") from None


def parse_json(text: str | bytes, where: Path | str) -> object:
    """JSON `text` (from `where`, named in the error); nesting past the recursion limit is an error too."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConvertError(f"{where} is not valid JSON: {str(e)[:200] or type(e).__name__}") from None


def read_json(path: Path, limit: int = MAX_TEXT_BYTES) -> object:
    return parse_json(read_text(path, limit), path)

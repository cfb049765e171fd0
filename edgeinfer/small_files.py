"""Reading small files that come from elsewhere (a model folder, a source folder): regular files
only, of bounded size, parsed with one-line errors.

A file in such a folder may be a link to /dev/zero (read until memory runs out), a FIFO (read for
ever), text that is not UTF-8, or JSON or TOML nested past Python's recursion limit. Each is an error of the
caller's type (`ModelFormatError` for the runtime, `ConvertError` for the converter) that names
the file, raised before anything is read from it.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (JetPack 6): the same parser, from PyPI
    import tomli as tomllib

MAX_TEXT_BYTES = 256 * 1024 * 1024  # settings, tokenizer and eval text files: the largest tokenizer.json is
# ~20 MB, and a few MB of eval text is hours of scoring on a device
MAX_RECORDED_BYTES = 16 * 1024 * 1024  # a recorded device folder's files (commands.json, env.json, ...): the
# recorded outputs of a few commands, kilobytes


def regular_file(path: Path, error: type[Exception]) -> int:
    """The size of `path`, a regular file (a link to one is followed); `error` for a device, a FIFO,
    a folder or a file that cannot be read."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is not a regular file (a device, FIFO or folder, or a link to one): not read")
    return st.st_size


def read_bytes(path: Path, limit: int, error: type[Exception]) -> bytes:
    """The whole of regular file `path`, refused past `limit` bytes (also if it grows meanwhile)."""
    size = regular_file(path, error)
    if size > limit:
        raise error(f"{path} is {size} bytes: a file of at most {limit} bytes is read here")
    parts, total = [], 0
    try:
        with open(path, "rb") as f:  # read as the file is, not `limit` at once: read(n) reserves n bytes
            while total <= limit and (part := f.read(min(limit + 1 - total, 1 << 16 if parts else size + 1))):
                parts.append(part)  # (256 MiB for a 19 KB tokenizer.json, a MemoryError under a memory limit)
                total += len(part)
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    data = b"".join(parts)
    if len(data) > limit:
        raise error(f"{path} grew past {limit} bytes while it was read")
    return data


def read_text(path: Path, limit: int, error: type[Exception]) -> str:
    """Regular file `path` as UTF-8 text."""
    data = read_bytes(path, limit, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text (byte {e.start})") from None


def parse_json(text: str | bytes, where: Path | str, error: type[Exception]) -> object:
    """JSON `text` (from `where`, named in the error); nesting past the recursion limit is an error too."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{where} is not valid JSON: {str(e)[:200] or type(e).__name__}") from None


def read_toml(path: Path, limit: int, error: type[Exception]) -> dict:
    """Regular file `path` (at most `limit` bytes) as TOML; nesting past the recursion limit is an
    error too (tomllib raised RecursionError on 600 nested arrays)."""
    text = read_text(path, limit, error)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path} is not valid TOML: {str(e)[:200]}") from None
    except RecursionError:
        raise error(f"{path} is nested too deeply to read as TOML") from None

"""A GGUF file's header (metadata and tensor table) read in one pass, without touching the tensors.

Why not `gguf.GGUFReader`: it keeps every metadata value as numpy views over a memory map, one set
per array item, so a 49,152-token vocabulary with its merges costs ~170 MB of Python objects (more
than the 98 MB file it describes; peak RSS is the converter's budget). This reader follows the
format the `gguf` package writes (GGUF versions 2 and 3, little-endian):

    magic "GGUF", u32 version, u64 tensor count, u64 metadata count
    metadata: string key, u32 value type, value (an array: u32 item type, u64 count, items)
    tensors:  string name, u32 n_dims, u64 dims[n_dims] (row length first), u32 type, u64 offset
    data:     from the header's end rounded up to `general.alignment` (32), plus each offset

Strings are a u64 length and UTF-8 bytes. Every count and length is checked against the file size
before anything is allocated for it, so a damaged header raises `HeaderError`, never MemoryError;
and the counts of tensors, metadata entries and strings in an array are bounded far above any real
model's (`MAX_*`), since a Python object per entry costs ~10x its bytes in the file (a hostile file of
3 million tiny tensor entries, 114 MB, took 1.1 GB and 36 s before its first entry was refused).
Type numbers are the `gguf` package's (`GGMLQuantizationType`, `GGML_QUANT_SIZES`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# value type -> (struct format, numpy dtype); 8 = string, 9 = array
SCALARS = {0: ("<B", "u1"), 1: ("<b", "i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
           6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8")}
STRING, ARRAY = 8, 9
MAX_TENSORS = 1 << 16  # real models: a few hundred to a few thousand
MAX_METADATA = 1 << 16  # real models: a few dozen entries (the vocabulary is one array)
MAX_ARRAY_STRINGS = 1 << 21  # in all arrays: the largest vocabularies are 262,144 tokens; merges up to about a
# million


class HeaderError(ValueError):
    """The header is truncated or malformed; the message says where."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]  # as GGUF lists them: row length (ne0) first
    type_id: int  # GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file


class _Reader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size
        self.strings = 0  # in string arrays so far

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise HeaderError(f"{what} runs past the end of the file (truncated)")
        return self.f.read(n)

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.unpack("<Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HeaderError(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str):
        if vtype in SCALARS:
            return self.unpack(SCALARS[vtype][0], what)
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            raise HeaderError(f"{what} has unknown value type {vtype}")
        item, count = self.unpack("<I", what), self.unpack("<Q", what)
        if item in SCALARS:  # a numpy array (a list of Python numbers would cost ~30x the bytes)
            dtype = np.dtype(SCALARS[item][1])
            return np.frombuffer(self.take(count * dtype.itemsize, what), dtype)
        if item == STRING:
            if count * 8 > self.size:
                raise HeaderError(f"{what} claims {count} strings (truncated or corrupted)")
            if count > MAX_ARRAY_STRINGS:
                raise HeaderError(f"{what} holds {count} strings, more than the {MAX_ARRAY_STRINGS} read")
            self.strings += count  # ~60 bytes of Python each: unused arrays of one-letter strings took 9x the file
            if self.strings > MAX_ARRAY_STRINGS:
                raise HeaderError(f"the metadata holds more than {MAX_ARRAY_STRINGS} strings in arrays, more "
                                  "than any model's vocabulary and merges together")
            return [self.string(what) for _ in range(count)]
        raise HeaderError(f"{what} is an array of unsupported type {item}")


def read_header(path: Path) -> tuple[dict, list[TensorEntry]]:
    """(metadata {key: value}, tensor table) of a GGUF file. HeaderError when it is not one we read.
    Values: Python numbers, bools and strings; numeric arrays as read-only numpy arrays, string
    arrays as lists."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size)
        if r.take(4, "the magic") != MAGIC:
            raise HeaderError("no GGUF magic at the start")
        version = r.unpack("<I", "the version")
        if version not in VERSIONS:
            swapped = " (a big-endian file)" if version & 0xFFFF == 0 else ""
            raise HeaderError(f"GGUF version {version}{swapped} is not supported (versions 2 and 3 are)")
        n_tensors, n_kv = r.unpack("<Q", "the tensor count"), r.unpack("<Q", "the metadata count")
        if n_tensors > size or n_kv > size:
            raise HeaderError(f"counts of {n_tensors} tensors and {n_kv} metadata entries cannot fit the file")
        if n_tensors > MAX_TENSORS or n_kv > MAX_METADATA:
            raise HeaderError(f"{n_tensors} tensors and {n_kv} metadata entries: more than the {MAX_TENSORS} and "
                              f"{MAX_METADATA} read (no model has so many)")
        meta = {}
        for _ in range(n_kv):
            key = r.string("a metadata key")
            if key in meta:  # which one is meant? (llama.cpp refuses such a file too)
                raise HeaderError(f"metadata key {key!r:.80} appears twice")
            meta[key] = r.value(r.unpack("<I", f"metadata {key!r:.80}"), f"metadata {key!r:.80}")
        entries = []
        for _ in range(n_tensors):
            name = r.string("a tensor name")
            n_dims = r.unpack("<I", f"tensor {name!r:.80}")
            if n_dims > 8:
                raise HeaderError(f"tensor {name!r:.80} has {n_dims} dimensions")
            dims = tuple(r.unpack("<Q", f"tensor {name!r:.80}") for _ in range(n_dims))
            entries.append((name, dims, r.unpack("<I", f"tensor {name!r:.80}"), r.unpack("<Q", f"tensor {name!r:.80}")))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise HeaderError(f"general.alignment {align!r:.40} is not a power of two")
        start = -(-f.tell() // align) * align
    return meta, [TensorEntry(n, d, t, start + o) for n, d, t, o in entries]

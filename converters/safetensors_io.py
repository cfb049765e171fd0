"""Streaming, validating reader for (sharded) safetensors checkpoints.

Why not `safetensors.numpy`: it cannot return bfloat16 as numpy, and it memory-maps whole
files (mapped pages count in the convert process's RSS). This reader parses the documented
format (u64 little-endian header length, JSON header, raw little-endian data), validates
every offset against the file size up front, and reads one tensor at a time with a plain
`read` into a fresh array, so the converter holds one source tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from edgeinfer.converters.source_files import read_json, regular_file
from edgeinfer.errors import ConvertError

# safetensors dtype tag -> numpy dtype (little-endian).
DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    size = regular_file(path)  # a FIFO would be read for ever
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConvertError(f"{path.name}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ConvertError(f"{path.name}: corrupted safetensors header (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_no_repeated_keys)
        except _RepeatedKey as e:  # Python's JSON keeps the last: the first entry's bytes went unread, silently
            raise ConvertError(f"{path.name}: corrupted safetensors header: {e.args[0]!r} is named twice") from None
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past the recursion limit
            raise ConvertError(f"{path.name}: corrupted safetensors header ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path.name}: corrupted safetensors header (not an object)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path.name}: corrupted safetensors entry for {name!r}") from None
        if not all(type(v) is int and v >= 0 for v in (*shape, begin, end)):
            raise ConvertError(f"{path.name}: corrupted safetensors entry for {name!r} (its shape and offsets must be "
                               f"integers >= 0, got {list(shape)} and {[begin, end]})")
        if not isinstance(tag, str) or tag not in DTYPES:
            raise ConvertError(f"{path.name}: tensor {name!r} has unsupported dtype {tag}")
        expected = math.prod(shape) * DTYPES[tag].itemsize  # exact (numpy's int64 overflowed at 2**63)
        if end - begin != expected or begin < 0:
            raise ConvertError(f"{path.name}: tensor {name!r} offsets do not match its shape {list(shape)}")
        if base + end > size:
            raise ConvertError(
                f"{path.name}: truncated safetensors file: tensor {name!r} ends at byte {base + end}, file has {size}"
            )
        out[name] = TensorInfo(name, path, tag, shape, base + begin, expected)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in out.values() if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:  # the format's rule; two weights read from the same bytes make a wrong model
            raise ConvertError(f"{path.name}: corrupted safetensors header: tensors {a!r} and {b!r} overlap")
    # the format's other rule: the data is indexed whole, no holes (a second copy of a weight hides in one)
    ends = [base] + [end for _, end, _ in spans]
    for (begin, _, name), end in zip(spans, ends):
        if begin != end:
            raise ConvertError(f"{path.name}: corrupted safetensors file: bytes {end}-{begin} before tensor {name!r} "
                               "belong to no tensor (the format indexes every byte of its data)")
    if ends[-1] != size:
        raise ConvertError(f"{path.name}: corrupted safetensors file: its last {size - ends[-1]} bytes belong to no "
                           "tensor (the format indexes every byte of its data)")
    return out


class _RepeatedKey(ValueError):
    pass


def _no_repeated_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, or _RepeatedKey naming the first key given twice."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise _RepeatedKey(k)
        d[k] = v
    return d


def _weight_map(index: Path) -> dict[str, str]:
    """An index's {tensor name: shard file name}; every shard a plain file name in the index's folder
    (a path such as ../x or /abs would read weights from outside the model folder)."""
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ConvertError(f"{index.name}: not a valid safetensors index (weight_map must map tensor names to "
                           "shard file names)")
    for shard in set(weight_map.values()):
        if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
            raise ConvertError(f"{index.name}: shard {shard!r} is not a file name in the model folder")
    return weight_map


def onnx_export_hint(folder: Path) -> str:
    """Said of a folder without weights that holds an ONNX graph (a hostile round: an Optimum export given
    as the source was told only that no weights were there)."""
    if (folder / "model.onnx").exists() or (folder / "decoder_model.onnx").exists():
        return (": it holds an ONNX graph (an export such as optimum-cli's), which convert does not take: "
                "give the Hugging Face model folder it was exported from")
    return ""


def no_weights_hint(folder: Path) -> str:
    """What a folder without the safetensors the native builder reads holds instead, if it says what to do."""
    hint = onnx_export_hint(folder)
    if hint or not any(folder.glob("pytorch_model*.bin")):
        return hint
    return (": its weights are PyTorch .bin files, which the native builder does not read (--via optimum "
            "reads them, with torch: pip install 'edgeinfer[optimum]')")


class Checkpoint:
    """All tensors of a model folder's safetensors files, indexed by name; read one at a time. The files
    are those transformers' `from_pretrained` reads: model.safetensors where there is one (beside an
    index too: the index's shards were read, a different model, silently), else the shards of
    model.safetensors.index.json, else (neither) every *.safetensors file in the folder."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        weight_map = None
        if (folder / "model.safetensors").exists():
            files = [folder / "model.safetensors"]
        elif index.exists():
            weight_map = _weight_map(index)
            files = sorted({folder / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise ConvertError(f"missing shard(s) listed in {index.name}: {', '.join(missing)}")
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ConvertError(f"no *.safetensors file in {folder}{no_weights_hint(folder)}")
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        where: dict[str, str] = {}
        for f in files:
            for name, info in _read_header(f).items():
                if name in self.tensors:  # which of the two is the model's? Not ours to guess
                    raise ConvertError(f"tensor {name!r} is in both {where[name]} and {f.name}")
                self.tensors[name], where[name] = info, f.name
        # the index only names the shards, as transformers and llama.cpp read it: an entry for a tensor
        # the shards lack (a stale one, on the Hub) matters only if that tensor is needed (`info`)
        self.listed = weight_map or {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            shard = self.listed.get(name)
            raise ConvertError(f"tensor {name!r} is missing from the checkpoint"
                               + (f" (model.safetensors.index.json lists it in {shard}, which lacks it)" if shard
                                  else "")) from None

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Read one tensor as float32 (floating tags) in a new array; check `shape` if given."""
        t = self._float_info(name, shape)
        return self._read(t, name, t.offset, t.nbytes, t.shape)

    def read_rows(self, name: str, start: int, stop: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Rows start..stop-1 of a 2-D tensor as float32 in a new array (a large embedding a slice at a time)."""
        t = self._float_info(name, shape)
        rows, cols = t.shape
        start, stop = max(0, min(start, rows)), max(0, min(stop, rows))
        stop = max(start, stop)
        row_bytes = cols * DTYPES[t.dtype].itemsize
        return self._read(t, name, t.offset + start * row_bytes, (stop - start) * row_bytes, (stop - start, cols))

    def _float_info(self, name: str, shape: tuple[int, ...] | None) -> TensorInfo:
        t = self.info(name)
        if shape is not None and tuple(shape) != t.shape:
            raise ConvertError(f"tensor {name!r} has shape {list(t.shape)}, config implies {list(shape)}")
        if t.dtype not in ("F32", "F16", "BF16", "F64"):
            raise ConvertError(f"tensor {name!r} has dtype {t.dtype}; weights must be F32, F16 or BF16")
        return t

    @staticmethod
    def _read(t: TensorInfo, name: str, offset: int, nbytes: int, shape: tuple[int, ...]) -> np.ndarray:
        buf = bytearray(nbytes)
        with open(t.file, "rb") as f:
            f.seek(offset)
            got = f.readinto(buf)
        if got != nbytes:
            raise ConvertError(f"{t.file.name}: truncated while reading {name!r}")
        arr = np.frombuffer(buf, dtype=DTYPES[t.dtype]).reshape(shape)
        return arr if t.dtype == "F32" else arr.astype(np.float32)

    def total_bytes(self) -> int:
        return sum(os.path.getsize(f) for f in self.files)

"""The automatic prefix cache: a prompt that starts with what a KV ring already holds prefills only the rest.

As llama.cpp's `cache_prompt`: a context (the Model's default one, a daemon slot) remembers the token
ids its ring holds in order (`held_after`, None when not known exactly: the ring evicted or re-based,
the overflow policy dropped prompt tokens, a mutation was cut short); the next request keeps the
longest common prefix (`reuse`) and feeds only its tail. On fp32 models a reused prompt's rows are
bit-identical to a cold start's (every split measured), but a reply's rows came from one-row decode
steps, whose float rounding differs from a prefill's (~1e-6 in the logits: a hostile round forced a
near-tie with logit_bias, and 15 of 61 biases near it flipped the next token). At accuracy level 4 (int8 activations) a row's rounding depends on the call that computed it: a reply's
rows came from one-row decode steps, and even calls of several rows can round a row differently
depending on how they are split (measured: one row of 366 differed by 8e-6 in its logits between a
prefill split at 204 and one at 256). A reused prefix's reply then equals a cold start's but for a
near-tie, which may resolve the other way (as llama.cpp says of its `cache_prompt`): reusing a reply,
7 of 10 follow-ups on the bundled int8 model differed from a cold start somewhere in 100 greedy
tokens. Keeping only the prompt's rows made that rarer but not never, at the cost of prefilling
every reply again, so the whole held prefix is reused.

`PrefixSnapshot` is a warmed prefix (a system prompt's rows) taken out of a ring, to put back later
(`Model.snapshot` / `Model.restore`), also across processes through a file (`save` / `load`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import secrets
import stat
import time
import tokenize
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer import small_files
from edgeinfer.durable import sync_folder
from edgeinfer.errors import InvalidArgumentError, InvalidArgumentTypeError
from edgeinfer.kv_cache import RingKVCache, Snapshot
from edgeinfer.overflow import fits_beside

SNAPSHOT_FORMAT = 1
STALE_PARTIAL_S = 600  # a destination's temporary file this old is a killed writer's (`save` sweeps them)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def keepable(held: list[int] | None, prompt: list[int], capacity: int, overflow: str, max_new_tokens: int) -> int:
    """How many of `prompt`'s first tokens a ring of `capacity` holding `held` (its ids, or None) can
    keep by `reuse`'s rules (its doc), without touching the ring."""
    n = min(common_prefix(held, prompt), len(prompt) - 2) if held else 0
    if n > 0 and (len(prompt) > capacity or not fits_beside(n, len(prompt) - n, capacity, overflow, max_new_tokens)):
        return 0
    return max(n, 0)


def reuse(held: list[int] | None, prompt: list[int], cache: RingKVCache, overflow: str, max_new_tokens: int) -> int:
    """Keep in `cache` the longest prefix of `prompt` it holds (`held`: its ids, or None) and return its
    length; 0 with the cache reset when nothing can be kept. At least two prompt tokens are always
    fed: a one-row call takes MatMulNBits' single-row path, whose int8 activations give other logits
    (chunked.prefill_chunks), and the reply would depend on the reuse. A prompt longer than the ring
    is fed whole: the ring shifts inside the prefill, and which tokens a chunk sees then depends on
    where the chunks start. Under overflow="truncate", a prompt that would not fit beside the kept
    prefix is fed whole, so that truncation sees it all."""
    n = keepable(held, prompt, cache.capacity, overflow, max_new_tokens)
    if n <= 0 or not cache.keep_prefix(n):
        cache.reset()
        return 0
    return n


def held_after(gen, prompt: list[int], cache: RingKVCache) -> list[int] | None:
    """The ids `cache` holds after Generation `gen` ran on `prompt` (from an empty ring or a kept
    prefix of it), when known exactly; else None (also after a failure: its rows may be what failed,
    e.g. non-finite logits from a restored snapshot's rows, and must not be reused)."""
    if cache.dropped or cache.rebased_tokens or not cache.intact or gen.prompt_dropped or gen.failed:
        return None
    if gen.completion is None:  # abandoned: the prompt, and some generated tokens not known here
        return prompt[:cache.n_valid]
    return (prompt + list(gen.completion.token_ids))[:cache.n_valid]


def destination(path) -> tuple[Path, Path]:
    """`path` checked as a snapshot's destination before anything is done for it: (the path given, the
    file to write there: a link's target). InvalidArgumentTypeError unless a str or a path;
    InvalidArgumentError for a name that ends in a folder ("x.npz/" and "x.npz/." were written as
    the file x.npz), a folder or another non-regular file there (it is not replaced), a folder that
    does not exist or where no file can be made (`save` writes a temporary file there: one is made
    and removed here; a read-only mount, /proc), or a name the system refuses (a NUL)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):  # (bytes: a TypeError)
        raise InvalidArgumentTypeError(f"path must be a str or a path, got {type(path).__name__}")
    name = os.fspath(path)
    if os.path.basename(name) in ("", ".", "..") or (os.altsep and name.endswith(os.altsep)):
        raise InvalidArgumentError(f"{name!r} names a folder: give the snapshot a file name")
    given = target = Path(path)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.lstat(name)  # (pathlib's tests take a NUL in the name for "no such file")
        if target.is_symlink():
            target = target.resolve()
        if target.exists() and not target.is_file():
            raise InvalidArgumentError(f"{name!r} is {'a folder' if target.is_dir() else 'not a regular file'}: give "
                                       "the snapshot a file name (it is not replaced)")
        if not os.path.isdir(target.parent):
            raise InvalidArgumentError(f"cannot write the snapshot to {name!r}: its folder does not exist")
        probe = _temporary(target)  # (a killed process leaves it to `save`'s sweep)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        probe.unlink()
    except (OSError, ValueError, RuntimeError) as e:  # ValueError: a NUL in the name; RuntimeError: a link loop
        if isinstance(e, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"cannot write the snapshot to {name!r}: {getattr(e, 'strerror', None) or e}") \
            from None
    return given, target


def _stem(target: Path) -> str:
    """The start of the temporary files' names for the destination `target` (`_sweep_stale`'s pattern)."""
    return f".edgeinfer-snapshot-{hashlib.sha256(os.fsencode(target.name)).hexdigest()[:12]}"


def _temporary(target: Path) -> Path:
    """A new temporary file's name beside `target`: each writer has its own."""
    return target.parent / f"{_stem(target)}.{secrets.token_hex(8)}.partial"


@dataclass(frozen=True)
class PrefixSnapshot:
    """A ring's first `len(token_ids)` rows and their ids; `model` names the weights they came from
    (the sha256 of the model's graph and weights, from its manifest)."""

    token_ids: tuple[int, ...]
    kv: Snapshot
    model: str

    def save(self, path: str | Path) -> None:
        """Write to `path` (a .npz file; written whole to a new temporary file beside it, then renamed:
        a failed or interrupted write leaves neither; each writer has its own temporary file, so
        writers of one path at once each rename a whole file). The file is on the disk before the
        rename and the rename before `save` returns (fsync: a power cut leaves the old file or the new
        one). A process killed while writing (SIGKILL, a power cut) leaves its temporary file: the next
        save to the same destination removes those older than STALE_PARTIAL_S. A link is written
        through to its target; a destination that exists and is not a regular file (a device, a FIFO,
        a folder) is refused, not replaced. InvalidArgumentError when it cannot be written there."""
        given, path = destination(path)
        kv = self.kv
        meta = {"format": SNAPSHOT_FORMAT, "model": self.model, "token_ids": list(self.token_ids),
                "n_valid": kv.n_valid, "next_slot": kv.next_slot, "next_position": kv.next_position}
        arrays = {f"k{i}": k for i, k in enumerate(kv.k)} | {f"v{i}": v for i, v in enumerate(kv.v)}
        tmp = None
        try:
            tmp = _temporary(path)  # this destination's, a new file of its own:
            try:  # the file replaced keeps its mode (a 0600 one became the umask's 0644: its prompt readable by all)
                mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else None
            except OSError:
                mode = None
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)  # a name
            with os.fdopen(fd, "wb") as f:  # planted there is not followed; a new file's mode is the umask's
                if mode is not None and hasattr(os, "fchmod"):
                    os.fchmod(f.fileno(), mode)
                np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), positions=kv.positions, **arrays)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
            tmp = None
            sync_folder(path.parent)
            _sweep_stale(path.parent, _stem(path))
        except (OSError, ValueError, RuntimeError) as e:  # ValueError: a NUL or a lone surrogate in the name
            if isinstance(e, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"cannot write the snapshot to {str(given)!r}: "
                                       f"{getattr(e, 'strerror', None) or e}") from None
        finally:  # also after Ctrl-C
            if tmp is not None:
                try:
                    tmp.unlink(missing_ok=True)
                except (OSError, ValueError):
                    pass

    @classmethod
    def load(cls, path: str | Path, layers: int | None = None, row: tuple[int, int] | None = None,
             max_rows: int | None = None) -> "PrefixSnapshot":
        """Read a file `save` wrote; InvalidArgumentError for anything else. With the model's
        geometry (`layers`, a row's (kv heads, head size) and the ring's rows), every array's header
        is checked before any data is read: a small file that unpacks into gigabytes is refused
        unread."""
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):  # (bytes was "not a
            raise InvalidArgumentTypeError(f"path must be a str or a path, got {type(path).__name__}")  # snapshot")
        try:
            small_files.regular_file(Path(path), InvalidArgumentError)  # a FIFO would block for ever
            with open(path, "rb") as f:  # numpy takes another file for a pickle and says to load it unsafely
                if f.read(4) != b"PK\x03\x04":
                    raise ValueError("not a .npz archive")
            with np.load(Path(path), allow_pickle=False) as z:
                names = set(z.files)
                n_layers = sum(1 for name in names if name.startswith("k"))
                other = (f"{path} is a snapshot of another model: restore it into the model it was taken from "
                         "(Model.snapshot)")
                if layers is not None and n_layers != layers and names == _array_names(n_layers):
                    raise InvalidArgumentError(f"{other}; it holds {n_layers} layers, this model {layers}")
                if layers is not None and names != _array_names(layers):
                    raise ValueError(f"it holds {n_layers} layers, the model {layers}")
                if row is not None:
                    most = max_rows if max_rows is not None else 1 << 31
                    sizes = {"meta": (1 << 20) + 24 * most, "positions": 8 * most} | \
                        {name: most * row[0] * row[1] * 4 for name in names - {"meta", "positions"}}
                    for name in sorted(names - {"meta", "positions"}):
                        shape = _header_shape(z, name)
                        if len(shape) == 3 and tuple(shape[1:]) != tuple(row):
                            raise InvalidArgumentError(f"{other}; its rows are {tuple(shape[1:])} (KV heads, head "
                                                       f"size), this model's {tuple(row)}")
                        if len(shape) == 3 and shape[0] > most and max_rows is not None:  # a good file, a smaller
                            raise InvalidArgumentError(  # ring: say so (it read as "cannot read": an app deletes such)
                                f"{path} holds a prefix of {shape[0]} tokens, which does not fit this model's ring of "
                                f"{most}: load the model with capacity_tokens of at least {shape[0]}")
                        if len(shape) != 3 or shape[0] > most:
                            raise ValueError(f"its array {name} is {shape}, not up to {most} rows of {tuple(row)}")
                    for info in z.zip.infolist():  # what each member unpacks to, bounded before anything is read
                        name = info.filename.removesuffix(".npy")
                        if name not in sizes or info.file_size > sizes[name] + 4096:
                            raise ValueError(f"its member {info.filename[:60]!r} is {info.file_size} bytes unpacked")
                    if len(_header_shape(z, "positions")) != 1 or _header_shape(z, "positions")[0] > most or \
                            _header_shape(z, "meta")[0] > (1 << 20) + 24 * most:  # JSON: a few bytes per token id
                        raise ValueError("its positions or metadata are larger than the ring")
                raw = z["meta"]
                if raw.dtype != np.uint8 or raw.ndim != 1:
                    raise ValueError("its metadata is not JSON text")
                meta = json.loads(raw.tobytes())
                k = tuple(z[f"k{i}"] for i in range(n_layers))
                v = tuple(z[f"v{i}"] for i in range(n_layers))
                positions = z["positions"]
            if not isinstance(meta, dict) or meta.get("format") != SNAPSHOT_FORMAT or type(meta.get("format")) is not int:
                raise ValueError(f"format {meta.get('format') if isinstance(meta, dict) else meta!r}")
            ids, n = meta.get("token_ids"), meta.get("n_valid")
            fields = (n, meta.get("next_slot"), meta.get("next_position"))
            if not isinstance(ids, list) or any(type(t) is not int for t in ids) or any(type(f) is not int for f in fields) \
                    or not isinstance(meta.get("model"), str):
                raise ValueError("its metadata has fields of the wrong types")
            ids = tuple(ids)
            if len(ids) != n or positions.shape != (n,) or any(a.ndim != 3 or a.shape[0] != n for a in k + v):
                raise ValueError("its sizes disagree")
            # a prefix: slot i holds token i at position i (Model.snapshot takes nothing else)
            if meta["next_position"] != n or not np.array_equal(positions, np.arange(n)):
                raise ValueError("its positions are not a prefix's")
            kv = Snapshot(k, v, positions, n, meta["next_slot"], n, 0, 0)
            return cls(ids, kv, meta["model"])
        except InvalidArgumentError:
            raise
        except (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, zipfile.BadZipFile, RuntimeError,
                NotImplementedError, OverflowError, MemoryError, zlib.error, lzma.LZMAError, SyntaxError,
                tokenize.TokenError) as e:  # zipfile's own for a flipped flag or method, a broken deflate or LZMA
            # stream; numpy's .npy header parser (Python's tokenizer, then literal_eval) for a flipped byte there
            raise InvalidArgumentError(f"{path} is not a prefix snapshot edgeinfer can read "
                                       f"({type(e).__name__}: {str(e)[:200]})") from None


def _sweep_stale(folder: Path, stem: str) -> None:
    """Remove this destination's temporary files (`stem`.*.partial) older than STALE_PARTIAL_S: left by
    writers killed mid-write (a younger one may be another writer's, still at work)."""
    now = time.time()
    try:
        for p in folder.glob(f"{stem}.*.partial"):
            try:
                if now - p.lstat().st_mtime > STALE_PARTIAL_S and p.is_file() and not p.is_symlink():
                    p.unlink()
            except OSError:
                pass
    except OSError:
        pass


def _array_names(layers: int) -> set[str]:
    return {"meta", "positions"} | {f"k{i}" for i in range(layers)} | {f"v{i}" for i in range(layers)}


def _header_shape(z, name: str) -> tuple[int, ...]:
    """The shape an .npz member's header declares, read without its data."""
    with z.zip.open(name + ".npy") as f:
        version = np.lib.format.read_magic(f)
        shape, _, _ = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                       else np.lib.format.read_array_header_2_0(f))
    return shape

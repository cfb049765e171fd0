"""The ring-buffer KV cache: allocated once, constant memory however long generation runs.

Per layer: K and V arrays of C + S_max rows ("slots"), float32, where C = capacity_tokens and
S_max = the largest chunk one graph call may append (the overflow rows), shaped as the graph's KV
mode binds them (`KVMode.cache_shape`: slots second for standard ops, third for GroupQueryAttention).
The bookkeeping works on one layout whatever the mode: `ks`/`vs` are slot-major views [C + S_max,
Hkv, Dh] of the same memory (`KVMode.slot_major`; a transposed view where the slots are not the
outer axis), so moving, copying and rotating slots has no per-mode branch and nothing is copied.

    slots [0, n_sink)        attention sinks: the first tokens, never overwritten
    slots [n_sink, C)        the ring: once full, each new token overwrites the oldest
    rows  [C, C + S_max)     overflow: where a call writes its new rows when the ring is full

A graph call reads slots [0, n_valid) and writes its S new rows (already rotated by RoPE, so slot
order does not matter to attention) at rows [n_valid, n_valid + S). Rows that land at or past C
(the ring was full, or filled up during the call) are moved by `commit` into the ring slots they
replace, oldest first, never the sinks.

Positions do not drift (StreamingLLM's rule): the sinks keep positions 0..n_sink-1 and the ring's
tokens keep consecutive positions that start just past the sinks, so no distance the model sees
exceeds about the cache's span, however long generation runs. Keys are cached already rotated by
RoPE, and RoPE is a rotation, so moving every ring token d positions back is one rotation of its
cached key by -d (values do not change). `rebase_if_due` does that when the next call would pass
capacity + `rebase_every_tokens`, moving the oldest ring token to position n_sink: an O(C) pass over
the keys once every `rebase_every_tokens` tokens, nothing per token.

The model's trained length T (max_position_embeddings) bounds it all: no call writes a position at
or past T, and no query attends over more than T tokens (so no distance it sees is one the model
never trained on; past T a model's output degrades, and far past it turns to word salad). Hence:
capacity + `rebase_every_tokens` <= T (`rebase_interval`), and a call appends at most `call_room()`
= T - n_valid rows (a long prompt entering a full ring goes in smaller calls). A ring holds at most
T tokens (`check_geometry`); the default, `max_capacity(T)` = T - T/16, re-bases every T/16 tokens
once full. A larger one re-bases more often (every T - C tokens; `load` warns), and one of exactly T
re-bases every token and its steps write position T, the least a full ring of T tokens plus the new
token needs.

Owned by one conversation; mutated only by `rebase_if_due`, `commit`, `rewind`, `keep_prefix`,
`reset`, `forget` (a reset or a `keep_prefix`) and `unforget` (its undo, while no row has been written
since: `writes` counts every call that writes rows), `restore` and `commit_memory`. `intact` is
False while (or if an exception such as Ctrl-C stopped) `rebase_if_due` or `commit` is half done:
such a cache must be reset before use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import psutil

from edgeinfer.arch import ArchSpec
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.kv_mode import STANDARD, KVMode


@dataclass(frozen=True)
class Snapshot:
    """A copy of the valid slots (per layer [n_valid, Hkv, Dh], slot-major whatever the KV mode) and the
    bookkeeping: restoring it replays a cached prefix."""

    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    positions: np.ndarray
    n_valid: int
    next_slot: int
    next_position: int
    dropped: int
    rebased_tokens: int


def rebase_interval(capacity_tokens: int, max_position_embeddings: int) -> int:
    """How far positions may run past the capacity before the ring is re-based.

    A quarter of the capacity (so a re-base, which rotates every cached key once, costs a small
    fraction of the attention work between two re-bases), less where that would carry positions past
    the model's trained length (capacity + interval <= T), but at least 1 (the default capacity,
    `max_capacity`, keeps it at T/16 or more).
    """
    return max(1, min(capacity_tokens // 4, max_position_embeddings - capacity_tokens))


def max_capacity(max_position_embeddings: int) -> int:
    """The largest ring that re-bases at most every T/16 tokens (each re-base rotates every cached key):
    the trained length T less a sixteenth of it, at least 2. The default capacity is at most this."""
    return max(2, max_position_embeddings - max(1, max_position_embeddings // 16))


def rotate_keys(k: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate-half RoPE by the angles whose cos/sin are given ([Dh/2], broadcast), in place on the
    last axis of k: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (transformers' convention)."""
    half = k.shape[-1] // 2
    x1 = k[..., :half].copy()
    x2 = k[..., half:]
    k[..., :half] *= cos
    k[..., :half] -= x2 * sin
    x2 *= cos
    x2 += x1 * sin


def binding_window(spec: ArchSpec) -> int | None:
    """The model's sliding window W where it binds (W < the trained length T; at T or more it never
    does: no query attends over more than T tokens, window or not), else None. A query of such a model
    attends to the last W tokens, itself among them, as transformers masks it; the ring keeps it
    exactly: a capacity of at most W - 1, no sinks in a ring of W - 1 (they would keep older tokens in
    view), and no call appending more rows than leave each of its queries within W keys
    (`RingKVCache.call_room`). A smaller ring forgets tokens the window still holds, so it is not exact
    anyway: sinks are the caller's choice there (none by default)."""
    w = spec.sliding_window
    return w if w is not None and w < spec.max_position_embeddings else None


class RingKVCache:
    def __init__(self, spec: ArchSpec, capacity_tokens: int, n_sink: int = 4, max_chunk: int = 256,
                 mode: KVMode = STANDARD, rebase_every_tokens: int | None = None,
                 storage: tuple[list[np.ndarray], list[np.ndarray]] | None = None, rows: int | None = None,
                 dtype=np.float32):
        """storage: per-layer K and V arrays to use (row b of a `BatchedKV`) instead of allocating.
        rows: allocate this many rows (at least capacity + max_chunk; a portable graph's fixed R).
        dtype: the element type (float16 for the cuda target's graph)."""
        self.check_geometry(spec, capacity_tokens, n_sink, max_chunk, rings=0 if storage else 1, rows=rows,
                            itemsize=np.dtype(dtype).itemsize)
        if not isinstance(mode, KVMode):
            raise TypeError(f"mode must be a KVMode, got {mode!r}")
        self.capacity = int(capacity_tokens)
        self.n_sink = int(n_sink)
        self.max_chunk = int(max_chunk)
        self.mode = mode
        self.dtype = np.dtype(dtype)
        self.rows = rows = max(self.capacity + self.max_chunk, int(rows or 0))
        shape = mode.cache_shape(rows, spec.num_kv_heads, spec.head_dim)
        if storage is None:
            storage = ([np.zeros(shape, self.dtype) for _ in range(spec.num_layers)],
                       [np.zeros(shape, self.dtype) for _ in range(spec.num_layers)])
        if any(a.shape != shape or a.dtype != self.dtype or not a.flags.c_contiguous for a in storage[0] + storage[1]):
            raise ValueError(f"storage arrays must be {self.dtype}, C-contiguous, of shape {shape}")
        self.k, self.v = list(storage[0]), list(storage[1])  # bound to the graph
        self.ks = [mode.slot_major(a) for a in self.k]  # the same memory, [rows, Hkv, Dh]: the bookkeeping's view
        self.vs = [mode.slot_major(a) for a in self.v]
        self.positions = np.full(self.capacity, -1, np.int64)  # RoPE position held by each slot
        self.inv_freq = spec.rope.inv_freq(spec.head_dim).astype(np.float64)
        self.trained_positions = int(spec.max_position_embeddings)
        self.attend_limit = binding_window(spec) or self.trained_positions  # the most keys a query may
        # see: the trained length, or a sliding window's (then no call appends more rows than leave each
        # query within it, and the ring's capacity is below it: `check_geometry`)
        self.rebase_every_tokens = int(rebase_every_tokens or rebase_interval(self.capacity, self.trained_positions))
        if self.rebase_every_tokens < 1:
            raise InvalidArgumentError(f"rebase_every_tokens must be >= 1, got {rebase_every_tokens}")
        self.logits = np.zeros((1, 1, spec.vocab_size), np.float32)  # the engine writes the last token's here
        self.logits_address = self.logits.ctypes.data  # (reading it costs 1.4 µs: the engine keys its binding on it)
        self.verify_logits: np.ndarray | None = None  # a speculative verify's rows (`SpeculativeStepper`), kept with
        # the ring so that the next request's calls find their bindings pointing at it already
        self.bytes = spec.kv_bytes_per_token * rows * self.dtype.itemsize // 4
        self.writes = 0  # calls that may have written rows here (`write_offset`, batched steps), and restores
        self.reset()

    @staticmethod
    def check_geometry(spec: ArchSpec, capacity_tokens: int, n_sink: int, max_chunk: int, rings: int = 1,
                       rows: int | None = None, itemsize: int = 4) -> None:
        """The one validator of a ring's geometry (callers may run it before loading anything else):
        capacity an int in [2, the model's trained length], sinks in [0, capacity), chunk >= 1, and the
        KV arrays of `rings` rings (max(capacity + max_chunk, rows) rows each, of `itemsize`-byte
        elements) no larger than the memory available now. InvalidArgumentError otherwise."""
        for name, v, low in (("capacity_tokens", capacity_tokens, 2), ("n_sink", n_sink, 0), ("max_chunk", max_chunk, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {v!r}")
        trained = spec.max_position_embeddings
        if capacity_tokens > trained:
            raise InvalidArgumentError(
                f"capacity_tokens={capacity_tokens} is more than this model's trained length of {trained} positions "
                f"(max_position_embeddings): it would attend over distances it never saw, and its output degrades "
                f"past them; use a capacity of at most {trained} ({max_capacity(trained)} or less leaves a sixteenth "
                f"of it to re-base in)")
        window = binding_window(spec)
        if window is not None and capacity_tokens >= window:
            raise InvalidArgumentError(
                f"capacity_tokens={capacity_tokens}: this model attends to its last {window} tokens only "
                f"(sliding_window), the current one among them, so its ring holds at most {window - 1}; use "
                f"capacity_tokens={window - 1} or less")
        if window is not None and n_sink and capacity_tokens == window - 1:
            raise InvalidArgumentError(
                f"n_sink={n_sink}: this model attends to its last {window} tokens only (sliding_window), which a "
                f"ring of {capacity_tokens} holds exactly, and attention sinks would keep older ones in view; use "
                f"n_sink=0 (or a smaller ring, which forgets tokens the window still holds)")
        if n_sink >= capacity_tokens:
            raise InvalidArgumentError(f"a ring of capacity {capacity_tokens} tokens leaves no room beside its "
                                       f"{n_sink} attention sinks (n_sink): give a capacity of at least "
                                       f"{n_sink + 1}, or fewer sinks")
        rows = max(capacity_tokens + max_chunk, rows or 0)
        per_row = spec.kv_bytes_per_token * itemsize // 4  # kv_bytes_per_token counts 4-byte elements
        need, free = rings * per_row * rows, psutil.virtual_memory().available
        if need > free:
            times = f"{rings} rings x " if rings > 1 else ""
            raise InvalidArgumentError(
                f"capacity_tokens={capacity_tokens} needs {need:,} bytes of KV cache ({times}{per_row} "
                f"bytes per token x {rows} rows) but only {free:,} bytes of memory are available: use a smaller "
                f"capacity" + (" or fewer slots" if rings > 1 else ""))

    def commit_memory(self) -> None:
        """Write every KV row once and empty the ring, so that the system backs it with memory now:
        np.zeros' pages are only reserved until written, so a server's resident memory grew by its
        slots' KV under the first burst of long requests, past what its start showed (an over-committed
        device then kills it mid-service instead of at start). What the ring held is forgotten."""
        self.writes += 1
        for a in self.k + self.v:
            a.fill(0)
        self.reset()

    def reset(self) -> None:
        self.intact = True
        self.n_valid = 0  # slots [0, n_valid) hold tokens
        self.next_slot = self.n_sink  # the ring slot the next token overwrites once full
        self.next_position = 0  # RoPE position of the next token
        self.dropped = 0  # tokens evicted from the ring so far
        self.rebased_tokens = 0  # total shift applied by re-basing: a token's index in the stream is
        # its position + rebased_tokens (for ring tokens)
        self.positions[:] = -1

    @property
    def full(self) -> bool:
        return self.n_valid == self.capacity

    def call_room(self) -> int:
        """The most rows one call may append now: its queries then attend over at most the model's
        trained length, or its sliding window (n_valid + rows <= `attend_limit`), and at most max_chunk."""
        return max(1, min(self.max_chunk, self.attend_limit - self.n_valid))

    @property
    def position_limit(self) -> int:
        """No call writes a position at or past this (re-basing keeps it so)."""
        return self.capacity + self.rebase_every_tokens + self.max_chunk

    def rebase_if_due(self, s: int) -> int:
        """Before a call appending s tokens: if its positions would run past capacity +
        rebase_every_tokens, move every ring token back so that the oldest sits at position n_sink
        (its key rotated by RoPE's -d, its position lowered by d). The sinks never move. Returns d
        (0 when nothing was due)."""
        if self.next_position + s <= self.capacity + self.rebase_every_tokens or self.n_valid <= self.n_sink:
            return 0
        ring = self.positions[self.n_sink:self.n_valid]
        d = int(ring.min()) - self.n_sink
        if d <= 0:
            return 0
        self.intact = False
        angle = -d * self.inv_freq  # float64: exact enough for any d the ring reaches
        cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
        for k in self.ks:
            rotate_keys(k[self.n_sink:self.n_valid], cos, sin)
        ring -= d
        self.next_position -= d
        self.rebased_tokens += d
        self.intact = True
        return d

    def write_offset(self, s: int) -> int:
        """Row where a call appending s tokens writes its new rows: always right after the valid slots.
        Every call that writes rows asks here first (`writes` counts them)."""
        self.writes += 1
        if not 0 < s <= self.max_chunk:
            raise ValueError(f"a call may append 1..{self.max_chunk} tokens, got {s}")
        if s > 1 and s > self.call_room():  # a decode step always fits (call_room >= 1): nothing more per token
            raise ValueError(f"a call of {s} rows beside the {self.n_valid} tokens held would attend past the model's "
                             f"{'sliding window' if self.attend_limit < self.trained_positions else 'trained length'} "
                             f"of {self.attend_limit}: at most {self.call_room()} now "
                             "(chunked.prefill_chunks plans such calls)")
        return self.n_valid

    def commit(self, s: int) -> None:
        """Account for the s rows the last call wrote at rows [n_valid, n_valid + s)."""
        self.intact = False
        start = self.n_valid
        fit = max(0, min(s, self.capacity - start))  # rows that landed in free slots
        if fit == 1:
            self.positions[start] = self.next_position
        elif fit:
            self.positions[start:start + fit] = np.arange(self.next_position, self.next_position + fit)
        self.n_valid += fit
        for j in range(fit, s):  # rows past the ring: move each into the oldest non-sink slot
            src, dst = start + j, self.next_slot
            self.next_slot = self.n_sink + (self.next_slot + 1 - self.n_sink) % (self.capacity - self.n_sink)
            self.dropped += 1
            for k, v in zip(self.ks, self.vs):
                k[dst], v[dst] = k[src], v[src]
            self.positions[dst] = self.next_position + j
        self.next_position += s
        self.intact = True

    def mark(self) -> tuple[int, int, int, int, int]:
        """The bookkeeping now, for `rewind`."""
        return self.n_valid, self.next_slot, self.next_position, self.dropped, self.rebased_tokens

    def keep_prefix(self, n: int) -> bool:
        """Keep only the first n tokens ever fed (prefix reuse: a new request that starts with them
        prefills only the rest). Possible while the ring has never evicted or re-based anything, so
        that slot i holds token i at position i; returns False and changes nothing otherwise."""
        if not self.intact or self.dropped or self.rebased_tokens or not 0 <= n <= self.n_valid:
            return False
        self.positions[n:self.n_valid] = -1
        self.n_valid = self.next_position = n
        return True

    def rewind(self, mark: tuple[int, int, int, int, int]) -> bool:
        """Forget every token appended since `mark`, if that leaves exactly the cache as it was then:
        nothing held at `mark` was overwritten (no eviction) or moved (no re-base) since, and no
        mutation was cut short. Returns False and changes nothing otherwise (reset instead)."""
        n_valid, next_slot, next_position, dropped, rebased = mark
        if not self.intact or (self.dropped, self.rebased_tokens, self.next_slot) != (dropped, rebased, next_slot) \
                or self.n_valid < n_valid:
            return False
        self.positions[n_valid:self.n_valid] = -1
        self.n_valid, self.next_position = n_valid, next_position
        return True

    def forget(self, keep: int = 0) -> tuple:
        """`reset`, or `keep_prefix(keep)` when keep > 0 and it can, returning what `unforget` needs to
        take it back (the bookkeeping; the rows stay). `n_valid` says which it did."""
        kept = (self.mark(), self.positions[:self.n_valid].copy(), self.writes, self.intact)
        if not (keep > 0 and self.keep_prefix(keep)):
            self.reset()
        return kept

    def unforget(self, kept: tuple) -> bool:
        """Undo the `forget` that returned `kept`, if no row was written since (nothing was fed, or only
        refused before its first call): the rows are as they were, and the cache holds again what it
        held then. Returns False and changes nothing otherwise."""
        (n_valid, next_slot, next_position, dropped, rebased), positions, writes, intact = kept
        if self.writes != writes or not self.intact or not intact:
            return False
        self.positions[:n_valid] = positions
        self.n_valid, self.next_slot, self.next_position = n_valid, next_slot, next_position
        self.dropped, self.rebased_tokens = dropped, rebased
        return True

    def snapshot(self) -> Snapshot:
        """A copy of the valid slots ([n_valid, Hkv, Dh] per layer, slot-major whatever the mode) and the
        bookkeeping."""
        n = self.n_valid
        return Snapshot(tuple(k[:n].copy() for k in self.ks), tuple(v[:n].copy() for v in self.vs),
                        self.positions[:n].copy(), n, self.next_slot, self.next_position, self.dropped,
                        self.rebased_tokens)

    def restore(self, snap: Snapshot) -> None:
        if snap.n_valid > self.capacity:
            raise ValueError(f"snapshot holds {snap.n_valid} slots, this cache has {self.capacity}")
        self.reset()
        self.writes += 1
        n = snap.n_valid
        for k, v, sk, sv in zip(self.ks, self.vs, snap.k, snap.v):
            k[:n], v[:n] = sk, sv
        self.positions[:n] = snap.positions
        self.n_valid, self.next_slot, self.next_position = n, snap.next_slot, snap.next_position
        self.dropped, self.rebased_tokens = snap.dropped, snap.rebased_tokens


class BatchedKV:
    """Several rings as rows of one array per layer ([B, ...] in the mode's layout; ring b's arrays
    are views of row b), so that one graph call can run a decode step for all of them
    (`Engine.decode_batch`). Each ring keeps its own bookkeeping, length and positions."""

    def __init__(self, spec: ArchSpec, batch: int, capacity_tokens: int, n_sink: int, max_chunk: int, mode: KVMode,
                 dtype=np.float32):
        RingKVCache.check_geometry(spec, capacity_tokens, n_sink, max_chunk, rings=batch,
                                   itemsize=np.dtype(dtype).itemsize)
        rows = capacity_tokens + max_chunk
        shape = (batch,) + mode.cache_shape(rows, spec.num_kv_heads, spec.head_dim)[1:]
        self.k = [np.zeros(shape, dtype) for _ in range(spec.num_layers)]
        self.v = [np.zeros(shape, dtype) for _ in range(spec.num_layers)]
        self.caches = [RingKVCache(spec, capacity_tokens, n_sink, max_chunk, mode, dtype=dtype,
                                   storage=([k[b:b + 1] for k in self.k], [v[b:b + 1] for v in self.v]))
                       for b in range(batch)]
        # one batched step's run state, allocated once: token, position and valid slots per row, logits
        self.ids = np.zeros((batch, 1), np.int64)
        self.positions = np.zeros((batch, 1), np.int64)
        self.seqlens = np.zeros(batch, np.int32)
        self.logits = np.zeros((batch, 1, spec.vocab_size), np.float32)

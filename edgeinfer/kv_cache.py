"""The ring-buffer KV cache: allocated once, constant memory however long generation runs.

Layout per layer: K and V arrays of C + S_max rows, float32, where C = capacity_tokens and
S_max = the largest chunk one graph call may append (the overflow rows): [1, C + S_max, Hkv, Dh]
("BSNH", standard-op graphs) or [1, Hkv, C + S_max, Dh] ("BNSH", GroupQueryAttention graphs).

    slots [0, n_sink)        attention sinks: the first tokens, never overwritten
    slots [n_sink, C)        the ring: once full, each new token overwrites the oldest
    rows  [C, C + S_max)     overflow: where a call writes its new rows when the ring is full

A graph call reads slots [0, n_valid) and writes its S new rows (already rotated by RoPE, so slot
order does not matter to attention) at rows [n_valid, n_valid + S). Rows that land at or past C
(the ring was full, or filled up during the call) are moved by `commit` into the ring slots they
replace, oldest first, never the sinks. Positions stay absolute.

Owned by one conversation; mutated only by `commit`, `reset` and `restore`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.arch import ArchSpec

OVERFLOW_POLICIES = ("shift", "truncate", "error")


class ContextOverflowError(ValueError):
    """The prompt (or prompt plus requested tokens) does not fit the ring under overflow="error"."""


@dataclass(frozen=True)
class Snapshot:
    """A copy of the valid slots and the bookkeeping: restoring it replays a cached prefix."""

    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    positions: np.ndarray
    n_valid: int
    next_slot: int
    next_position: int
    dropped: int


class RingKVCache:
    def __init__(self, spec: ArchSpec, capacity_tokens: int, n_sink: int = 4, max_chunk: int = 256,
                 layout: str = "BSNH"):
        if capacity_tokens < 2:
            raise ValueError(f"capacity_tokens must be at least 2, got {capacity_tokens}")
        if not 0 <= n_sink < capacity_tokens:
            raise ValueError(f"n_sink must be in [0, capacity_tokens), got {n_sink} for capacity {capacity_tokens}")
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.capacity = int(capacity_tokens)
        self.n_sink = int(n_sink)
        self.max_chunk = int(max_chunk)
        if layout not in ("BSNH", "BNSH"):
            raise ValueError(f"layout must be BSNH or BNSH, got {layout!r}")
        self.layout = layout
        self.rows = rows = self.capacity + self.max_chunk
        shape = (1, rows, spec.num_kv_heads, spec.head_dim) if layout == "BSNH" else \
            (1, spec.num_kv_heads, rows, spec.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(spec.num_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(spec.num_layers)]
        self.positions = np.full(self.capacity, -1, np.int64)  # absolute position held by each slot
        self.bytes = 2 * spec.num_layers * rows * spec.num_kv_heads * spec.head_dim * 4
        self.reset()

    def reset(self) -> None:
        self.n_valid = 0  # slots [0, n_valid) hold tokens
        self.next_slot = self.n_sink  # the ring slot the next token overwrites once full
        self.next_position = 0  # absolute position of the next token
        self.dropped = 0  # tokens evicted from the ring so far
        self.positions[:] = -1

    @property
    def full(self) -> bool:
        return self.n_valid == self.capacity

    def write_offset(self, s: int) -> int:
        """Row where a call appending s tokens writes its new rows: always right after the valid slots."""
        if not 0 < s <= self.max_chunk:
            raise ValueError(f"a call may append 1..{self.max_chunk} tokens, got {s}")
        return self.n_valid

    def commit(self, s: int) -> None:
        """Account for the s rows the last call wrote at rows [n_valid, n_valid + s)."""
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
            for k, v in zip(self.k, self.v):
                if self.layout == "BSNH":
                    k[0, dst], v[0, dst] = k[0, src], v[0, src]
                else:
                    k[0, :, dst], v[0, :, dst] = k[0, :, src], v[0, :, src]
            self.positions[dst] = self.next_position + j
        self.next_position += s

    def _valid(self, a: np.ndarray) -> np.ndarray:
        return a[:, :self.n_valid] if self.layout == "BSNH" else a[:, :, :self.n_valid]

    def snapshot(self) -> Snapshot:
        n = self.n_valid
        return Snapshot(tuple(self._valid(k).copy() for k in self.k), tuple(self._valid(v).copy() for v in self.v),
                        self.positions[:n].copy(), n, self.next_slot, self.next_position, self.dropped)

    def restore(self, snap: Snapshot) -> None:
        if snap.n_valid > self.capacity:
            raise ValueError(f"snapshot holds {snap.n_valid} slots, this cache has {self.capacity}")
        self.reset()
        n = snap.n_valid
        for k, v, sk, sv in zip(self.k, self.v, snap.k, snap.v):
            if self.layout == "BSNH":
                k[:, :n], v[:, :n] = sk, sv
            else:
                k[:, :, :n], v[:, :, :n] = sk, sv
        self.positions[:n] = snap.positions
        self.n_valid, self.next_slot, self.next_position, self.dropped = n, snap.next_slot, snap.next_position, snap.dropped

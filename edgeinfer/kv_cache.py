"""The ring-buffer KV cache: allocated once, constant memory however long generation runs.

Layout per layer (interface v1, BSNH): K and V arrays [1, C + S_max, Hkv, Dh] float32, where
C = capacity_tokens and S_max = the largest chunk one graph call may append (the overflow rows).

    slots [0, n_sink)        attention sinks: the first tokens, never overwritten
    slots [n_sink, C)        the ring: once full, each new token overwrites the oldest
    rows  [C, C + S_max)     overflow: where a call writes its new rows when the ring is full

The graph reads `past` = slots [0, n_valid) (one contiguous block, bound without a copy) and writes
its S new rows (already rotated by RoPE, so slot order does not matter to attention) either
straight into free slots [n_valid, n_valid + S) or, once the ring is full, into the overflow rows,
from which `commit` moves each row into the slot it replaces. Positions stay absolute.

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
    def __init__(self, spec: ArchSpec, capacity_tokens: int, n_sink: int = 4, max_chunk: int = 256):
        if capacity_tokens < 2:
            raise ValueError(f"capacity_tokens must be at least 2, got {capacity_tokens}")
        if not 0 <= n_sink < capacity_tokens:
            raise ValueError(f"n_sink must be in [0, capacity_tokens), got {n_sink} for capacity {capacity_tokens}")
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self.capacity = int(capacity_tokens)
        self.n_sink = int(n_sink)
        self.max_chunk = int(max_chunk)
        rows = self.capacity + self.max_chunk
        shape = (1, rows, spec.num_kv_heads, spec.head_dim)
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
        """Row where a call appending s tokens writes its outputs: free slots, else the overflow rows."""
        if s > self.max_chunk:
            raise ValueError(f"a call may append at most {self.max_chunk} tokens, got {s}")
        return self.n_valid if self.n_valid + s <= self.capacity else self.capacity

    def commit(self, s: int) -> None:
        """Account for the s rows the last call wrote at `write_offset(s)`; move overflow rows into the ring."""
        if self.n_valid + s <= self.capacity:  # written in place into free slots
            start = self.n_valid
            self.positions[start:start + s] = np.arange(self.next_position, self.next_position + s)
            self.n_valid += s
        else:
            for j in range(s):
                src = self.capacity + j
                if self.n_valid < self.capacity:  # fill the remaining free slots first
                    dst = self.n_valid
                    self.n_valid += 1
                else:
                    dst = self.next_slot
                    self.next_slot = self.n_sink + (self.next_slot + 1 - self.n_sink) % (self.capacity - self.n_sink)
                    self.dropped += 1
                for k, v in zip(self.k, self.v):
                    k[0, dst] = k[0, src]
                    v[0, dst] = v[0, src]
                self.positions[dst] = self.next_position + j
        self.next_position += s

    def snapshot(self) -> Snapshot:
        n = self.n_valid
        return Snapshot(tuple(k[:, :n].copy() for k in self.k), tuple(v[:, :n].copy() for v in self.v),
                        self.positions[:n].copy(), n, self.next_slot, self.next_position, self.dropped)

    def restore(self, snap: Snapshot) -> None:
        if snap.n_valid > self.capacity:
            raise ValueError(f"snapshot holds {snap.n_valid} slots, this cache has {self.capacity}")
        self.reset()
        n = snap.n_valid
        for k, v, sk, sv in zip(self.k, self.v, snap.k, snap.v):
            k[:, :n] = sk
            v[:, :n] = sv
        self.positions[:n] = snap.positions
        self.n_valid, self.next_slot, self.next_position, self.dropped = n, snap.next_slot, snap.next_position, snap.dropped

"""The penalty window: the last n token ids (a history such as the prompt, then the accepted
tokens) that the penalties count, as llama.cpp's penalties sampler keeps them.

`PenaltyWindow` is the Python form: the numpy back end of `Sampler` uses it, and it is the twin of
the C window (sampler_penalties.c), which holds the same ids and keeps their counts per id up to
date as each id arrives.
"""

from __future__ import annotations

import numpy as np


class PenaltyWindow:
    """The last `n` ids (history, then pushed) in a buffer of at most 2n: constant memory however
    long generation runs; `view()` is a contiguous slice of the last n, no copy (None when n is 0).
    The buffer grows (doubling) with the ids seen, so a window of 2**31 - 1 costs what it holds, not
    32 GiB up front. Ids are stored as given: the sampler checks them."""

    def __init__(self, n: int, history=()):
        self.n = n
        tail = history[-n:] if n else []
        self.buf = np.zeros(min(2 * n, max(2 * len(tail), 64)) if n else 1, np.int64)
        self.buf[:len(tail)] = tail
        self.end = len(tail)

    def push(self, token: int) -> None:
        if not self.n:
            return
        if self.end == self.buf.size:
            if self.buf.size < 2 * self.n:  # not yet at its bound: grow
                grown = np.zeros(min(2 * self.n, 2 * self.buf.size), np.int64)
                grown[:self.end] = self.buf[:self.end]
                self.buf = grown
            else:  # full: keep the last n - 1, then append
                self.buf[:self.n - 1] = self.buf[self.end - self.n + 1:self.end]
                self.end = self.n - 1
        self.buf[self.end] = token
        self.end += 1

    def view(self) -> np.ndarray | None:
        return self.buf[max(0, self.end - self.n):self.end] if self.n else None

"""A checkpoint tensor read a slice of rows at a time (`Rows`), and the checks every weight read gets
(`checked`)."""

from __future__ import annotations

import numpy as np

from edgeinfer.converters.quantize import check_magnitude
from edgeinfer.errors import ConvertError


def checked(name: str, w: np.ndarray) -> np.ndarray:
    """w, once it holds neither NaN nor infinity (quantizing would hide them: a block's scale skips a
    NaN, and the weight becomes an arbitrary code) nor a magnitude no trained model has."""
    if not np.isfinite(w).all():
        raise ConvertError(f"{name}: the weights hold NaN or infinity (the source is broken)")
    check_magnitude(name, w)
    return w


class Rows:
    """A checkpoint's 2-D tensor read a slice of rows at a time, `rows[a:b]` (float32, `checked`): the
    gptq recipe quantizes the embedding last, when the layers' leftovers share the process, and a 0.5B
    model's embedding is 545 MB in float32. A checkpoint that cannot read rows (GGUF) is read whole,
    once per `Rows`."""

    def __init__(self, ckpt, name: str, shape: tuple[int, int]):
        self.ckpt, self.name, self.shape = ckpt, name, tuple(shape)
        self._whole = None if hasattr(ckpt, "read_rows") else checked(name, ckpt.read(name, shape))

    def __getitem__(self, part: slice) -> np.ndarray:
        if self._whole is not None:
            return self._whole[part]
        start, stop, _ = part.indices(self.shape[0])
        return checked(self.name, self.ckpt.read_rows(self.name, start, stop, self.shape))

    def take(self, ids: np.ndarray, chunk: int = 8192) -> np.ndarray:
        """The rows `ids` (any shape of row indices) as float32 [*ids.shape, columns]."""
        flat, out = ids.reshape(-1), np.empty((ids.size, self.shape[1]), np.float32)
        for a in range(0, self.shape[0], chunk):
            hit = (flat >= a) & (flat < a + chunk)
            if hit.any():
                out[hit] = self[a:a + chunk][flat[hit] - a]
        return out.reshape(*ids.shape, self.shape[1])

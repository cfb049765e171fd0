"""Streams initializers into one external-data file while the graph is being built.

Contract: `WeightWriter.add(name, array)` appends the array's bytes to `<dir>/model.onnx.data`
at an aligned offset and returns a `TensorProto` that points there; the caller may drop the
array right after, so the converter never holds more than one tensor's worth of weights.
Tiny tensors (norm weights, shape constants) stay inline in the `.onnx` file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from edgeinfer.errors import ConvertError

DATA_FILE = "model.onnx.data"
INLINE_MAX_BYTES = 1024
PAGE = 4096


class WeightWriter:
    def __init__(self, folder: Path):
        self.path = Path(folder) / DATA_FILE
        self._f = open(self.path, "wb")
        self.offset = 0
        self.external_bytes = 0

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        """Store `array` as initializer `name`; ConvertError for a float array holding NaN or infinity
        (broken source weights, or their quantization's scales: the model would compute nothing)."""
        array = np.ascontiguousarray(array)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ConvertError(f"{name}: the weights hold NaN or infinity (the source is broken)")
        if array.nbytes <= INLINE_MAX_BYTES:
            return numpy_helper.from_array(array, name)
        align = PAGE if array.nbytes >= 16 * PAGE else 64
        pad = (-self.offset) % align
        if pad:
            self._f.write(b"\0" * pad)
            self.offset += pad
        self._f.write(memoryview(array).cast("B"))
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        t.dims.extend(array.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", DATA_FILE), ("offset", str(self.offset)), ("length", str(array.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.offset += array.nbytes
        self.external_bytes += array.nbytes
        return t

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()


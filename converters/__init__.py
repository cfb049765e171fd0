"""Offline converters (installed as `edgeinfer.converters`): Hugging Face folders -> edgeinfer model folders.

Never imported by the runtime's hot path; needs numpy, onnx, onnxruntime and ml_dtypes, never torch.
"""

from edgeinfer.converters.convert import convert, default_scheme

__all__ = ["convert", "default_scheme"]

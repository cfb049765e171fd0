"""edgeinfer: run small quantized language models on the device itself.

Runtime modules never import torch or transformers; the converter lives in `edgeinfer.converters`.
"""

__version__ = "0.1.0"

from edgeinfer.errors import (  # noqa: E402
    ConvertError, EdgeInferError, InvalidArgumentError, InvalidArgumentTypeError, ModelFormatError)
from edgeinfer.kv_cache import ContextOverflowError  # noqa: E402
from edgeinfer.model import Conversation, Model, load  # noqa: E402

__all__ = ["load", "Model", "Conversation", "ContextOverflowError", "EdgeInferError", "ConvertError",
           "ModelFormatError", "InvalidArgumentError", "InvalidArgumentTypeError", "__version__"]

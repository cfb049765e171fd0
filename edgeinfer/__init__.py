"""edgeinfer: run small quantized language models on the device itself.

Runtime modules never import torch or transformers; the converter lives in `edgeinfer.converters`.
"""

__version__ = "0.1.0"

import os  # noqa: E402

# ONNX Runtime's official Linux and macOS wheels (1.32) keep a device identifier and an event queue
# under ~/.cache/Microsoft and send usage events to Microsoft, unless ORT_DISABLE_TELEMETRY=1 is set
# before onnxruntime is first imported (its Privacy.md). An on-device runtime stays offline and
# writes nothing to the user's home; a value the user set (0 to allow it) is kept.
if not os.environ.get("ORT_DISABLE_TELEMETRY"):
    os.environ["ORT_DISABLE_TELEMETRY"] = "1"

from edgeinfer.errors import (  # noqa: E402
    ConvertError, EdgeInferError, ForkedBusyError, InvalidArgumentError, InvalidArgumentTypeError, ModelFormatError)
from edgeinfer.context_lock import ContextBusyError  # noqa: E402
from edgeinfer.overflow import ContextOverflowError  # noqa: E402
from edgeinfer.options import GenerationOptions  # noqa: E402
from edgeinfer.sampling import SamplingParams  # noqa: E402
from edgeinfer.generation import Chunk, Completion, Generation  # noqa: E402
from edgeinfer.model import Conversation, Model, load  # noqa: E402

__all__ = ["load", "Model", "Conversation", "Generation", "GenerationOptions", "SamplingParams", "Chunk",
           "Completion", "ContextOverflowError", "ContextBusyError", "EdgeInferError", "ConvertError",
           "ModelFormatError", "InvalidArgumentError", "InvalidArgumentTypeError", "ForkedBusyError", "__version__"]

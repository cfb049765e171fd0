"""edgeinfer: run small quantized language models on the device itself.

Runtime modules never import torch or transformers; the converter lives in `edgeinfer.converters`.
"""

__version__ = "0.1.0"

import os  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

# ONNX Runtime's official Linux and macOS wheels (1.32) keep a device identifier and an event queue
# under ~/.cache/Microsoft and send usage events to Microsoft, unless ORT_DISABLE_TELEMETRY=1 is set
# before onnxruntime is first imported (its Privacy.md). An on-device runtime stays offline and
# writes nothing to the user's home; a value the user set (0 to allow it) is kept.
if not os.environ.get("ORT_DISABLE_TELEMETRY"):
    os.environ["ORT_DISABLE_TELEMETRY"] = "1"

from edgeinfer.errors import (  # noqa: E402
    ConvertError, EdgeInferError, ForkedBusyError, InvalidArgumentError, InvalidArgumentTypeError, ModelClosedError,
    ModelFormatError)

# The rest of the public API is imported when first used (PEP 562): numpy and ONNX Runtime take about
# 0.4 s to import, and the CLI's Ctrl-C handler must be in place before they are (a Ctrl-C at start
# printed a traceback from inside them). `edgeinfer.model` and the other submodules are attributes
# once imported, as with any package.
if TYPE_CHECKING:  # what type checkers and editors see: the names as they are
    from edgeinfer.context_lock import ContextBusyError
    from edgeinfer.generation import Generation, GenerationCancelled
    from edgeinfer.model import Conversation, Model, load
    from edgeinfer.options import GenerationOptions
    from edgeinfer.overflow import ContextOverflowError
    from edgeinfer.results import Chunk, Completion
    from edgeinfer.sampling import SamplingParams

_LAZY = {"ContextBusyError": "edgeinfer.context_lock", "ContextOverflowError": "edgeinfer.overflow",
         "GenerationOptions": "edgeinfer.options", "SamplingParams": "edgeinfer.sampling",
         "Chunk": "edgeinfer.results", "Completion": "edgeinfer.results", "Generation": "edgeinfer.generation",
         "GenerationCancelled": "edgeinfer.generation",
         "Conversation": "edgeinfer.model", "Model": "edgeinfer.model", "load": "edgeinfer.model"}

__all__ = ["load", "Model", "Conversation", "Generation", "GenerationCancelled", "GenerationOptions",
           "SamplingParams", "Chunk", "Completion", "ContextOverflowError", "ContextBusyError", "EdgeInferError", "ConvertError",
           "ModelFormatError", "ModelClosedError", "InvalidArgumentError", "InvalidArgumentTypeError", "ForkedBusyError",
           "__version__"]


_SUBMODULES = ("power",)  # documented as `edgeinfer.power.Policy(...)` right after `import edgeinfer`


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"edgeinfer.{name}")  # the import binds it as an attribute
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module 'edgeinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))

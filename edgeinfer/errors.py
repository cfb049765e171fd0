"""Error types.

Every error a user can cause (bad path, bad model folder, bad argument, a prompt that does not
fit) derives from `EdgeInferError`; the CLI prints its message on one line and exits non-zero
without a traceback. Anything else is a bug and keeps its traceback. Bad arguments are also the
builtin type Python code expects (`InvalidArgumentError` is a ValueError, `InvalidArgumentTypeError`
a TypeError, `ContextOverflowError` a ValueError). `warn_user` gives a warning the caller's line.
"""

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class EdgeInferError(Exception):
    """A user-facing error: the message names the problem in one line."""


class ConvertError(EdgeInferError):
    """The source model folder cannot be converted (missing file, unsupported field, bad tensor)."""


class ModelFormatError(EdgeInferError):
    """An edgeinfer model folder is missing, corrupted, or from an unknown format version."""


class InvalidArgumentError(EdgeInferError, ValueError):
    """An argument has a bad value (out of range, empty, unknown name). Still a ValueError, so
    `except ValueError` keeps working."""


class InvalidArgumentTypeError(EdgeInferError, TypeError):
    """An argument has the wrong type (e.g. a prompt that is neither text nor token ids). Still a
    TypeError."""


class ModelClosedError(EdgeInferError, RuntimeError):
    """The Model was closed (`Model.close`, or the end of its `with` block): load it again to use it."""

    def __init__(self, message: str = "the model was closed (Model.close): load it again to use it"):
        super().__init__(message)


class ForkedBusyError(EdgeInferError, RuntimeError):
    """In a process made by fork(): the parent's Model (or one of its contexts) was in use by another
    thread at the fork, and that thread does not exist here (`fork_safety`)."""


def shown(value) -> str:
    """A value for an error message, cut short (a client's body, a config file: of any size)."""
    try:
        r = repr(value)
    except ValueError:  # an int past Python's digit limit
        r = f"<a {type(value).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


def warn_user(message: str) -> None:
    """`warnings.warn(message)` attributed to the first frame outside edgeinfer: the user's line that
    called into it (`load(threads=64)`), whichever of our functions led there. A fixed stacklevel
    pointed into edgeinfer from some of them (`Model(...)` against `load(...)`)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def broken_logits_cause(kv_dtype) -> str:
    """What logits that are NaN or infinite say about a model: broken weights, or, in a graph that
    computes in float16 (`kv_dtype` float16: `convert --target cuda`), activations past its range."""
    why = "its weights are broken (`edgeinfer inspect --verify` checks the files against the conversion)"
    if str(kv_dtype) == "float16":
        why += (", or its activations overflow float16, which this --target cuda model computes in (convert it "
                "for --target cpu)")
    return why

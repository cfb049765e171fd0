"""Error types.

Every error a user can cause (bad path, bad model folder, bad argument, a prompt that does not
fit) derives from `EdgeInferError`; the CLI prints its message on one line and exits non-zero
without a traceback. Anything else is a bug and keeps its traceback. Bad arguments are also the
builtin type Python code expects (`InvalidArgumentError` is a ValueError, `InvalidArgumentTypeError`
a TypeError, `ContextOverflowError` a ValueError).
"""


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


class ForkedBusyError(EdgeInferError, RuntimeError):
    """In a process made by fork(): the parent's Model (or one of its contexts) was in use by another
    thread at the fork, and that thread does not exist here (`fork_safety`)."""

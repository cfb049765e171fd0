"""Error types.

Every error a user can cause (bad path, bad model folder, bad argument) derives from
`EdgeInferError`; the CLI prints its message on one line and exits non-zero without a
traceback. Anything else is a bug and keeps its traceback.
"""


class EdgeInferError(Exception):
    """A user-facing error: the message names the problem in one line."""


class ConvertError(EdgeInferError):
    """The source model folder cannot be converted (missing file, unsupported field, bad tensor)."""


class ModelFormatError(EdgeInferError):
    """An edgeinfer model folder is missing, corrupted, or from an unknown format version."""

"""Argument types the CLI's commands share, and the output errors they report alike."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

# standard output cannot take the output: a full disk or /dev/full, a quota, or opened for reading only
OUTPUT_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EBADF)


def path_arg(text: str) -> Path:
    """A path given on the command line; an empty one is refused (Path("") is ".", the current folder:
    `-m ""` was read as it)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def path_text_arg(text: str) -> str:
    """`path_arg` where the command keeps the path as text."""
    return str(path_arg(text))

"""Argument types the CLI's commands share, and the output errors they report alike."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

# standard output cannot take the output: a full disk or /dev/full, a quota, opened for reading only, or a
# terminal that has gone (closed with SIGHUP ignored: nohup, `trap '' HUP`, a supervisor; EIO)
OUTPUT_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EBADF, errno.EIO)


def path_arg(text: str) -> Path:
    """A path given on the command line; an empty one is refused (Path("") is ".", the current folder:
    `-m ""` was read as it)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def path_text_arg(text: str) -> str:
    """`path_arg` where the command keeps the path as text."""
    return str(path_arg(text))

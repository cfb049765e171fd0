"""Argument types the CLI's commands share."""

from __future__ import annotations

import argparse
from pathlib import Path


def path_arg(text: str) -> Path:
    """A path given on the command line; an empty one is refused (Path("") is ".", the current folder:
    `-m ""` was read as it)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def path_text_arg(text: str) -> str:
    """`path_arg` where the command keeps the path as text."""
    return str(path_arg(text))

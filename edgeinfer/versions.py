"""Whether an installed library is older than what edgeinfer's files need (for the hint a load error adds)."""

from __future__ import annotations

import re


def older_than(version: str, floor: tuple[int, int]) -> bool:
    """True when `version`'s major.minor is below `floor`; False when it is not, or does not start with
    two numbers (a build we cannot read is not blamed)."""
    parts = re.match(r"(\d+)\.(\d+)", version)
    return parts is not None and (int(parts[1]), int(parts[2])) < floor

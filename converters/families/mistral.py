"""Mistral: a Llama graph; `sliding_window` is recorded in the manifest for the runtime's ring.

Within a window (prompt plus generation at most `sliding_window` tokens) the graph is exact.
The runtime enforces the window by capping the ring capacity at it.
"""

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.hf_config import common_spec


def spec_from_config(cfg: dict) -> ArchSpec:
    window = cfg.get("sliding_window")
    return common_spec(cfg, "mistral", qkv_bias=False, sliding_window=int(window) if window else None)

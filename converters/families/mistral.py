"""Mistral: a Llama graph; `sliding_window` is recorded in the manifest for the runtime's ring.

Within a window (prompt plus generation at most `sliding_window` tokens) the graph is exact.
The runtime enforces the window by capping the ring capacity at it.
"""

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.hf_config import common_spec
from edgeinfer.errors import ConvertError

MIN_WINDOW = 16  # a shorter window leaves no ring to decode in beside the sinks


def spec_from_config(cfg: dict) -> ArchSpec:
    window = cfg.get("sliding_window")
    if window is not None and (type(window) is not int or window < MIN_WINDOW):
        raise ConvertError(f"config.json: sliding_window must be null or an integer >= {MIN_WINDOW}, got {window!r:.80}")
    return common_spec(cfg, "mistral", qkv_bias=False, sliding_window=window)

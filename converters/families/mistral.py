"""Mistral: a Llama graph; `sliding_window` is recorded in the manifest for the runtime's ring.

The graph has no window mask: the runtime keeps the window exactly as transformers masks it (each
query attends to the last W tokens, itself among them) with a ring of at most W - 1 tokens, no
attention sinks, and no call whose queries would see more than W keys (`kv_cache.binding_window`).
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

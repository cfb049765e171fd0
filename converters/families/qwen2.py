"""Qwen2 / Qwen2.5: a Llama graph with biases on q, k and v."""

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.hf_config import common_spec
from edgeinfer.errors import ConvertError


def spec_from_config(cfg: dict) -> ArchSpec:
    if cfg.get("use_sliding_window"):
        raise ConvertError("config.json: use_sliding_window=true is not supported for qwen2")
    return common_spec(cfg, "qwen2", qkv_bias=True)

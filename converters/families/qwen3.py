"""Qwen3: per-head RMSNorm on q and k (before RoPE), explicit head_dim, optional attention bias."""

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.hf_config import common_spec, flag
from edgeinfer.errors import ConvertError


def spec_from_config(cfg: dict) -> ArchSpec:
    if cfg.get("use_sliding_window"):
        raise ConvertError("config.json: use_sliding_window=true is not supported for qwen3")
    bias = flag(cfg, "attention_bias")
    return common_spec(cfg, "qwen3", qkv_bias=bias, o_bias=bias, qk_norm=True)

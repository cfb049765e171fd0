"""Llama family: Llama 2, Llama 3.x (llama3 rope scaling), TinyLlama, SmolLM/SmolLM2."""

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.hf_config import common_spec, flag


def spec_from_config(cfg: dict) -> ArchSpec:
    bias = flag(cfg, "attention_bias")
    return common_spec(cfg, "llama", qkv_bias=bias, o_bias=bias)

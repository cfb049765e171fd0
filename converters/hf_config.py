"""Reading a Hugging Face `config.json` into an `ArchSpec`, field by field, refusing what we cannot run.

Family modules (`converters/families/*.py`) call `common_spec` with their own flags; every field
they do not understand becomes a `ConvertError` that names it, never a silently wrong graph.
"""

from __future__ import annotations

import math
from pathlib import Path

from edgeinfer.arch import (SUPPORTED_ROPE_TYPES, ArchSpec, RopeSpec, check_sizes, positive_in_float32,
                            rope_angles_finite)
from edgeinfer.converters.source_files import read_json
from edgeinfer.errors import ConvertError
from edgeinfer.fields import FieldError


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        if (Path(folder) / "edgeinfer.json").is_file():  # an output given as a source ("missing config.json" said)
            raise ConvertError(f"{folder} is an edgeinfer model folder (converted already), not a source: convert the "
                               "Hugging Face folder or GGUF file it was made from")
        raise ConvertError(f"missing config.json in {folder}")
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise ConvertError("config.json is not a JSON object")
    return cfg


def _int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise ConvertError(f"config.json: missing required field {key!r}")
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConvertError(f"config.json: field {key!r} must be a positive integer, got {v!r:.40}")
    return v


def flag(cfg: dict, key: str, default: bool = False) -> bool:
    """A true/false field (absent or null: `default`); a string such as "false" is refused, not read as true."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConvertError(f"config.json: field {key!r} must be true or false, got {v!r:.40}")
    return v


MIN_CONTEXT = 16  # fewer positions leave no ring to decode in beside load's attention sinks


def _context(cfg: dict) -> int:
    n = _int(cfg, "max_position_embeddings", 2048)
    if n < MIN_CONTEXT:  # it converted, then no folder of it could load with the defaults
        raise ConvertError(f"config.json: max_position_embeddings (the context) must be at least {MIN_CONTEXT}, "
                           f"got {n}")
    return n


def _positive(v, key: str) -> float:
    """A finite positive number (a float field: eps, rope theta, a scaling factor) that stays so in
    float32, where the graph and the RoPE tables hold it, or ConvertError (1e-300 became 0 there: NaN
    logits at every prompt, from a conversion that had said nothing)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConvertError(f"config.json: field {key!r} must be a finite positive number, got {v!r:.40}")
    if not positive_in_float32(v):
        raise ConvertError(f"config.json: field {key!r} is {v!r:.40}, which float32 (the graph's) holds as "
                           f"{'0' if abs(v) < 1 else 'infinity'}")
    return float(v)


CONFIG_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",  # ArchSpec's: config.json's
                "num_kv_heads": "num_key_value_heads",
                "rope.original_max_position_embeddings": "rope_scaling.original_max_position_embeddings"}


def check_rope_range(spec: ArchSpec) -> None:
    """ConvertError unless RoPE's angles stay finite in float32 up to the last trained position: a tiny
    theta or scaling factor (1e-37) passes `_positive`, but inv_freq, or position times inv_freq, is
    infinite there, and from that position on every logit was NaN. The sizes first (`check_sizes`):
    the table is head_dim / 2 long, and a huge one took the machine's memory before its refusal."""
    try:
        check_sizes(spec, "config.json")
    except FieldError as e:
        name, problem = e.field.removeprefix("config.json."), str(e)[len(e.field) + 2:]
        raise ConvertError(f"config.json: field {CONFIG_NAMES.get(name, name)!r} {problem}") from None
    if not rope_angles_finite(spec):
        raise ConvertError(f"config.json: RoPE's angles (theta {spec.rope.theta:g}, type {spec.rope.type}) are "
                           f"not finite in float32 by position {spec.max_position_embeddings - 1}: the rope "
                           "theta or scaling factor is too small")


def _same(a, b) -> bool:
    """Two copies of a value agree; NaN in both does too: the value is refused below, in its own words,
    not as copies that disagree."""
    return a == b or (a != a and b != b)


def parse_rope(cfg: dict) -> RopeSpec:
    """transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` and `rope_scaling`. A config
    with both, or a top-level value beside the block's, is read only where they agree: transformers
    lets one win by rules that changed between versions (5.24: `rope_scaling` over `rope_parameters`,
    a top-level `original_max_position_embeddings` over the block's), so a disagreement is refused."""
    params, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
    for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(v, dict):
            raise ConvertError(f"config.json: field {key!r} must be an object, got {v!r:.80}")
    params, scaling = _rope_block(params), _rope_block(scaling)
    if params and scaling:
        for k in sorted(params.keys() & scaling.keys() | ({"rope_type"} & (params.keys() | scaling.keys()))):
            if not _same(params.get(k, "default"), scaling.get(k, "default")):
                raise ConvertError(f"config.json: rope_parameters and rope_scaling disagree on {k!r} "
                                   f"({params.get(k, 'default')!r:.40} against {scaling.get(k, 'default')!r:.40}): "
                                   "keep the one the model was trained with")
    merged = {**scaling, **params}
    for k in ("rope_theta", "original_max_position_embeddings"):
        if k in cfg and k in merged and not _same(cfg[k], merged[k]):
            raise ConvertError(f"config.json: {k} is {cfg[k]!r:.40} at the top level but {merged[k]!r:.40} in the "
                               "rope block: keep the one the model was trained with")
    if "original_max_position_embeddings" in cfg:
        merged.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    theta = _positive(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta")
    rtype = merged.get("rope_type", "default")
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ConvertError(
            f"config.json: rope type {rtype!r:.40} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError("config.json: partial_rotary_factor other than 1.0 is not supported")
    if rtype == "default":
        return RopeSpec(theta=theta)
    if rtype == "linear":
        return RopeSpec(theta=theta, type="linear", factor=_positive(merged.get("factor"), "rope_scaling.factor"))
    try:
        rope = RopeSpec(
            theta=theta,
            type="llama3",
            factor=_positive(merged["factor"], "rope_scaling.factor"),
            low_freq_factor=_positive(merged["low_freq_factor"], "rope_scaling.low_freq_factor"),
            high_freq_factor=_positive(merged["high_freq_factor"], "rope_scaling.high_freq_factor"),
            original_max_position_embeddings=_int(merged, "original_max_position_embeddings"),
        )
    except KeyError as e:
        raise ConvertError(f"config.json: llama3 rope scaling lacks {e.args[0]!r}") from None
    if rope.high_freq_factor <= rope.low_freq_factor:  # the smoothing divides by their gap
        raise ConvertError(f"config.json: llama3 rope scaling needs high_freq_factor above low_freq_factor, got "
                           f"{rope.high_freq_factor} and {rope.low_freq_factor}")
    return rope


def _rope_block(block: dict) -> dict:
    """A rope block with transformers 4's `type` read as `rope_type`."""
    out = dict(block)
    if "type" in out:
        kind = out.pop("type")
        if out.setdefault("rope_type", kind) != kind:
            raise ConvertError(f"config.json: a rope block has both type {kind!r:.40} and rope_type "
                               f"{out['rope_type']!r:.40}")
    return out


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    ids = tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConvertError(f"config.json: field 'eos_token_id' must be a token id or a list of them, got {eos!r:.60}")
    return ids


def _token_id(cfg: dict, key: str) -> int | None:
    v = cfg.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise ConvertError(f"config.json: field {key!r} must be a token id, got {v!r:.40}")
    return v


def common_spec(cfg: dict, family: str, *, qkv_bias: bool, o_bias: bool = False, qk_norm: bool = False,
                sliding_window: int | None = None) -> ArchSpec:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConvertError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ConvertError("config.json: mlp_bias=true is not supported")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    head_dim = _int({"head_dim": head_dim}, "head_dim")
    if heads % kv_heads:
        raise ConvertError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ConvertError(f"config.json: head_dim {head_dim} must be even for RoPE")
    spec = ArchSpec(
        family=family,
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=_int(cfg, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size"),
        rms_norm_eps=_positive(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        rope=parse_rope(cfg),
        max_position_embeddings=_context(cfg),
        tie_word_embeddings=flag(cfg, "tie_word_embeddings"),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        sliding_window=sliding_window,
        bos_token_id=_token_id(cfg, "bos_token_id"),
        eos_token_ids=_eos_ids(cfg),
    )
    check_rope_range(spec)
    return spec

"""Registry of supported model families: Hugging Face `model_type` -> module with `spec_from_config`.

Each family module is small: it reads its config quirks into an `ArchSpec`. The graph itself is
built by the shared functions in `converters/graph/`, driven by the spec's flags.
"""

from __future__ import annotations

from types import ModuleType

from edgeinfer.arch import ArchSpec
from edgeinfer.converters.families import llama, mistral, qwen2, qwen3
from edgeinfer.errors import ConvertError

REGISTRY: dict[str, ModuleType] = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def spec_from_config(cfg: dict) -> ArchSpec:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConvertError(f"config.json: architectures must be a list of names, got {archs!r:.80}")
    model_type = cfg.get("model_type") or (ARCHITECTURES.get(archs[0]) if archs else None)
    if model_type is not None and not isinstance(model_type, str):
        raise ConvertError(f"config.json: model_type must be a name, got {model_type!r:.80}")
    if model_type not in REGISTRY or (archs and archs[0] not in ARCHITECTURES):
        name = archs[0] if archs and archs[0] not in ARCHITECTURES else model_type
        raise ConvertError(
            f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return REGISTRY[model_type].spec_from_config(cfg)

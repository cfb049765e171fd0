"""`convert_via_optimum(src, dst)`: a Hugging Face folder of a family the native builder lacks (Phi-3,
Gemma, ...) -> an edgeinfer model folder, through Hugging Face Optimum's ONNX export.

1. Optimum exports the decoder with past (task `text-generation-with-past`, fp32, eager attention)
   into a temporary folder, with `position_ids` as an input for every family (the ring sets
   positions itself) and without the config's sliding window (the ring keeps it, as for the
   native graphs: `architecture.sliding_window`, `kv_cache.binding_window`). The model transformers
   builds must be the checkpoint's (no weight missing, unused or of another shape) with the RoPE
   the manifest records (`_check_loaded`); a window that binds some layers only is refused.
2. `optimum_graph.rewire` turns that graph's KV exchange into the `optimum` KV mode's (slot-major
   past, the new rows as present, `logits_index`).
3. ONNX Runtime's own MatMulNBitsQuantizer quantizes the MatMul weights (int4 or int8, blocks of 32,
   symmetric round to nearest: the native `--recipe rtn`, not the native int4 default gptq; accuracy
   level 4) and the embedding's Gather
   (GatherBlockQuantized); fp32 keeps the float graph.
4. The tokenizer files are copied (and loaded once, as the native builder checks them) and
   `edgeinfer.json` written (the `optimum` KV mode, origin "optimum"; the source's hashes of the
   weight files transformers read, `_weights_read`), all in `.DST.partial-PID-XXXXXXXX`, renamed into
   place at the end (`convert._convert`'s rule).

Torch, transformers and Optimum are imported only here, only when called (`pip install
'edgeinfer[optimum]'`): the runtime never needs them. Families are limited to those whose graph the
ring can re-base (rotate-half RoPE over the whole head, one frequency table: `RING_FAMILIES`);
`optimum_family_error` and `ring_family_error` refuse the others before any work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

from edgeinfer import __version__
from edgeinfer.arch import ArchSpec
from edgeinfer.converters.convert import MAX_DEFAULT_CAPACITY, _check_source, check_spec
from edgeinfer.converters.hf_tokenizer import TOKENIZER_FILES, check_tokenizer_info, tokenizer_info
from edgeinfer.converters.safetensors_io import _weight_map, onnx_export_hint
from edgeinfer.converters.destination import (_check_destination, _os_error, _replace_atomically, absolute, discard,
                                              temp_folder)
from edgeinfer.converters.source_files import regular_file
from edgeinfer.converters.hf_config import _eos_ids, _int, check_rope_range, flag, parse_rope, read_config
from edgeinfer.converters.onnx_writer import DATA_FILE
from edgeinfer.errors import ConvertError
from edgeinfer.integrity import sha256_file
from edgeinfer.kv_mode import OPTIMUM
from edgeinfer.interface import graph_interface
from edgeinfer.manifest import MODEL_FILE, Manifest, Origin
from edgeinfer.quant_scheme import QuantScheme

TASK = "text-generation-with-past"
PIP_HINT = "--via optimum needs Hugging Face Optimum and torch: pip install 'edgeinfer[optimum]'"
QUANTS = ("int4", "int8", "fp32")
# Hugging Face model types whose attention the ring's re-basing is exact for: RoPE in the rotate-half
# convention over the whole head with one inv_freq table, keys cached after RoPE (checked in transformers'
# modeling code; Phi-3 and Gemma are tested against transformers, Llama measured beside the native graph).
# Not: partial rotary (phi, stablelm, gpt_neox, nemotron), interleaved pairs (gptj, cohere, helium, glm),
# learned or ALiBi positions (gpt2, opt, bloom, mpt), NoPE layers (smollm3), two RoPE bases (gemma3),
# alternating windows with soft-capping (gemma2, not verified).
RING_FAMILIES = ("arcee", "gemma", "granite", "llama", "mistral", "olmo", "olmo2", "phi3", "qwen2", "qwen3")


def _exporter():
    """Optimum's exporter and what it needs, imported now (not at module import): ConvertError with
    the pip command when the extra is not installed."""
    try:
        import torch  # noqa: F401
        import transformers
        from optimum.exporters.onnx import onnx_export_from_model
        from optimum.exporters.tasks import TasksManager
    except ImportError as e:
        raise ConvertError(f"{PIP_HINT} ({e})") from None
    return transformers, TasksManager, onnx_export_from_model


def optimum_family_error(model_type, TasksManager) -> str | None:
    """Why Optimum cannot export `model_type` as a decoder with past (None if it can)."""
    supported = TasksManager._SUPPORTED_MODEL_TYPE
    if model_type in supported and TASK in supported[model_type].get("onnx", {}):
        return None
    can = sorted(t for t, v in supported.items() if TASK in v.get("onnx", {}))
    return (f"Hugging Face Optimum cannot export model type {model_type!r} as a decoder with past ({TASK}); "
            f"it exports: {', '.join(can)}")


def ring_family_error(model_type) -> str | None:
    """Why edgeinfer's ring cannot run `model_type`'s exported graph (None if it can)."""
    if model_type in RING_FAMILIES:
        return None
    return (f"--via optimum: edgeinfer's KV ring re-bases positions by rotating cached keys, which is exact for "
            f"rotate-half RoPE over the whole head; model type {model_type!r} is not one it has checked "
            f"(supported: {', '.join(RING_FAMILIES)})")


def spec_from_hf_config(cfg: dict) -> ArchSpec:
    """ArchSpec from a Hugging Face config.json, as far as it describes the exported graph: the sizes the
    ring and the manifest need (family = model_type). The RoPE must be one the ring can re-base."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type")}
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int({"head_dim": cfg.get("head_dim") or hidden // heads}, "head_dim")
    if heads % kv_heads:
        raise ConvertError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                           f"{kv_heads}")
    if cfg.get("model_type") in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):  # as the native builder: its
        # window binds only the layers from max_window_layers on, and the ring keeps one window for all (a hostile round)
        raise ConvertError(f"config.json: use_sliding_window=true is not supported for {cfg['model_type']}")
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and len(set(map(str, kinds))) > 1:
        raise ConvertError(f"config.json: layer_types mixes {', '.join(sorted(set(map(str, kinds))))[:200]}: the KV "
                           "ring keeps one window for every layer")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) is not False else None
    spec = ArchSpec(
        family=str(cfg["model_type"]), hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", 4 * hidden), num_layers=_int(cfg, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=_int(cfg, "vocab_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", cfg.get("layer_norm_eps", 1e-6))), rope=parse_rope(cfg),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
        tie_word_embeddings=flag(cfg, "tie_word_embeddings"),
        qkv_bias=flag(cfg, "attention_bias"), o_bias=flag(cfg, "attention_bias"),
        sliding_window=window if isinstance(window, int) and window > 0 else None,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos_ids(cfg))
    check_rope_range(spec)
    return spec


def convert_via_optimum(src: Path | str, dst: Path | str, *, quant: str = "int4", block_size: int = 32,
                        force: bool = False, log=print) -> Manifest:
    """Convert the Hugging Face folder `src` into the edgeinfer folder `dst` through Optimum's export
    (module doc). Returns the manifest written. quant: int4 | int8 (MatMulNBits, `block_size`,
    symmetric, accuracy level 4) | fp32. Every refusal comes before any work (no torch import for a bad
    path or quant); every failure raises ConvertError and leaves no partial output and an existing
    `dst` untouched (replaced only with `force`, as `convert` does)."""
    src, dst = Path(src), absolute(dst)
    if quant not in QUANTS:
        raise ConvertError(f"--via optimum: unknown quantization {quant!r} (choose from {', '.join(QUANTS)})")
    scheme = QuantScheme(weights=quant, block_size=block_size, symmetric=True,
                         accuracy_level=0 if quant == "fp32" else 4, embedding=quant, lm_head=quant)
    try:
        _check_source(src)
        if not src.is_dir():
            raise ConvertError(f"--via optimum exports a Hugging Face model folder, got a file: {src}")
        _check_destination(src, dst, force, log)
        cfg = read_config(src)
        transformers, TasksManager, export = _exporter()
        model_type = cfg.get("model_type")
        why = optimum_family_error(model_type, TasksManager) or ring_family_error(model_type)
        if why:
            raise ConvertError(why)
        spec = spec_from_hf_config(cfg)
        check_spec(spec, "config.json")
        return _convert(src, dst, spec, scheme, transformers, TasksManager, export, log, force)
    except OSError as e:
        raise _os_error(e, dst) from None


def _convert(src: Path, dst: Path, spec: ArchSpec, scheme: QuantScheme, transformers, TasksManager, export,
             log, force: bool) -> Manifest:
    tmp, made = temp_folder(dst)
    try:
        info = tokenizer_info(src, spec, log)
        check_tokenizer_info(src, info, spec.vocab_size, log)  # a corrupt tokenizer file: refused before the export's
        # minutes, not at the first load (the native builder checks its folder's as well)
        t0 = time.perf_counter()
        exported = tmp / "optimum-export"
        _export(src, exported, spec, transformers, TasksManager, export)
        log(f"Optimum exported the {spec.family} decoder in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        _rewire_and_quantize(exported, tmp, spec, scheme)
        shutil.rmtree(exported)
        log(f"graph rewired for the KV ring and weights stored as {scheme.weights}"
            f"{' (symmetric round to nearest: recipe rtn)' if scheme.weights == 'int4' else ''} in "
            f"{time.perf_counter() - t0:.1f} s")
        tokenizer_files = [n for n in TOKENIZER_FILES if (src / n).exists()]
        for name in tokenizer_files:
            regular_file(src / name)  # not a link to /dev/zero (copied until the disk filled) or a FIFO
            shutil.copyfile(src / name, tmp / name)
        outputs = [MODEL_FILE, *([DATA_FILE] if (tmp / DATA_FILE).exists() else []), *tokenizer_files]
        sources = ["config.json", *_weights_read(src), *tokenizer_files]
        manifest = Manifest(
            arch=spec, quantization=scheme, target="cpu", flavour="fused", interface=graph_interface(spec, OPTIMUM),
            tokenizer=info,
            default_capacity_tokens=min(spec.max_position_embeddings, MAX_DEFAULT_CAPACITY),
            files={n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in outputs},
            source={n: sha256_file(src / n) for n in sources}, converter_version=__version__,
            origin=Origin(format="optimum", file=src.name))
        manifest.write(tmp)
        _replace_atomically(tmp, dst, force)
        return manifest
    finally:
        discard(tmp, made)


@contextlib.contextmanager
def _offline():
    """No hub access while exporting (a local folder needs none; nothing may download at run time)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _weights_read(src: Path) -> list[str]:
    """The weight files transformers' from_pretrained reads, in its order of preference (model.safetensors,
    the safetensors index and its shards, pytorch_model.bin, the .bin index and its shards): what the
    manifest's `source` hashes. Others in the folder were not read (every file the patterns matched was
    hashed: an unused pytorch_model.bin linked to /dev/zero hashed for ever, a hostile round)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (src / single).is_file():
            return [single]
        if (src / index).is_file():
            return [index, *sorted(set(_weight_map(src / index).values()))]
    return []


def _check_loaded(src: Path, model, info: dict, spec: ArchSpec, version: str) -> None:
    """The model transformers (`version`) built is the checkpoint's, with the RoPE the manifest records: weights it
    lacks (transformers fills them with random values), weights it did not use, and a RoPE other than
    config.json's as edgeinfer reads it (transformers 4.x ignores a transformers-5 `rope_parameters`
    block: the graph's RoPE and the ring's re-basing then disagree) are refused. All three converted
    into a wrong model, with rc 0 (a hostile round: perplexity 537.8 for an untied head left out)."""
    import numpy as np

    for key, what in (("missing_keys", "lacks weights the model needs"), ("unexpected_keys", "holds weights the "
                      "model does not use"), ("mismatched_keys", "holds weights of other shapes than config.json's")):
        names = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ())
        if names:
            raise ConvertError(f"{src}: the checkpoint {what} ({len(names)}: {', '.join(names[:3])[:200]}"
                               f"{', ...' if len(names) > 3 else ''}): transformers would fill or drop them")
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    theirs = getattr(rotary, "inv_freq", None)
    if theirs is None:
        return  # (each family of RING_FAMILIES has one in transformers 4.57)
    theirs, ours = theirs.detach().float().numpy(), spec.rope.inv_freq(spec.head_dim)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if theirs.shape != ours.shape or not np.allclose(theirs, ours, rtol=1e-5, atol=0) or scaling != 1.0:
        raise ConvertError(f"config.json: the RoPE transformers {version} builds from it differs "
                           f"from the one edgeinfer reads ({spec.rope}): a rope_parameters block this transformers "
                           "does not read? Give the settings as rope_theta and rope_scaling")


def _export(src: Path, out: Path, spec: ArchSpec, transformers, TasksManager, export) -> None:
    """Optimum's ONNX export of the decoder with past, fp32, into `out` (model.onnx), of a model that
    `_check_loaded` found to be the checkpoint's."""
    import torch

    with _offline(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python control flow: expected here
        try:
            config = transformers.AutoConfig.from_pretrained(src, local_files_only=True)
            if getattr(config, "sliding_window", None) is not None:  # the ring enforces the window (module doc)
                config.sliding_window = None
            if getattr(config, "layer_types", None):
                config.layer_types = ["full_attention"] * len(config.layer_types)
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                src, config=config, dtype=torch.float32, local_files_only=True, attn_implementation="eager",
                output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - OSError for no weights, RuntimeError for a size mismatch, the
            # safetensors library's own error for a truncated file: one line each (they were tracebacks)
            hint = onnx_export_hint(src) if isinstance(e, OSError) and not _weights_read(src) else ""  # (a corrupt or
            # git-lfs pointer .bin is an OSError too, whose own words say more: a review)
            if hint:
                raise ConvertError(f"transformers finds no weights in {src}{hint}") from None
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]  # (a size mismatch's second
            text = " ".join(lines[:2])[:300] or type(e).__name__  # line names the tensor and the shapes)
            raise ConvertError(f"transformers cannot load {src}: {text}") from None
        _check_loaded(src, model.eval(), info, spec, transformers.__version__)
        ctor = TasksManager.get_exporter_config_constructor(exporter="onnx", model=model, task=TASK,
                                                            library_name="transformers")
        base = ctor.func if isinstance(ctor, functools.partial) else ctor

        class WithPositions(base):  # every family takes position_ids (Optimum's Gemma config does not)
            @property
            def inputs(self):
                d = super().inputs
                d.setdefault("position_ids", {0: "batch_size", 1: "sequence_length"})
                return d

        onnx_config = WithPositions(model.config, task=TASK, int_dtype="int64", float_dtype="fp32", use_past=True,
                                    use_past_in_inputs=True)
        try:
            with torch.no_grad():
                export(model, out, task=TASK, custom_onnx_configs={"model": onnx_config}, no_post_process=True,
                       do_validation=False)
        except Exception as e:  # the exporter raises what torch and Optimum raise
            raise ConvertError(f"Optimum's export of {src} failed: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:300] if str(e) else ''}") from None
    if not (out / MODEL_FILE).exists():
        raise ConvertError(f"Optimum's export of {src} wrote no {MODEL_FILE}")


def _rewire_and_quantize(exported: Path, tmp: Path, spec: ArchSpec, scheme: QuantScheme) -> None:
    """exported/model.onnx -> tmp/model.onnx + model.onnx.data: rewired (optimum_graph), then weights
    quantized as `scheme` says, every initializer over 1 KiB in the data file."""
    import onnx

    from edgeinfer.converters.optimum_graph import rewire

    model = rewire(onnx.load(str(exported / MODEL_FILE), load_external_data=False), spec)
    rewired = exported / "rewired.onnx"  # beside the export, so its external data (if any) resolves
    onnx.save_model(model, str(rewired))
    del model
    if scheme.weights == "fp32":
        model = onnx.load(str(rewired))
    else:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(str(rewired), bits=4 if scheme.weights == "int4" else 8, block_size=scheme.block_size,
                                 is_symmetric=scheme.symmetric, accuracy_level=scheme.accuracy_level,
                                 op_types_to_quantize=("MatMul", "Gather"), quant_axes=(("MatMul", 0), ("Gather", 1)))
        quiet = logging.getLogger(MatMulNBitsQuantizer.__module__)  # it logs every node it visits at INFO
        level, quiet.level = quiet.level, logging.ERROR  # and warns that int4 Gather data moves the opset to 21
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # 0/0 for an all-zero block (a padding row): stored as zeros
                q.process()
        finally:
            quiet.setLevel(level)
        model = q.model.model
    onnx.save_model(model, str(tmp / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)
    if (tmp / DATA_FILE).exists():
        (tmp / DATA_FILE).chmod(0o644)  # onnx creates it owner-only; the folder's other files are 0644


__all__ = ["convert_via_optimum", "spec_from_hf_config", "RING_FAMILIES", "PIP_HINT"]

"""`convert(src, dst, ...)`: a Hugging Face model folder -> an edgeinfer model folder, atomically.

The output is built in a hidden temporary folder next to `dst` and renamed into place at the
end. Any failure (bad input, full disk, Ctrl-C) removes the temporary folder and leaves an
existing `dst` untouched; `force=True` replaces `dst` only after the new folder is complete, and
only an existing edgeinfer model folder (or an empty one), never one holding the source folder.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnx

from edgeinfer import __version__
from edgeinfer.arch import ArchSpec
from edgeinfer.converters import gguf_import
from edgeinfer.converters.calibration import plan
from edgeinfer.converters.decoder import ATTENTION_CHOICES, TensorSource, build_decoder, check_embedding_blocks
from edgeinfer.converters.destination import (_check_destination, _os_error, _replace_atomically, absolute, discard,
                                              temp_folder)
from edgeinfer.converters.families import spec_from_config
from edgeinfer.converters.gguf_header import read_header
from edgeinfer.converters.hf_config import read_config
from edgeinfer.converters.hf_tokenizer import TOKENIZER_FILES, check_tokenizer, tokenizer_info
from edgeinfer.converters.ngrams import MAX_TOKENS as MAX_NGRAM_TOKENS, add_ngram_table, check_can_sample
from edgeinfer.converters.onnx_writer import DATA_FILE, WeightWriter
from edgeinfer.converters import cuda_graph
from edgeinfer.converters.ort_format import write_ort_format
from edgeinfer.converters.portable import build_portable
from edgeinfer.integrity import sha256_file
from edgeinfer.converters.quantize import QUANTS, QuantScheme
from edgeinfer.converters.safetensors_io import Checkpoint
from edgeinfer.converters.source_files import regular_file
from edgeinfer.converters.widen import WidenedSource, choose_kv_mode, widened_spec
from edgeinfer.errors import ConvertError
from edgeinfer.fields import FieldError
from edgeinfer.kv_cache import binding_window
from edgeinfer.kv_mode import PORTABLE
from edgeinfer.interface import graph_interface, portable_interface
from edgeinfer.manifest import MODEL_FILE, Manifest, Origin
from edgeinfer.portable import MAX_DIM, PORTABLE_TARGETS, PortableInfo
from edgeinfer.sampling.params import is_integer

TARGETS = ("cpu", "cuda", "coreml", "nnapi")
PORTABLE_WEIGHTS = {"coreml": ("fp16", "fp32"), "nnapi": ("int8", "fp16", "fp32")}  # first: the default
DEFAULT_PORTABLE_CAPACITY = 512
DEFAULT_PREFILL_TOKENS = 64
MIN_PORTABLE_CAPACITY = 8
MAX_DEFAULT_CAPACITY = 4096
VIAS = ("auto", "native", "optimum")  # `convert --via`


NARROW_HIDDEN = 128  # int4's default block below this hidden size: 16, so that a row of the residual's width
# keeps at least 4 blocks (stories260K, hidden 64: blocks of 32 gave each row 2 scales; blocks of 16 took its
# default int4 from +7.0 % to +4.8 % perplexity, +3.8 to +4.8 % in four orders of the calibration text, for
# 10 % more bytes and 0.89-0.98x its decode speed; docs/quantization.md). Wider models keep 32: on SmolLM2's
# shape, blocks of 16 decoded at 0.66x the speed of 32


GRID_4BIT_32 = (2, 3)  # GGML type numbers (ggml.h, the gguf package's GGMLQuantizationType) of Q4_0 and Q4_1


def default_block_size(src: Path | str, quant: str | None, target: str = "cpu", recipe: str | None = None,
                       via: str = "auto") -> int:
    """The block size `convert` uses when none is given: 16 for int4 (the cpu and cuda graphs' default
    quantization, None) of a model narrower than NARROW_HIDDEN, unless the recipe is q4_1 (llama.cpp's
    blocks of 32), the export is Optimum's (`via`, its own 32) or the source is a GGUF whose layers are
    mostly on a 4-bit grid in blocks of 32 already (Q4_0, Q4_1: re-quantized in blocks of 16,
    stories260K's Q4_0 scored 6.3973 against 6.3474 in 32, and rtn no longer landed on the file's
    grid; its Q8_0 scores better in 16, 5.9335 against 6.1420), else 32. The hidden size is read
    from the source's config.json or GGUF metadata; a source that cannot be read gets 32 (the
    conversion itself then says what is wrong with it)."""
    if quant not in (None, "int4") or target in PORTABLE_TARGETS or recipe == "q4_1" or via == "optimum":
        return 32
    src = Path(src)
    try:
        if gguf_import.is_gguf(src):
            meta, tensors = read_header(src)
            hidden = meta.get(f"{meta.get('general.architecture')}.embedding_length")
            layers = [t.type_id for t in tensors if t.name.startswith("blk.") and len(t.dims) == 2]
            if 2 * sum(t in GRID_4BIT_32 for t in layers) > len(layers):
                return 32
        else:
            hidden = read_config(src).get("hidden_size")
    except (OSError, ValueError, ConvertError):
        return 32
    return 16 if is_integer(hidden) and 0 < hidden < NARROW_HIDDEN else 32


def default_scheme(quant: str, block_size: int = 32, *, accuracy_level: int | None = None,
                   embedding: str | None = None, symmetric: bool = True,
                   int8_tensors: tuple[str, ...] = (), recipe: str | None = None,
                   scale_dtype: str | None = None) -> QuantScheme:
    """The measured defaults (docs/architecture.md, "Quantization choices"; scripts/quant_matrix.py).

    int4 / int8: every projection block-quantized on MatMulNBits, and the (tied) embedding and
    lm_head at the same width, stored once. accuracy_level 4 (int8 activations) is 1.7x faster per
    decode step on this CPU and moves stories260K's perplexity by < 0.1 %. int4's recipe (None: the
    default) is "gptq": asym's storage (integer zero points), so asym's decode speed, with the grid
    fitted to the inputs the weights meet on a shipped calibration text and the rounding errors fed
    forward (converters/gptq.py): the most accurate recipe that keeps the decode speed (perplexity
    stories260K +12.2 % -> +7.0 %, SmolLM2 +21.5 % -> +3.0 % against asym; docs/quantization.md;
    stories260K +4.8 % in the blocks of 16 `convert` takes for it, `default_block_size`).
    int8 is symmetric round-to-nearest. fp16 / fp32: plain weights. `int8_tensors` keeps chosen int4
    projections at int8.
    """
    if recipe is None:
        recipe = "gptq" if quant == "int4" else "rtn"
    if recipe != "rtn" and quant != "int4":
        raise ConvertError(f"--recipe {recipe} chooses how int4 blocks are rounded: it goes with --quant int4, "
                           f"not {quant}")
    if recipe == "mse" and not symmetric:
        raise ConvertError("--recipe mse searches symmetric scales: with --asymmetric, choose --recipe asym")
    if recipe == "q4_1" and block_size != 32:
        raise ConvertError(f"--recipe q4_1 stores llama.cpp's blocks of 32, not {block_size}")
    if int8_tensors and quant != "int4":
        raise ConvertError(f"--int8-tensors keeps chosen int4 projections at int8: it goes with --quant int4, "
                           f"not {quant}")
    int8_tensors = tuple(dict.fromkeys(int8_tensors))  # a name given twice is one choice
    if embedding is None:
        embedding = quant
    if accuracy_level is None:
        accuracy_level = 4 if quant in ("int4", "int8") else 0
    if recipe in ("asym", "gptq", "q4_1"):  # asymmetric storage (q4_1: a float minimum; the tensors it cannot take,
        symmetric = False  # ONNX Runtime's asymmetric blocks: stories260K 6.2522 against 6.2921 symmetric, where the
        # manifest said "symmetric" of a recipe whose blocks are not; a fresh user's review)
    if scale_dtype is None:  # int4: fp16 scales, 6 % smaller files for +0.03 % perplexity on stories260K
        scale_dtype = "float16" if quant == "int4" else "float32"
    return QuantScheme(weights=quant, block_size=block_size, symmetric=symmetric, accuracy_level=accuracy_level,
                       embedding=embedding, lm_head=embedding, int8_tensors=tuple(int8_tensors), recipe=recipe,
                       scale_dtype=scale_dtype)


def _as_stored_on_cuda(scheme: QuantScheme, log) -> QuantScheme:
    """The scheme the cuda graph holds: its float weights are fp16 (the fp16 pass converts every float
    initializer), so fp32 weights, embedding or lm_head are recorded, and said, as fp16 (the manifest
    and `inspect` said fp32 of fp16 tensors)."""
    fp32 = {f: "fp16" for f in ("weights", "embedding", "lm_head") if getattr(scheme, f) == "fp32"}
    if fp32:
        log(f"note: --target cuda computes in fp16 and stores float weights as fp16: {', '.join(fp32)} written as "
            "fp16, not fp32")
    return dataclasses.replace(scheme, **fp32) if fp32 else scheme


def check_spec(spec: ArchSpec, where: str) -> None:
    """The bounds `load` checks (ArchSpec.from_json), refused before any work rather than once the
    folder is written (a max_position_embeddings of 2**28 converted into a folder load refused)."""
    try:
        ArchSpec.from_json(spec.to_json())
    except FieldError as e:
        raise ConvertError(f"{where}: {e}") from None


def _check_source(src: Path) -> None:
    if not src.exists():
        raise ConvertError(f"source not found: {src}")
    if gguf_import.is_gguf(src):
        return
    if not src.is_dir():
        raise ConvertError(f"source must be a Hugging Face model folder or a GGUF file, got another file: {src}")
    if not any((src / f).exists() for f in ("tokenizer.model", "tokenizer.json")):
        raise ConvertError(f"no tokenizer in {src} (need tokenizer.model or tokenizer.json)")


def convert(src: Path | str, dst: Path | str, *, quant: str | None = None, block_size: int | None = None,
            target: str = "cpu",
            force: bool = False, scheme: QuantScheme | None = None, attention: str = "auto",
            capacity_tokens: int | None = None, prefill_tokens: int | None = None, ort_format: bool = False,
            accuracy_level: int | None = None, via: str = "auto", ngram_tokens: int = 0,
            log=lambda msg: None) -> Manifest:
    """Convert `src` (a Hugging Face folder or a GGUF file) into `dst` (edgeinfer folder). Returns the
    manifest written.

    Every refusal (see `_check_destination`) happens before any work; every failure, OSError
    included, raises ConvertError and leaves no temporary folder and an existing `dst` untouched.
    block_size: int4/int8 blocks; None: `default_block_size` (a `scheme` given keeps its own; Optimum's
    export, 32).
    quant: None is int4 for cpu/cuda and the portable target's default (coreml fp16, nnapi int8); for a
    GGUF file on cpu, "keep" (its Q8_0/Q4_0/Q4_1 blocks taken over exactly, other types as
    `TensorSource` says); accuracy_level: with "keep", MatMulNBits' (default 0, float activations).
    via: "native" (our graph builder), "optimum" (Hugging Face Optimum's export:
    `optimum_export.convert_via_optimum`), or "auto": native, or Optimum with a note for a Hugging Face
    architecture the native builder does not know when the `optimum` extra is installed.
    capacity_tokens / prefill_tokens: the portable graphs' fixed ring and prefill chunk; ort_format:
    also write them as .ort files (ONNX Runtime Mobile's format). ngram_tokens: the converted model
    samples this many tokens of its own text for its n-gram table, a source of speculative drafts
    (`converters/ngrams.py`; cpu target only; 0: no table).
    """
    src, dst = Path(src), absolute(dst)
    if target not in TARGETS:
        raise ConvertError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    if attention not in ATTENTION_CHOICES:
        raise ConvertError(f"unknown attention {attention!r} (choose from {', '.join(ATTENTION_CHOICES)})")
    if via not in VIAS:
        raise ConvertError(f"unknown --via {via!r} (choose from {', '.join(VIAS)})")
    if quant is not None and quant not in ("keep", *QUANTS):
        raise ConvertError(f"unknown quantization {quant!r} (choose from keep, {', '.join(QUANTS)})")
    # (4.0 passed `in range(5)` and wrote a manifest load refused; numpy's ints failed at the manifest's write,
    # a block size of 32.0 deep in building the graph: after the work, a hostile round)
    if accuracy_level is not None and (not is_integer(accuracy_level) or accuracy_level not in range(5)):
        raise ConvertError(f"accuracy_level must be an integer 0..4, got {accuracy_level!r:.40}")
    if block_size is not None and not is_integer(block_size):
        raise ConvertError(f"block_size must be an integer, got {block_size!r:.40}")
    accuracy_level, block_size = (None if v is None else int(v) for v in (accuracy_level, block_size))
    if not is_integer(ngram_tokens) or not 0 <= ngram_tokens <= MAX_NGRAM_TOKENS:
        raise ConvertError(f"ngram_tokens must be an integer 0..{MAX_NGRAM_TOKENS:,}, got {ngram_tokens!r:.40}")
    ngram_tokens = int(ngram_tokens)
    if ngram_tokens and (target != "cpu" or via == "optimum"):
        raise ConvertError("--ngram-tokens samples the converted model on this machine's CPU to count its n-grams, "
                           "for the speculative drafts of the native cpu graph: " +
                           ("--target cuda's fp16 graph runs on a CUDA device, not on this CPU" if target == "cuda"
                            else f"--target {target}'s portable graphs verify no drafts" if target != "cpu"
                            else "--via optimum's graph is not built here"))
    gguf = gguf_import.is_gguf(src)
    if via == "optimum" and gguf:  # (before the options' check: the CLI's default for a GGUF, keep, is not the user's)
        raise ConvertError(f"--via optimum exports Hugging Face model folders only; {src} is a GGUF file")
    if via == "optimum" or (via == "auto" and not gguf and _needs_optimum(src, log)):
        if scheme is not None and scheme in (default_scheme(scheme.weights, scheme.block_size),
                                             default_scheme(scheme.weights, scheme.block_size, recipe="rtn")):
            # only --block-size (or --recipe rtn, what Optimum's int4 is) given: the export's own scheme
            quant, block_size, scheme = quant or scheme.weights, scheme.block_size, None
        if ngram_tokens:  # (auto chose Optimum: an architecture the native builder does not know)
            raise ConvertError(f"--ngram-tokens counts the n-grams of the native cpu graph; {src}'s architecture is "
                               "exported by Optimum (--via optimum)")
        if target != "cpu" or scheme is not None or attention != "auto" or ort_format or accuracy_level is not None \
                or capacity_tokens is not None or prefill_tokens is not None or quant not in (None, "int4", "int8", "fp32"):
            raise ConvertError("--via optimum builds a cpu graph from --quant int4, int8 or fp32 (and --block-size); "
                               "the other convert options are for the native graphs")
        from edgeinfer.converters.optimum_export import convert_via_optimum

        return convert_via_optimum(src, dst, quant=quant or "int4", block_size=block_size or 32, force=force, log=log)
    if quant is None and gguf and target == "cpu" and scheme is None:
        quant = "keep"
    if quant == "keep" and block_size not in (None, 32):
        raise ConvertError(f"--quant keep stores the GGUF's own blocks of 32: --block-size {block_size} does not apply")
    if quant == "keep" and (not gguf or target != "cpu" or scheme is not None):
        choices = {"coreml": "fp16 or fp32", "nnapi": "int8, fp16 or fp32"}.get(target, "int4, int8, fp16 or fp32")
        raise ConvertError("--quant keep takes over a GGUF file's own quantized blocks for --target cpu"
                           + ("" if gguf else f"; {src} is not a GGUF file") + f": choose --quant {choices}")
    if quant is None and gguf and target == "cuda" and scheme is None:
        log("note: --target cuda quantizes the GGUF's weights again (int4, gptq): its own blocks are kept only "
            "for --target cpu")
    portable = _check_portable(target, quant, capacity_tokens, prefill_tokens, attention, scheme)
    if ort_format and portable is None:
        raise ConvertError("--ort-format writes the portable graphs for ONNX Runtime Mobile: it goes with --target "
                           "coreml or nnapi")
    quant = quant or (portable.weights if portable else "int4")
    try:
        _check_source(src)
        _check_destination(src, dst, force, log)
        if quant != "keep":
            scheme = scheme or default_scheme(quant, block_size or default_block_size(src, quant, target),
                                              accuracy_level=accuracy_level)
            if target == "cuda" and scheme.scale_dtype != "float32":  # the fp16 graph pass keeps its own scales
                scheme = dataclasses.replace(scheme, scale_dtype="float32")
            if target != "cpu" and scheme.recipe == "q4_1":
                raise ConvertError("--recipe q4_1 builds the cpu graph's offset packs: choose another recipe for "
                                   f"--target {target}")
        return _convert(src, dst, scheme, target, attention, log, portable, ort_format, gguf, accuracy_level, force,
                        capacity_given=capacity_tokens is not None, prefill_given=prefill_tokens is not None,
                        ngram_tokens=ngram_tokens)
    except OSError as e:
        raise _os_error(e, dst) from None


def _needs_optimum(src: Path, log) -> bool:
    """For `via="auto"`: whether the Hugging Face folder `src` is of an architecture the native builder
    does not know and Optimum is installed to export it (said in the log). Unknown without Optimum:
    ConvertError naming the extra. Any other problem is left to the native path to report."""
    try:
        cfg = read_config(src)
        spec_from_config(cfg)
        return False
    except ConvertError as e:
        if not str(e).startswith("unsupported architecture"):
            return False
        if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("torch") is None:
            raise ConvertError(f"{e}; other families convert through Hugging Face Optimum's ONNX export: pip install "
                               "'edgeinfer[optimum]', then convert again (or pass --via optimum)") from None
        name = str(e).split(";")[0].removeprefix("unsupported architecture ")
        log(f"note: {name} is not a native family: converting through Optimum's ONNX export "
            "(--via optimum; slower to decode than a native graph, docs/architecture.md)")
        return True
    except OSError:
        return False


def _check_portable(target: str, quant: str | None, capacity_tokens, prefill_tokens, attention: str,
                    scheme) -> PortableInfo | None:
    """The portable geometry for a coreml/nnapi target (None for cpu/cuda), every refusal before any work."""
    if target not in PORTABLE_TARGETS:
        if capacity_tokens is not None or prefill_tokens is not None:
            raise ConvertError("--capacity and --prefill-tokens fix the portable graphs' shapes: they go with "
                               "--target coreml or nnapi (cpu and cuda graphs take any capacity at load)")
        return None
    allowed = PORTABLE_WEIGHTS[target]
    weights = quant or allowed[0]
    if weights not in allowed:
        why = {"coreml": "CoreML's EP has no DequantizeLinear or MatMulNBits", "nnapi": "NNAPI has no 4-bit types"}
        raise ConvertError(f"--target {target} stores weights as {' or '.join(allowed)}, not {weights} ({why[target]})")
    if scheme is not None or attention != "auto":
        raise ConvertError(f"--target {target} builds the portable graph: quantization schemes and --attention "
                           "apply to the cpu/cuda graph")
    cap = DEFAULT_PORTABLE_CAPACITY if capacity_tokens is None else capacity_tokens
    pre = prefill_tokens
    if pre is None:  # the default chunk, or the ring if that is smaller
        pre = min(DEFAULT_PREFILL_TOKENS, cap) if isinstance(cap, int) and not isinstance(cap, bool) else cap
    for name, v, low in (("--capacity", cap, MIN_PORTABLE_CAPACITY), ("--prefill-tokens", pre, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            why = " (room for load's 4 attention sinks and new tokens)" if name == "--capacity" else ""
            raise ConvertError(f"{name} must be an integer >= {low}{why}, got {v!r}")
    if pre > cap:  # every prompt runs the whole chunk: 8188 rows for an 8-token ring took 10 GB and 37 s
        raise ConvertError(f"--prefill-tokens {pre} is over the ring's --capacity {cap}: a chunk larger than the "
                           f"ring gains nothing and every prompt pays for all of it; give at most {cap}")
    if cap + 2 * pre > MAX_DIM:
        raise ConvertError(f"--capacity {cap} with --prefill-tokens {pre} makes attention rows of {cap + 2 * pre} "
                           f"columns, over the portable graphs' limit of {MAX_DIM} (CoreML's largest dimension; "
                           "NNAPI's graph is built the same way): lower --capacity or --prefill-tokens")
    return PortableInfo(capacity_tokens=cap, prefill_tokens=pre, weights=weights)


def _convert(src: Path, dst: Path, scheme: QuantScheme | None, target: str, attention: str, log,
             portable: PortableInfo | None = None, ort_format: bool = False, gguf: bool = False,
             accuracy_level: int | None = None, force: bool = True, capacity_given: bool = True,
             prefill_given: bool = True, ngram_tokens: int = 0) -> Manifest:
    """scheme None: `--quant keep` of a GGUF file (the scheme is read from its types). capacity_given,
    prefill_given: the portable ring's capacity and chunk are the user's (else the defaults, cut to
    the model's trained length; the user's are refused past it)."""
    keep = scheme is None
    if gguf:
        ckpt = gguf_import.GGUFCheckpoint(src)
        spec = gguf_import.spec_from_gguf(ckpt)
        if scheme is None:
            scheme = gguf_import.keep_scheme(ckpt, spec, accuracy_level)
    else:
        spec = spec_from_config(read_config(src))
        ckpt = Checkpoint(src)
    check_spec(spec, "the GGUF metadata" if gguf else "config.json")
    if not keep and portable is None:  # (keep: stored as its GGUF types say; a portable graph's host gathers rows)
        check_embedding_blocks(spec, scheme)
    trained = spec.max_position_embeddings
    if portable is not None and portable.capacity_tokens > trained:  # a ring past it attends over untrained distances
        if capacity_given:
            raise ConvertError(f"--capacity {portable.capacity_tokens} is over the model's trained length of {trained} "
                               f"positions (its output degrades past them): use --capacity {trained} or less")
        if portable.prefill_tokens > trained and prefill_given:
            raise ConvertError(f"--prefill-tokens {portable.prefill_tokens} is over the model's trained length of "
                               f"{trained} positions, the most the ring (cut to it) can hold: use --prefill-tokens "
                               f"{trained} or less")
        portable = dataclasses.replace(portable, capacity_tokens=trained,
                                       prefill_tokens=min(portable.prefill_tokens, trained))
    window = binding_window(spec)  # a sliding window W under T: load's ring holds at most W - 1 (kv_cache)
    if portable is not None and window is not None and not capacity_given:  # so the default is cut to it too
        cap = max(window - 1, MIN_PORTABLE_CAPACITY)  # (a hostile round: 320 rows built for a 15-token ring)
        if prefill_given and portable.prefill_tokens > cap:  # as a chunk over a ring given is (_check_portable)
            raise ConvertError(f"--prefill-tokens {portable.prefill_tokens} is over the ring this model can use (its "
                               f"sliding window of {window} less one: {cap} tokens): a larger chunk gains nothing and "
                               f"every prompt pays for all of it; give at most {cap}")
        if portable.capacity_tokens > cap:
            portable = dataclasses.replace(portable, capacity_tokens=cap,
                                           prefill_tokens=min(portable.prefill_tokens, cap))
    src_tensors = TensorSource(ckpt, keep=keep)
    mode = PORTABLE
    if portable is None:
        mode, head_dim = choose_kv_mode(spec, attention, widenable=not keep)
        if head_dim != spec.head_dim:  # GroupQueryAttention on wider heads: the same function (widen.py)
            src_tensors = WidenedSource(ckpt, spec, head_dim)
            spec = widened_spec(spec, head_dim)
            log(f"attention heads widened from {spec.source_head_dim} to {head_dim} for GroupQueryAttention")

    tmp, made = temp_folder(dst)
    writer = None
    try:
        if gguf:  # before the graph: a vocabulary that makes no tokenizer is refused before minutes of work
            tokenizer, tokenizer_files = gguf_import.write_gguf_tokenizer(ckpt, spec, tmp)
        else:
            tokenizer = tokenizer_info(src, spec, log)
        if ngram_tokens:
            check_can_sample(tokenizer)
        calibration = None
        if portable is None and not keep:
            calibration, scheme = plan(scheme, tmp if gguf else src, tokenizer, spec, log,
                                       check_fp16=target == "cuda")
        t0 = time.perf_counter()
        writer = WeightWriter(tmp)
        graphs = [MODEL_FILE]
        kv_dtype = "float16" if target == "cuda" else "float32"
        if portable is None:
            model, peak = build_decoder(spec, src_tensors, scheme, writer, mode, calibration)
            writer.close()
            if target == "cuda":  # fp16 activations and KV (converters/cuda_graph.py)
                if peak is not None:
                    cuda_graph.check_range(peak, log)
                model = cuda_graph.to_fp16(model, tmp, DATA_FILE)
                cuda_graph.save(model, tmp / MODEL_FILE, DATA_FILE)
                scheme = _as_stored_on_cuda(scheme, log)
            else:
                onnx.save_model(model, tmp / MODEL_FILE)
            del model
        else:
            decode, prefill, emb = build_portable(spec, ckpt, portable.weights, writer, portable)
            writer.close()
            onnx.save_model(decode, tmp / MODEL_FILE)
            onnx.save_model(prefill, tmp / portable.prefill_file)
            np.save(tmp / portable.embeddings_file, emb.astype(np.float32 if portable.weights == "fp32" else np.float16))
            graphs += [portable.prefill_file, portable.embeddings_file]
            del decode, prefill, emb
            if ort_format:
                graphs += write_ort_format(tmp, [MODEL_FILE, portable.prefill_file])
        log(f"graph built and weights written in {time.perf_counter() - t0:.1f} s")
        if gguf:
            quant_used = "keep" if keep else (portable.weights if portable else scheme.weights)
            sources, origin = {src.name: sha256_file(src)}, gguf_import.origin(ckpt, quant_used, src_tensors.requantized,
                                                                           src_tensors.kept_types)
            if origin.kept_exact:
                log(f"kept exactly as in the file: {', '.join(origin.kept_exact)} blocks")
            if origin.requantized:
                log(f"not kept as their blocks ({len(origin.requantized)} tensors: a type we cannot keep, or mixed "
                    "with one in a stacked projection): "
                    + "; ".join(origin.requantized[:3]) + (" ..." if len(origin.requantized) > 3 else ""))
        else:
            tokenizer_files = [n for n in TOKENIZER_FILES if (src / n).exists()]
            for name in tokenizer_files:
                regular_file(src / name)  # not a link to /dev/zero (copied until the disk filled) or a FIFO
                shutil.copyfile(src / name, tmp / name)
            names = ["config.json", *[f.name for f in ckpt.files], *tokenizer_files]
            if (src / "model.safetensors.index.json").exists():
                names.append("model.safetensors.index.json")
            sources = {n: sha256_file(src / n) for n in names}
            origin = Origin(format="huggingface", file=src.name)
        outputs = [*graphs, DATA_FILE, *tokenizer_files]
        files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in outputs}
        manifest = Manifest(
            arch=spec, quantization=scheme, target=target, flavour="fused" if portable is None else "portable",
            interface=graph_interface(spec, mode, kv_dtype) if portable is None else portable_interface(spec, portable),
            tokenizer=tokenizer, portable=portable, origin=origin,
            default_capacity_tokens=min(spec.max_position_embeddings, MAX_DEFAULT_CAPACITY,
                                        portable.capacity_tokens if portable else MAX_DEFAULT_CAPACITY),
            files=files, source=sources, converter_version=__version__,
        )
        manifest.write(tmp)
        check_tokenizer(tmp, manifest, log)
        if ngram_tokens:
            manifest = add_ngram_table(tmp, manifest, ngram_tokens, log)
        _replace_atomically(tmp, dst, force)
        return manifest
    finally:
        try:
            if writer is not None:
                writer.close()
        finally:
            discard(tmp, made)


__all__ = ["convert", "default_scheme", "QuantScheme"]

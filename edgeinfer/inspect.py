"""`edgeinfer inspect`: a model folder's manifest in words (or as JSON), its files' hashes
(`--verify`), or with `--platform` this device's profile (`edgeinfer.platform_report`)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from edgeinfer.arch import ArchSpec
from edgeinfer.errors import EdgeInferError, InvalidArgumentError, ModelFormatError
from edgeinfer.integrity import STAMP_FILE, check
from edgeinfer.manifest import CHECKSUM_KEY, MANIFEST_FILE, Manifest, read_manifest
from edgeinfer.overflow import DEFAULT_PREFILL_CHUNK, resolve_capacity
from edgeinfer.terminal import printable


def parameter_count(a: ArchSpec) -> int:
    """The checkpoint's parameters (at its own head size: widened heads' zeros are not parameters)."""
    D, I, V, Dh = a.hidden_size, a.intermediate_size, a.vocab_size, a.source_head_dim or a.head_dim
    attn = D * a.num_heads * Dh * 2 + D * a.num_kv_heads * Dh * 2
    attn += (a.num_heads + 2 * a.num_kv_heads) * Dh if a.qkv_bias else 0
    attn += D if a.o_bias else 0
    attn += 2 * Dh if a.qk_norm else 0
    layer = attn + 3 * D * I + 2 * D
    return V * D * (1 if a.tie_word_embeddings else 2) + a.num_layers * layer + D


def summary(folder: Path | str) -> dict:
    return _summary(Path(folder), read_manifest(folder))


def _quantization(m: Manifest) -> dict:
    """The weights' scheme as the graph holds it: a portable folder's int8 is per output channel
    (DequantizeLinear), its embedding a host table (fp16, or fp32 beside fp32 weights), whatever
    scheme its manifest's quantization section carries (the fused graph's defaults)."""
    p = m.portable
    if p is None:  # every field, defaults included (the manifest leaves out a default recipe and scale dtype)
        q = m.quantization
        return {**q.to_json(), "recipe": None if _kept(m) else q.recipe, "scale_dtype": _scale_dtype(m)}
    return {"weights": p.weights, "per": "output channel" if p.weights == "int8" else None,
            "embedding": "fp32" if p.weights == "fp32" else "fp16", "embedding_on_host": True}


def kv_bytes_per_token(m: Manifest) -> int:
    """K and V bytes of one token across the layers, in the ring's dtype (float16 for a cuda folder)."""
    return m.arch.kv_bytes_per_token * (2 if m.interface.kv_dtype == "float16" else 4) // 4


def kv_at_load(m: Manifest, capacity: int) -> tuple[int, int]:
    """(rows, bytes) of one KV ring as `load` allocates it for `capacity` tokens: the ring and its
    overflow rows (a prefill call's, DEFAULT_PREFILL_CHUNK by default), or a portable graph's fixed R."""
    rows = m.portable.ring_rows if m.portable is not None else capacity + min(DEFAULT_PREFILL_CHUNK, capacity)
    return rows, kv_bytes_per_token(m) * rows


def _kept(m: Manifest) -> bool:
    """A GGUF's own blocks all taken over (`--quant keep`, none re-quantized to int4): no recipe of
    ours rounded them."""
    o = m.origin
    return o is not None and o.quant == "keep" and not any(r.endswith("-> int4") for r in o.requantized)


def _scale_dtype(m: Manifest) -> str:
    """The block scales as the graph holds them: a cuda folder's float16 pass makes them float16
    whatever the manifest's scheme (float32, the scheme it was built from) says."""
    q = m.quantization
    return "float16" if m.target == "cuda" and q.weights in ("int4", "int8") else q.scale_dtype


def _file_sizes(folder: Path, m: Manifest) -> tuple[int, int, list[str]]:
    """(the model's bytes, its graph files' bytes, problems) from the files the manifest lists, as
    converted, each checked by its size alone (`inspect --verify` reads every byte): a missing or
    resized file is a problem, a file the manifest does not list (a backup, notes) is not the model.
    An older manifest that lists none: every file in the folder, unchecked."""
    if not m.files:
        files = [p for p in folder.iterdir() if p.is_file() and p.name != STAMP_FILE]
        return (sum(p.stat().st_size for p in files),
                sum(p.stat().st_size for p in files if p.name.startswith("model.onnx")), [])
    problems, sizes = [], {}
    for name, want in m.files.items():
        size = want.get("bytes") if isinstance(want, dict) else None
        if not isinstance(name, str) or Path(name).name != name or "\0" in name or type(size) is not int or \
                not 0 <= size < 1 << 50:  # (10**30 bytes was added up and shown)
            problems.append(f"the manifest's entry {name!r:.60} is malformed")
            continue
        sizes[name] = size
        try:
            st = (folder / name).stat()
            got = st.st_size if stat.S_ISREG(st.st_mode) else None
        except OSError:
            got = None
        if got is None:
            problems.append(f"{name} is missing or not a regular file")
        elif got != size:
            problems.append(f"{name} is {got} bytes, the manifest says {size}")
    return sum(sizes.values()), sum(b for n, b in sizes.items() if n.startswith("model.onnx")), problems


def _summary(folder: Path, m: Manifest) -> dict:
    a = m.arch
    disk, weight_bytes, problems = _file_sizes(folder, m)
    from edgeinfer.platforms import detect, device_capacity_tokens
    profile = detect().profile
    device = device_capacity_tokens(m.portable is not None, profile)
    load_capacity = resolve_capacity(m.default_capacity_tokens, a, None, device)
    kv_per_token = kv_bytes_per_token(m)
    rows, kv_bytes = kv_at_load(m, load_capacity)
    return {
        "family": a.family, "parameters": parameter_count(a), "layers": a.num_layers, "hidden_size": a.hidden_size,
        "heads": a.num_heads, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
        "source_head_dim": a.source_head_dim, "vocab_size": a.vocab_size,
        "tied_embeddings": a.tie_word_embeddings, "quantization": _quantization(m), "target": m.target,
        "flavour": m.flavour, "kv_mode": m.interface.kv_mode.name, "attention": m.interface.kv_mode.description,
        "size_on_disk_bytes": disk, "kv_bytes_per_token": kv_per_token,
        "default_capacity_tokens": m.default_capacity_tokens,
        "load_capacity_tokens": load_capacity,  # what `load` allocates without capacity_tokens here (`resolve_capacity`)
        "device_profile": profile.name, "device_capacity_tokens": device,  # (None: a portable model's is its own)
        "kv_rows_at_load": rows, "kv_bytes_at_default_capacity": kv_bytes,
        "tokenizer": m.tokenizer.kind, "format_version": m.format_version, "converter_version": m.converter_version,
        "kv_dtype": m.interface.kv_dtype, "portable": m.portable.to_json() if m.portable is not None else None,
        "origin": m.origin.to_json() if m.origin is not None else None,
        "ngrams": m.ngrams.to_json() if m.ngrams is not None else None,
        "bits_per_weight": round(weight_bytes * 8 / parameter_count(a), 2),  # the graph files over every parameter
        "file_problems": problems,
    }


def origin_line(m: Manifest) -> str:
    """Where the weights came from, in words (a folder converted before origins were recorded: unknown)."""
    o = m.origin
    if o is None:
        return "not recorded (converted by an older edgeinfer)"
    if o.format != "gguf":
        return {"huggingface": "Hugging Face folder", "optimum": "Optimum ONNX export"}.get(o.format, o.format) \
            + (f" {o.file}" if o.file else "")
    types = ", ".join(f"{t} x{n}" for t, n in o.tensor_types.items())
    if o.quant != "keep":
        kept = f"; every tensor re-quantized ({o.quant})" if o.quant else ""
    else:
        kept = f"; kept exactly: {', '.join(o.kept_exact)}" if o.kept_exact else "; no tensor's blocks kept exactly"
    requant = f"; re-quantized: {len(o.requantized)} tensors ({o.requantized[0]}{', ...' if len(o.requantized) > 1 else ''})" \
        if o.requantized else ""
    return f"GGUF {o.file} ({types}){kept}{requant}"


def describe(folder: Path | str, as_json: bool = False) -> str:
    m = read_manifest(folder)
    s = _summary(Path(folder), m)
    if as_json:
        return json.dumps(s, indent=1)
    q = m.quantization
    mixed = f", int8 for {', '.join(q.int8_tensors)}" if q.int8_tensors else ""
    recipe = f", recipe {q.recipe}" if q.weights == "int4" and not _kept(m) else ""
    scales = ", fp16 scales" if _scale_dtype(m) == "float16" else ""
    blocks = f" (block {q.block_size}, {'symmetric' if q.symmetric else 'asymmetric'}, " \
             f"accuracy_level {q.accuracy_level}{mixed}{recipe}{scales})" if q.weights in ("int4", "int8") else ""
    widened = f" (widened from {s['source_head_dim']} for GroupQueryAttention)" if s["source_head_dim"] else ""
    cap = s["load_capacity_tokens"]
    cap_why = f"this device's profile, {s['device_profile']}" if cap == s["device_capacity_tokens"] else \
        "the sliding window less one" if cap == (m.arch.sliding_window or 0) - 1 else \
        "the trained length less a sixteenth, room to re-base"
    rows = s["kv_rows_at_load"]
    kv_rows = f"{rows} rows, fixed by the graphs" if m.portable is not None else f"+{rows - cap} overflow rows"
    return "\n".join(map(printable, [  # the manifest's strings are the folder's (escapes not passed to the terminal)
        f"{folder}",
        f"  architecture  {s['family']}: {s['parameters'] / 1e6:.2f} M parameters, {s['layers']} layers, "
        f"hidden {s['hidden_size']}, {s['heads']} heads / {s['kv_heads']} KV heads x {s['head_dim']}{widened}, "
        f"vocab {s['vocab_size']}{', tied embeddings' if s['tied_embeddings'] else ''}",
        f"  quantization  weights {q.weights}{blocks}; embedding {q.embedding}, lm_head {q.lm_head}; "
        f"{s['bits_per_weight']} bits per weight"
        if m.portable is None else
        f"  quantization  weights {m.portable.weights}"
        f"{' per output channel (DequantizeLinear)' if m.portable.weights == 'int8' else ''}; embedding rows on "
        f"the host ({m.portable.embeddings_file})",
        *([f"  graphs        model.onnx (1 token) and {m.portable.prefill_file} ({m.portable.prefill_tokens} tokens), "
           f"ring of {m.portable.capacity_tokens} tokens at most (+{m.portable.prefill_tokens} overflow rows)"]
          if m.portable is not None else []),
        f"  graph         {s['flavour']} flavour for {s['target']}, format v{s['format_version']}; attention: "
        f"{s['attention']} (KV mode {s['kv_mode']})",
        f"  size on disk  {s['size_on_disk_bytes'] / 1e6:.2f} MB",
        *([f"  files         WARNING: {'; '.join(s['file_problems'])} (edgeinfer inspect --verify checks every byte)"]
          if s["file_problems"] else []),
        f"  KV cache      {s['kv_bytes_per_token']} bytes per token ({s['kv_dtype']}); "
        f"{s['kv_bytes_at_default_capacity'] / 1e6:.2f} MB at the default capacity of {cap} ({kv_rows})"
        + (f" ({cap_why}; the manifest says {s['default_capacity_tokens']})"
           if cap != s['default_capacity_tokens'] else ""),
        f"  tokenizer     {s['tokenizer']}",
        *([f"  drafts        n-gram table of {m.ngrams.contexts:,} contexts, counted on {m.ngrams.tokens:,} tokens "
           f"of the model's own text ({m.ngrams.file}; speculative=\"ngram\" drafts from it)"]
          if m.ngrams is not None else []),
        f"  source        {origin_line(m)}",
    ]))


def verify(folder: Path | str, out=print) -> bool:
    """Hash every file edgeinfer.json lists, ignoring verification stamps, and `out` one line per
    file as it is checked ("ok  NAME" or "MISMATCH  NAME: problem"). True when every file matches.
    Raises ModelFormatError for a manifest without file checksums (made by hand: every converter
    of ours writes them)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    files = manifest.files
    if not files:
        raise ModelFormatError(f"{folder / MANIFEST_FILE} lists no file checksums (not a converter's): "
                               "nothing to verify; convert again")
    ok = True
    out(f"ok        {MANIFEST_FILE} (its {CHECKSUM_KEY})" if manifest.checksum else
        f"note      {MANIFEST_FILE}: no {CHECKSUM_KEY} (an older converter, or deleted): its fields are not checked")
    for name, problem in check(folder, files, manifest.named_files):
        ok = ok and problem is None
        out(printable(f"ok        {name}" if problem is None else f"MISMATCH  {name}: {problem}"))
    if ok:  # is the manifest what the graphs say? (load's own checks; a portable folder's both graphs and its
        from edgeinfer.ngram_table import NgramTable  # host embeddings, as its engine opens them; the n-gram table)
        from edgeinfer.portable_engine import PortableEngine
        from edgeinfer.session import DecoderSession
        from edgeinfer.tokenizer import Tokenizer

        try:
            session = DecoderSession(folder, threads=1, provider="cpu", manifest=manifest, hashed=True)
            if manifest.portable is not None:
                PortableEngine(session, threads=1)
            Tokenizer(folder, manifest.tokenizer)
            if manifest.ngrams is not None and manifest.portable is None:  # as the engine reads it
                NgramTable.read(folder / manifest.ngrams.file, manifest.arch.vocab_size, manifest.ngrams.contexts)
            out("ok        loads (graph inputs and outputs, tokenizer ids: as the manifest describes)")
        except EdgeInferError as e:
            ok = False
            out(printable(f"MISMATCH  {MANIFEST_FILE}: {e}"))
    return ok


def run(model: Path | None, as_json: bool = False, verify_files: bool = False, platform: bool = False,
        root: Path | None = None, out=print) -> int:
    """`edgeinfer inspect`: with `platform`, the device profile report (`root`: a recorded device);
    else `verify` or `describe` the model folder. Returns the exit status; a missing model folder
    without `platform`, or `root` without it, is an InvalidArgumentError."""
    if platform:
        from edgeinfer.platform_report import inspect_platform

        return inspect_platform(model, root, verify_files, as_json, out)
    if root is not None:
        raise InvalidArgumentError("--root names a recorded device: it goes with --platform")
    if model is None:
        raise InvalidArgumentError("inspect needs a model folder (or --platform for this device's profile)")
    if verify_files:
        return 0 if verify(model, out=out) else 1
    out(describe(model, as_json=as_json))
    return 0

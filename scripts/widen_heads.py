"""Rewrite a Llama checkpoint with a wider head (e.g. stories260K's 8 -> 16) computing the same function.

    python scripts/widen_heads.py models/stories260K -o /tmp/stories260K-dh16 [--head-dim 16]

Why: ONNX Runtime's CPU GroupQueryAttention needs a head size that is a multiple of 16, and the only
small *trained* model we ship has 8. Widening makes the real model run on the GQA path, so ring tests
on that path measure a real model's perplexity instead of a random one's.

How (exact in real arithmetic): rotate-half RoPE pairs dim j with dim j + Dh/2 at frequency
theta^(-2j/Dh). In the wider head of size W = m * Dh, dim pair m*j (with m*j + W/2) has frequency
theta^(-2mj/W) = theta^(-2j/Dh): the original pair's. So original dims j and j + Dh/2 go to m*j and
m*j + W/2, every other new dim is zero in q, k and v (and zero columns of o_proj read them), scores
are unchanged, and q is scaled by sqrt(W / Dh) to undo the softmax scale 1/sqrt(W).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _read(src: Path) -> dict[str, np.ndarray]:
    import sys

    sys.path.insert(0, str(ROOT))
    from edgeinfer.converters.safetensors_io import Checkpoint

    ckpt = Checkpoint(src)
    return {n: ckpt.read(n) for n in ckpt.tensors}


def _write(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def widen(src: Path, dst: Path, head_dim: int = 16) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "llama" or cfg.get("attention_bias"):
        raise SystemExit("only Llama checkpoints without attention bias are supported")
    D, H, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or D // H
    if head_dim % dh or head_dim <= dh:
        raise SystemExit(f"--head-dim must be a multiple of {dh} larger than it")
    m, half, wide_half = head_dim // dh, dh // 2, head_dim // 2
    where = np.concatenate([m * np.arange(half), wide_half + m * np.arange(half)])  # new index of old dim j

    def rows(w: np.ndarray, heads: int, scale: float = 1.0) -> np.ndarray:  # [heads*dh, D] -> [heads*W, D]
        out = np.zeros((heads, head_dim, w.shape[1]), np.float32)
        out[:, where] = w.reshape(heads, dh, -1) * scale
        return out.reshape(heads * head_dim, -1)

    t = _read(src)
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn"
        t[f"{a}.q_proj.weight"] = rows(t[f"{a}.q_proj.weight"], H, float(np.sqrt(head_dim / dh)))
        t[f"{a}.k_proj.weight"] = rows(t[f"{a}.k_proj.weight"], Hkv)
        t[f"{a}.v_proj.weight"] = rows(t[f"{a}.v_proj.weight"], Hkv)
        o = np.zeros((D, H, head_dim), np.float32)
        o[:, :, where] = t[f"{a}.o_proj.weight"].reshape(D, H, dh)
        t[f"{a}.o_proj.weight"] = o.reshape(D, H * head_dim)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "README.md"))
    cfg["head_dim"] = head_dim
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    _write(dst / "model.safetensors", t)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--head-dim", type=int, default=16)
    args = ap.parse_args()
    print(widen(args.src, args.output, args.head_dim))


if __name__ == "__main__":
    main()

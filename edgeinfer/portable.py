"""The portable flavour's shared facts (`convert --target coreml|nnapi`; graphs in
converters/portable.py, run by `portable_engine.PortableEngine`): the manifest's `portable`
section, the vocabulary chunks, and the host-side inputs the graphs take instead of the ops the
mobile execution providers lack (embedding gather, RoPE tables, the attention mask)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.errors import InvalidArgumentError
from edgeinfer.fields import FieldError, json_fields

MAX_DIM = 16384  # CoreML's largest tensor dimension
MASK_VALUE = -1e9  # additive mask for a column a query may not see (finite: no NaN on an all-masked pad row)
PORTABLE_TARGETS = ("coreml", "nnapi")
PREFILL_FILE = "prefill.onnx"
EMBEDDINGS_FILE = "embeddings.npy"


def logit_chunks(vocab_size: int) -> list[tuple[int, int]]:
    """[lo, hi) of each logits output: the vocabulary in equal chunks of at most MAX_DIM."""
    n = -(-vocab_size // MAX_DIM)
    step = -(-vocab_size // n)
    return [(lo, min(lo + step, vocab_size)) for lo in range(0, vocab_size, step)]


@dataclass(frozen=True)
class PortableInfo:
    """The manifest's `portable` section: the graphs' fixed geometry and files."""

    capacity_tokens: int  # the ring the graphs were built for (a smaller one loads; a larger one does not)
    prefill_tokens: int  # P: the prefill graph's chunk
    weights: str  # fp32 | fp16 | int8
    prefill_file: str = PREFILL_FILE
    embeddings_file: str = EMBEDDINGS_FILE

    @property
    def ring_rows(self) -> int:
        """R: the KV rows the graphs read (the ring plus one chunk of overflow rows)."""
        return self.capacity_tokens + self.prefill_tokens

    def check_capacity(self, capacity_tokens: int) -> None:
        """A ring larger than the graphs were built for is refused (InvalidArgumentError)."""
        if capacity_tokens > self.capacity_tokens:
            raise InvalidArgumentError(
                f"capacity_tokens={capacity_tokens} is over the {self.capacity_tokens} this portable model was "
                f"built for: use a capacity up to {self.capacity_tokens}, or convert again with --capacity")

    def to_json(self) -> dict:
        return {"capacity_tokens": self.capacity_tokens, "prefill_tokens": self.prefill_tokens,
                "weights": self.weights, "prefill_file": self.prefill_file, "embeddings_file": self.embeddings_file}

    @classmethod
    def from_json(cls, d: dict, where: str = "portable") -> "PortableInfo":
        info = cls(**json_fields(cls, d, where))
        if info.capacity_tokens < 2 or info.prefill_tokens < 2:
            raise FieldError(where, "capacity_tokens and prefill_tokens must be at least 2")
        if info.weights not in ("fp32", "fp16", "int8"):
            raise FieldError(f"{where}.weights", f"unknown {info.weights!r}")
        for key in ("prefill_file", "embeddings_file"):
            name = getattr(info, key)
            if not name or name != name.strip() or "/" in name or "\\" in name or name in (".", "..", "model.onnx"):
                raise FieldError(f"{where}.{key}", f"{name!r} is not a plain file name in the folder")
        return info


def rope_inputs(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin_signed) [1, 1, S, Dh] for `positions` [S]: angles in float64, both halves; the
    sine's first half negated, so the graph's rotate-half is x * cos + [x2, x1] * sin_signed."""
    ang = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    return (np.concatenate([cos, cos], -1)[None, None].astype(np.float32),
            np.concatenate([-sin, sin], -1)[None, None].astype(np.float32))


def attention_mask(n_valid: int, s: int, s_graph: int, ring_rows: int, groups: int) -> np.ndarray:
    """[1, 1, groups * s_graph, ring_rows + s_graph]: query i (of s real ones, padded to s_graph)
    sees ring slots [0, n_valid) and new rows j <= i; padded rows see only themselves."""
    m = np.full((s_graph, ring_rows + s_graph), MASK_VALUE, np.float32)
    m[:s, :n_valid] = 0.0
    new = m[:, ring_rows:]
    new[np.tril_indices(s)] = 0.0
    for i in range(s, s_graph):
        new[i, i] = 0.0
    return np.tile(m, (groups, 1))[None, None]

"""Perplexity, by the method of the stories260K `eval_ppl.json`.

1. Every non-empty line of the text is one story; ids = [BOS] + encode(story) (no EOS).
2. The ids are cut into consecutive non-overlapping windows of at most `window` tokens.
3. Each window is one forward pass from position 0 with an empty cache.
4. Within a window every token but the first is scored: NLL = -log_softmax(logits[t-1])[ids[t]] (float32).
5. perplexity = exp(sum NLL / number of scored tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.session import DecoderSession
from edgeinfer.tokenizer import Tokenizer


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    scored_tokens: int
    n_stories: int
    n_windows: int
    eval_s: float

    def to_json(self) -> dict:
        return {"perplexity": self.perplexity, "mean_nll_nats_per_token": self.mean_nll,
                "scored_tokens": self.scored_tokens, "n_stories": self.n_stories, "n_windows": self.n_windows,
                "eval_s": round(self.eval_s, 3)}


def window_nll(session: DecoderSession, ids: list[int]) -> tuple[float, int]:
    """Sum of NLL over ids[1:] given the prefix, one forward pass from position 0."""
    n = len(ids)
    if n < 2:
        return 0.0, 0
    x = np.asarray([ids], np.int64)
    logits, _ = session.forward(x, np.arange(n, dtype=np.int64)[None], session.empty_past(),
                                np.arange(n - 1, dtype=np.int64))
    lg = logits[0]  # [n-1, V] float32
    m = lg.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(lg - m).sum(axis=-1, keepdims=True)))[:, 0]
    picked = lg[np.arange(n - 1), x[0, 1:]]
    return float(np.sum((lse - picked).astype(np.float64))), n - 1


def perplexity(model_dir: Path | str, text_path: Path | str, *, window: int = 512, threads: int | None = None,
               session: DecoderSession | None = None) -> PerplexityResult:
    if window < 2:
        raise EdgeInferError(f"--window must be at least 2, got {window}")
    text_path = Path(text_path)
    if not text_path.is_file():
        raise EdgeInferError(f"text file not found: {text_path}")
    try:
        stories = [line for line in text_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise EdgeInferError(f"{text_path} is not UTF-8 text") from None
    if not stories:
        raise EdgeInferError(f"{text_path} has no non-empty line to score")
    session = session or DecoderSession(model_dir, threads=threads)
    tok = Tokenizer(session.folder, session.manifest.tokenizer)
    t0 = time.perf_counter()
    total, count, windows = 0.0, 0, 0
    for story in stories:
        ids = tok.encode(story, add_bos=True)
        for start in range(0, len(ids), window):
            nll, n = window_nll(session, ids[start:start + window])
            total, count, windows = total + nll, count + n, windows + 1
    if count == 0:
        raise EdgeInferError(f"{text_path}: no token to score")
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, len(stories), windows, time.perf_counter() - t0)

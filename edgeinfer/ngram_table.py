"""The model's n-gram table: drafts for speculative decoding from text the model wrote itself.

Prompt lookup (`drafting.NgramDrafter`) drafts only where the prompt or the reply repeats itself.
A small model's text also repeats the model's own habits ("Once upon a time, there was a little"),
which its prompt need not hold. So, at convert time (`convert --ngram-tokens N`), the converted
model samples N tokens of its own text (`sample_text`: temperature 1, from its BOS, seeds 0, 1, ...,
so a conversion is reproducible), and `NgramTable.build` keeps, for each context of 1 to 3 tokens
seen there, the token that followed it most often, how often, and how often the context was seen
(a context whose most frequent follower was seen fewer than `MIN_COUNT` times is dropped: its draft
would be a guess). The table is saved beside the graph (`FILE`, an .npz of plain arrays), named in
the manifest's `ngrams` section and checked by sha256 like the other files; a folder without one
drafts from the prompt alone, as before.

`chain(history, k)`: up to k drafts, each the most frequent follower of the longest context (3
tokens, then 2, then 1) that ends the history followed by the drafts before it, with the chance
that it and every draft before it are accepted: the product of count / (seen + 1) over the chain
(a context seen once gives 1/2, not certainty). The chain stops where that chance falls below
`MIN_CHANCE`, a draft no rule would verify. The stepper (`speculative.py`) weighs these chances
against prompt lookup's and keeps the drafts that pay.

Drafts decide no token: the verify call computes the logits plain decoding would, so a table only
changes how fast the tokens come, never which (fp32; see speculative.py for accuracy level 4).
"""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer import small_files
from edgeinfer.errors import ModelFormatError
from edgeinfer.fields import FieldError, json_fields

FILE = "ngrams.npz"
ORDERS = (1, 2, 3)  # context lengths, longest tried first
MIN_COUNT = 2  # a context's most frequent follower, seen fewer times than this, is not kept
MIN_CHANCE = 0.05  # a chain stops at a draft accepted with less chance than this
SAMPLE_TOKENS_PER_TEXT = 256  # each seed's text ends at EOS or after this many tokens
MAX_FILE_BYTES = 256 * 1024 * 1024  # a table of millions of contexts is tens of MB
LOG_EVERY_S = 10.0  # sample_text's progress lines


@dataclass(frozen=True)
class NgramInfo:
    """The manifest's `ngrams` section: the table's file and how it was made."""

    file: str = FILE
    tokens: int = 0  # tokens of the model's own text it was counted on
    contexts: int = 0  # contexts kept (all orders)
    temperature: float = 1.0

    def to_json(self) -> dict:
        return {"file": self.file, "tokens": self.tokens, "contexts": self.contexts,
                "temperature": self.temperature}

    @classmethod
    def from_json(cls, d: dict, where: str = "ngrams") -> "NgramInfo":
        info = cls(**json_fields(cls, d, where))
        name = info.file
        if not name or name != name.strip() or "/" in name or "\\" in name or name in (".", "..", "model.onnx"):
            raise FieldError(f"{where}.file", f"{name!r} is not a plain file name in the folder")
        for key in ("tokens", "contexts"):
            if getattr(info, key) < 0:
                raise FieldError(f"{where}.{key}", f"expected a count, got {getattr(info, key)}")
        return info


class NgramTable:
    """Context (a tuple of 1-3 ids) -> (most frequent follower, chance it follows). Read-only once
    built: requests on several threads share one."""

    def __init__(self, arrays: dict[str, np.ndarray], vocab_size: int):
        """arrays: per order n, `context_n` [m, n] int32, `next_n`, `count_n`, `seen_n` [m] (what `build`
        makes and `save` writes); checked here (ModelFormatError naming the array)."""
        self.vocab_size = vocab_size
        self.arrays = arrays
        self._follow: dict[tuple[int, ...], tuple[int, float]] = {}
        for n in ORDERS:
            ctx, nxt, count, seen = (_array(arrays, f"{k}_{n}") for k in ("context", "next", "count", "seen"))
            m = len(nxt)
            if ctx.shape != (m, n) or count.shape != (m,) or seen.shape != (m,):
                raise ModelFormatError(f"order {n}: context {ctx.shape}, next {nxt.shape}, count {count.shape}, "
                                       f"seen {seen.shape} do not agree")
            if m and (min(ctx.min(initial=0), nxt.min()) < 0 or max(ctx.max(initial=0), nxt.max()) >= vocab_size):
                raise ModelFormatError(f"order {n}: a token id outside the vocabulary [0, {vocab_size})")
            if m and (count.min() < 1 or (count > seen).any()):
                raise ModelFormatError(f"order {n}: a follower counted 0 times, or more often than its context")
            chance = count / (seen + 1.0)
            self._follow.update(zip(map(tuple, ctx.tolist()), zip(nxt.tolist(), chance.tolist())))
        if len(self._follow) != sum(len(arrays[f"next_{n}"]) for n in ORDERS):
            raise ModelFormatError("a context is listed twice")

    def __len__(self) -> int:
        return len(self._follow)

    @classmethod
    def build(cls, texts: Sequence[Sequence[int]], vocab_size: int, min_count: int = MIN_COUNT) -> "NgramTable":
        """Count every context of `ORDERS` tokens within each text and what followed it; keep those
        whose most frequent follower was seen at least `min_count` times (ties: the lowest id)."""
        arrays = {}
        for n in ORDERS:
            rows = [np.lib.stride_tricks.sliding_window_view(np.asarray(t, np.int64), n + 1)
                    for t in texts if len(t) > n]
            grams = np.concatenate(rows) if rows else np.zeros((0, n + 1), np.int64)
            uniq, counts = np.unique(grams, axis=0, return_counts=True)  # each (context, follower) once
            ctx, group = np.unique(uniq[:, :n], axis=0, return_inverse=True)
            group = group.reshape(-1)
            seen = np.bincount(group, weights=counts, minlength=len(ctx)).astype(np.int64)
            order = np.lexsort((uniq[:, n], -counts, group))  # by context, most frequent follower first, lowest id
            best = order[np.r_[0, np.flatnonzero(np.diff(group[order])) + 1]] if len(order) else order
            keep = counts[best] >= min_count
            arrays[f"context_{n}"] = ctx[keep].astype(np.int32).reshape(-1, n)
            arrays[f"next_{n}"] = uniq[best[keep], n].astype(np.int32)
            arrays[f"count_{n}"] = counts[best[keep]].astype(np.uint32)
            arrays[f"seen_{n}"] = seen[keep].astype(np.uint32)
        return cls(arrays, vocab_size)

    def save(self, path) -> None:
        np.savez_compressed(path, **self.arrays)

    @classmethod
    def read(cls, path, vocab_size: int) -> "NgramTable":
        """The table in `path` (ModelFormatError naming it when it is not one)."""
        try:
            raw = small_files.read_bytes(Path(path), MAX_FILE_BYTES, ModelFormatError)  # a regular file, bounded
            z = np.load(io.BytesIO(raw), allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy array under the name
                raise ModelFormatError("an .npy array, not an .npz archive")
            with z:
                arrays = {k: z[k] for k in z.files}
            return cls(arrays, vocab_size)
        except (ModelFormatError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ModelFormatError(f"{path} is not a valid n-gram table ({why}): convert the model again") from None

    def chain(self, history: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        """Up to k drafts after `history` and, for each, the chance that it and all before it are accepted."""
        tail = list(history[-ORDERS[-1]:])
        drafts: list[int] = []
        chances: list[float] = []
        chance = 1.0
        follow = self._follow
        while len(drafts) < k:
            hit = None
            for n in ORDERS[::-1]:
                if len(tail) >= n:
                    hit = follow.get(tuple(tail[-n:]))
                    if hit is not None:
                        break
            if hit is None or chance * hit[1] < MIN_CHANCE:
                break
            chance *= hit[1]
            drafts.append(hit[0])
            chances.append(chance)
            tail = tail[1:] + [hit[0]] if len(tail) == ORDERS[-1] else tail + [hit[0]]
        return drafts, chances


def _array(arrays: dict, key: str) -> np.ndarray:
    a = arrays.get(key)
    if not isinstance(a, np.ndarray):
        raise ModelFormatError(f"no array {key}")
    if a.dtype.kind not in "iu":
        raise ModelFormatError(f"{key} is {a.dtype}, not integers")
    return a.astype(np.int64)


def sample_text(model, tokens: int, log=lambda msg: None) -> list[list[int]]:
    """`tokens` tokens of the model's own text (a `Model`): texts from its BOS (else its first EOS id, a
    document boundary) at temperature 1, seed 0, 1, ..., each to EOS or `SAMPLE_TOKENS_PER_TEXT`."""
    tok = model.manifest.tokenizer
    start = tok.bos_token_id if tok.bos_token_id is not None else (tok.eos_token_ids or (None,))[0]
    if start is None:
        raise ValueError("the model has no BOS or EOS id to start its own text from")
    texts, total, seed = [], 0, 0
    said = time.monotonic()
    while total < tokens:
        n = min(SAMPLE_TOKENS_PER_TEXT, tokens - total)
        ids = list(model.generate([start], max_new_tokens=n, temperature=1.0, top_p=1.0, top_k=0,
                                  seed=seed).token_ids)
        texts.append([start] + ids)
        total += len(ids)
        seed += 1
        if time.monotonic() - said > LOG_EVERY_S:
            log(f"n-gram table: {total:,} of {tokens:,} tokens sampled")
            said = time.monotonic()
    return texts

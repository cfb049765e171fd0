"""The model's n-gram table: drafts for speculative decoding from text the model wrote itself.

Prompt lookup (`drafting.NgramDrafter`) drafts only where the prompt or the reply repeats itself.
A small model's text also repeats the model's own habits ("Once upon a time, there was a little"),
which its prompt need not hold. So, at convert time (`convert --ngram-tokens N`), the converted
model samples N tokens of its own text (`sample_text`: temperature 1, from its BOS, seeds 0, 1, ...,
so a conversion is reproducible), and `count_ngrams` keeps, for each context of 1 to 3 tokens
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

import hashlib
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
ARRAYS = ("context", "next", "count", "seen")  # per order n: [m, n], [m], [m], [m] integers
MIN_COUNT = 2  # a context's most frequent follower, seen fewer times than this, is not kept
MIN_CHANCE = 0.05  # a chain stops at a draft accepted with less chance than this
SAMPLE_TOKENS_PER_TEXT = 256  # each seed's text ends at EOS or after this many tokens
MAX_CONTEXTS = 1_000_000  # a table's contexts, all orders (100,000 tokens of stories260K's text make 10,953)
MAX_FILE_BYTES = 64 * 1024 * 1024  # MAX_CONTEXTS are at most 24 MB of 32-bit arrays before compression
MAX_INFO_TOKENS = 10 ** 12
LOG_EVERY_S = 10.0  # sample_text's progress lines
MEMO_DRAFTS = 16  # `chain` remembers this many drafts per tail (the stepper asks for 8 at most)
MEMO_TAILS = 8_192  # ... for this many tails: a hit costs 0.25 us, a miss 1.8 us (the bundled table)
BYTES_PER_CONTEXT = 300  # a context at its read's peak (tracemalloc: 193-261, the most for counts near 2**32);
# held once read: 96-121 (packed ints; 298-403 as tuples before)
BYTES_PER_TAIL = 1024  # a remembered chain, at most: 397-465 measured for the bundled table's (4 drafts on
# average), 1,004 for chains of 16 drafts of a 151,936-id vocabulary; 65,536 tails, the bound before, were
# 26-66 MB where its comment said a few


def memory_bytes(contexts: int) -> int:
    """What a table of `contexts` contexts holds once read, its memo full: a bound from the figures above
    (the daemon's memory limit counts it, `cli_serve`)."""
    return contexts * BYTES_PER_CONTEXT + MEMO_TAILS * BYTES_PER_TAIL


@dataclass(frozen=True)
class NgramInfo:
    """The manifest's `ngrams` section: the table's file and how it was made."""

    file: str = FILE
    tokens: int = 0  # tokens of the model's own text it was counted on
    contexts: int = 0  # contexts kept (all orders): the table must hold this many
    temperature: float = 1.0

    def to_json(self) -> dict:
        return {"file": self.file, "tokens": self.tokens, "contexts": self.contexts,
                "temperature": self.temperature}

    @classmethod
    def from_json(cls, d: dict, where: str = "ngrams") -> "NgramInfo":
        info = cls(**json_fields(cls, d, where))
        name = info.file
        if not name.endswith(".npz") or name != name.strip() or "/" in name or "\\" in name or "\0" in name:
            raise FieldError(f"{where}.file", f"{name!r} is not a plain .npz file name in the folder")
        for key, top in (("tokens", MAX_INFO_TOKENS), ("contexts", MAX_CONTEXTS)):
            if not 0 <= getattr(info, key) <= top:
                raise FieldError(f"{where}.{key}", f"expected a count of at most {top}, got {getattr(info, key)!r:.40}")
        if not 0 <= info.temperature <= 100:
            raise FieldError(f"{where}.temperature", f"expected 0..100, got {info.temperature}")
        return info


def count_ngrams(texts: Sequence[Sequence[int]], min_count: int = MIN_COUNT) -> dict[str, np.ndarray]:
    """The table's arrays: every context of `ORDERS` tokens within each text and what followed it,
    kept where its most frequent follower was seen at least `min_count` times (ties: the lowest id);
    per order n, `context_n` [m, n] int32, `next_n` [m] int32, `count_n` and `seen_n` [m] uint32 (how
    often that follower, and the context, were seen)."""
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
    return arrays


def contexts_in(arrays: dict[str, np.ndarray]) -> int:
    return sum(len(arrays[f"next_{n}"]) for n in ORDERS)


class NgramTable:
    """Context (a tuple of 1-3 ids) -> (most frequent follower, chance it follows). Read-only once
    made: requests on several threads share one.

    Held packed, one small Python int a key and one a value (~100 bytes a context against ~300 as
    tuples): a context's key is its ids plus one, `bits` bits each (the vocabulary's bit length),
    the last id lowest, so that the key of a context's last n ids is its key's low n * bits bits
    and contexts of different orders never share a key; its value is follower | count << bits |
    seen << (bits + 32), and the chance count / (seen + 1) is worked out where it is read (the same
    float as one stored)."""

    def __init__(self, follow: dict[int, int], bits: int, vocab_size: int):
        self._follow, self._bits, self._vocab = follow, bits, vocab_size
        self._masks = [(1 << (bits * n)) - 1 for n in range(ORDERS[-1], 0, -1)]  # a key's last 3, 2, 1 ids
        self._memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}  # `chain`'s, per tail

    def __len__(self) -> int:
        return len(self._follow)

    def get(self, context: Sequence[int]) -> tuple[int, float] | None:
        """The follower of `context` (1-3 ids) and its chance, or None when the table does not hold it."""
        if not 0 < len(context) <= ORDERS[-1] or not all(0 <= t < self._vocab for t in context):
            return None  # (an id past the vocabulary would run into its neighbour's bits)
        key = 0
        for t in context:
            key = (key << self._bits) | (int(t) + 1)
        hit = self._follow.get(key)
        return None if hit is None else self._unpack(hit)

    def _unpack(self, value: int) -> tuple[int, float]:
        b = self._bits
        return value & ((1 << b) - 1), ((value >> b) & 0xFFFFFFFF) / ((value >> (b + 32)) + 1.0)

    def contexts(self) -> dict[tuple[int, ...], tuple[int, float]]:
        """Every context and its (follower, chance), unpacked: for tests and tools, not per token."""
        out, b = {}, self._bits
        for key, value in self._follow.items():
            ids = []
            while key:
                ids.append((key & ((1 << b) - 1)) - 1)
                key >>= b
            out[tuple(reversed(ids))] = self._unpack(value)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], vocab_size: int) -> "NgramTable":
        """The table of `count_ngrams`' arrays, each checked (ModelFormatError naming it): integers of the
        shapes it makes, ids in the vocabulary, 1 <= count <= seen, no context twice, at most
        MAX_CONTEXTS in all."""
        checked = {}
        for n in ORDERS:
            ctx, nxt, count, seen = (_array(arrays, f"{a}_{n}", 2 if a == "context" else 1) for a in ARRAYS)
            m = len(nxt)
            if ctx.shape != (m, n) or count.shape != (m,) or seen.shape != (m,):
                raise ModelFormatError(f"order {n}: context {ctx.shape}, next {nxt.shape}, count {count.shape}, "
                                       f"seen {seen.shape} do not agree")
            checked[n] = ctx, nxt, count, seen
        if sum(len(c[1]) for c in checked.values()) > MAX_CONTEXTS:
            raise ModelFormatError(f"more than {MAX_CONTEXTS:,} contexts")
        bits = max(1, int(vocab_size).bit_length())  # ids + 1 fit: the largest is vocab_size
        follow: dict[int, int] = {}
        for n, (ctx, nxt, count, seen) in checked.items():
            if not len(nxt):
                continue
            if min(ctx.min(), nxt.min()) < 0 or max(ctx.max(), nxt.max()) >= vocab_size:
                raise ModelFormatError(f"order {n}: a token id outside the vocabulary [0, {vocab_size})")
            if count.min() < 1 or (count > seen).any():
                raise ModelFormatError(f"order {n}: a follower counted 0 times, or more often than its context")
            if seen.max() >= 2 ** 32:
                raise ModelFormatError(f"order {n}: a context seen 2**32 times or more")
            if len(np.unique(ctx, axis=0)) != len(ctx):
                raise ModelFormatError(f"order {n}: a context is listed twice")
            if n * bits <= 62:  # (int64 in numpy: fewer Python objects at the read's peak)
                packed = np.zeros(len(nxt), np.int64)
                for column in ctx.T:
                    packed = (packed << bits) | (column.astype(np.int64) + 1)
                keys = packed.tolist()
            else:  # a vocabulary past 2**20 ids: Python ints
                keys = [0] * len(nxt)
                for column in ctx.T.tolist():
                    keys = [(k << bits) | (t + 1) for k, t in zip(keys, column)]
            follow.update(zip(keys, [f | (c << bits) | (v << (bits + 32)) for f, c, v in
                                     zip(nxt.tolist(), count.tolist(), seen.tolist())]))
        return cls(follow, bits, int(vocab_size))

    @classmethod
    def build(cls, texts: Sequence[Sequence[int]], vocab_size: int, min_count: int = MIN_COUNT) -> "NgramTable":
        return cls.from_arrays(count_ngrams(texts, min_count), vocab_size)

    @classmethod
    def read(cls, path, vocab_size: int, contexts: int | None = None, sha256: str | None = None) -> "NgramTable":
        """The table in `path`, holding `contexts` contexts when given (the manifest's count) and the
        bytes whose hash is `sha256` when given (the manifest's: the file is read once, after the load
        hashed the folder, and a file replaced or damaged in between is refused, not drafted from); a
        ModelFormatError naming the file when it is not one. Only the arrays the table needs are read,
        each after its header says it is integers of a size a table can have, so a small file cannot
        unpack into a large allocation."""
        try:
            raw = small_files.read_bytes(Path(path), MAX_FILE_BYTES, ModelFormatError)  # a regular file, bounded
        except ModelFormatError as e:
            raise ModelFormatError(f"{path} is not a valid n-gram table ({e}): convert the model again") from None
        if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
            raise ModelFormatError(f"{path} does not match its sha256 in the manifest: it was changed or damaged "
                                   "since the model was loaded; load the model again, or convert it again")
        try:
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                arrays = {f"{a}_{n}": _member(z, f"{a}_{n}", n if a == "context" else None)
                          for n in ORDERS for a in ARRAYS}
            table = cls.from_arrays(arrays, vocab_size)
        except MemoryError:
            raise
        except Exception as e:  # anything the zip or npy layers raise on a damaged file: zlib, lzma, ...
            why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            if "allow_pickle" in why:  # (numpy's advice to load it unsafely is not one to pass on)
                why = "an array of Python objects"
            raise ModelFormatError(f"{path} is not a valid n-gram table ({why}): convert the model again") from None
        if contexts is not None and len(table) != contexts:
            raise ModelFormatError(f"{path} holds {len(table):,} contexts, the manifest says {contexts:,}: convert "
                                   "the model again")
        return table

    def chain(self, history: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        """Up to k drafts after `history` and, for each, the chance that it and all before it are accepted.
        A chain depends on the history's last tokens alone: it is worked out once per tail (up to
        `MEMO_DRAFTS` drafts; kept for `MEMO_TAILS` tails, then forgotten all at once) and sliced."""
        tail = tuple(history[-ORDERS[-1]:])
        if k > MEMO_DRAFTS:
            return self._chain(tail, k)
        memo = self._memo.get(tail)
        if memo is None:
            if len(self._memo) >= MEMO_TAILS:
                self._memo = {}  # (threads: each sees a whole dict, the old or the new)
            memo = self._memo[tail] = self._chain(tail, MEMO_DRAFTS)
        return memo[0][:k], memo[1][:k]

    def _chain(self, tail: tuple[int, ...], k: int) -> tuple[list[int], list[float]]:
        follow, b, masks, vocab = self._follow, self._bits, self._masks, self._vocab
        low, low32, top = (1 << b) - 1, 0xFFFFFFFF, b + 32
        key = 0
        for t in tail:  # (an id past the vocabulary: no context holds it, those after it may match)
            key = (key << b) | (t + 1) if 0 <= t < vocab else 0
        drafts: list[int] = []
        chances: list[float] = []
        chance = 1.0
        while len(drafts) < k and key:
            for mask in masks:  # the longest context first
                hit = follow.get(key & mask)
                if hit is not None:
                    break
            else:
                break
            chance *= ((hit >> b) & low32) / ((hit >> top) + 1.0)
            if chance < MIN_CHANCE:
                break
            token = hit & low
            drafts.append(token)
            chances.append(chance)
            key = ((key << b) | (token + 1)) & masks[0]
        return drafts, chances


def _array(arrays: dict, key: str, ndim: int) -> np.ndarray:
    a = arrays.get(key)
    if not isinstance(a, np.ndarray):
        raise ModelFormatError(f"no array {key}")
    if a.dtype.kind not in "iu":
        raise ModelFormatError(f"{key} is {a.dtype}, not integers")
    if a.ndim != ndim:
        raise ModelFormatError(f"{key} has {a.ndim} dimensions, not {ndim}")
    return a.astype(np.int64)


def _member(z: zipfile.ZipFile, key: str, columns: int | None) -> np.ndarray:
    """Array `key` of the archive: its .npy header read first, refused unless it holds integers, of
    `columns` columns (None: a vector) and at most MAX_CONTEXTS rows."""
    try:
        info = z.getinfo(key + ".npy")
    except KeyError:
        raise ModelFormatError(f"no array {key}") from None
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = header(f)
        want = (MAX_CONTEXTS,) if columns is None else (MAX_CONTEXTS, columns)
        if dtype.kind not in "iu" or dtype.itemsize > 8:
            raise ModelFormatError(f"{key} is {dtype}, not integers")
        if len(shape) != len(want) or shape[0] > MAX_CONTEXTS or shape[1:] != want[1:]:
            raise ModelFormatError(f"{key} has shape {shape}, not {'(m,)' if columns is None else f'(m, {columns})'} "
                                   f"with m at most {MAX_CONTEXTS:,}")
    with z.open(info) as f:
        return np.lib.format.read_array(f, allow_pickle=False)


def sample_text(model, tokens: int, log=lambda msg: None) -> list[list[int]]:
    """`tokens` tokens of the model's own text (a `Model`): texts from its BOS (else its first EOS id, a
    document boundary) at temperature 1, seed 0, 1, ..., each to EOS or `SAMPLE_TOKENS_PER_TEXT`."""
    tok = model.manifest.tokenizer
    start = tok.bos_token_id if tok.bos_token_id is not None else (tok.eos_token_ids or (None,))[0]
    if start is None:
        raise ValueError("the model has no BOS or EOS id to start its own text from")
    texts, total, seed = [], 0, 0
    said = time.monotonic()
    while total < tokens and seed < tokens:  # (a model that ends every text at once would never get there)
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

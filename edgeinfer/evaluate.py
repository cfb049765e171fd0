"""Perplexity, by the method of the stories260K `eval_ppl.json`.

1. Every non-empty line of the text (UTF-8, a byte-order mark ignored; lines end at "\n", a "\r" before
   it dropped; at most `MAX_STORY_CHARS` characters) is one story; ids = [BOS] + encode(story) (no EOS).
2. The ids are cut into consecutive non-overlapping windows of at most `window` tokens.
3. Each window runs from position 0 with an empty cache, on one of the runtime's two paths
   (`PATHS`): "prefill" (the default), forward calls of up to `PREFILL_CHUNK` tokens over the window
   (each with every logit), as `load`'s prompts are prefilled; or "decode", one call per token, as
   generated tokens are fed back. The two compute the same function but not the same arithmetic:
   MatMulNBits at accuracy level 4 quantizes a single row's activations differently from a block of
   rows, so a decode-path figure is the one that scores what generation computes. A portable model (one position's logits per call) is
   always scored on its decode graph, token by token (its default; "prefill" asked of it is refused),
   and the result says "decode".
4. Within a window every token but the first is scored: NLL = -log_softmax(logits[t-1])[ids[t]] (float32).
5. perplexity = exp(sum NLL / number of scored tokens) (infinity past float's range: a broken model's
   mean NLL over ~709.8 nats; its JSON says null there, beside the finite mean NLL).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer import small_files
from edgeinfer.engine import Engine
from edgeinfer.portable_engine import open_engine
from edgeinfer.errors import EdgeInferError, InvalidArgumentTypeError, ModelFormatError, broken_logits_cause
from edgeinfer.kv_cache import RingKVCache, binding_window
from edgeinfer.overflow import DEFAULT_PREFILL_CHUNK, resolve_sinks
from edgeinfer.sampling.params import is_integer
from edgeinfer.session import DecoderSession
from edgeinfer.tokenizer import Tokenizer


PATHS = ("prefill", "decode")  # `edgeinfer eval --path`
PREFILL_CHUNK = DEFAULT_PREFILL_CHUNK  # tokens per prefill call, as `load`'s prompts are prefilled: a window of
# 8192 in one call held 13 GB (SmolLM2's logits and activations for every row at once; about 2 MB a row)


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    scored_tokens: int
    n_stories: int
    n_windows: int
    eval_s: float
    path: str = "prefill"  # which forward path scored it (PATHS; "stream" for stream_perplexity)
    window: int | None = None  # tokens per scored window (None: stream scoring, a story through the ring)

    def to_json(self) -> dict:
        return {"perplexity": self.perplexity if math.isfinite(self.perplexity) else None,
                "mean_nll_nats_per_token": self.mean_nll,
                "scored_tokens": self.scored_tokens, "n_stories": self.n_stories, "n_windows": self.n_windows,
                "eval_s": round(self.eval_s, 3), "path": self.path, "window": self.window}


MAX_STORY_CHARS = 1 << 20  # a story is encoded in one call: 8 MB took the tokenizer 1.1 GB (135 bytes a byte)
# and 11 s that Ctrl-C waited for; 1 MiB is a book's chapter


def _read_stories(text_path: Path) -> list[str]:
    try:
        if not text_path.exists():
            if text_path.is_symlink():
                raise EdgeInferError(f"{text_path} is a symbolic link that leads nowhere (a missing target or a loop)")
            raise EdgeInferError(f"text file not found: {text_path}")
    except OSError as e:  # a name the system refuses (too long)
        raise EdgeInferError(f"cannot read {text_path}: {e.strerror or e}") from None
    text = small_files.read_text(text_path, small_files.MAX_TEXT_BYTES, EdgeInferError).removeprefix("\ufeff")
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # not splitlines: U+2028, \x0c... are text
    long = next((n for n, line in enumerate(lines, 1) if len(line) > MAX_STORY_CHARS), None)
    if long is not None:
        raise EdgeInferError(f"{text_path}: line {long} is {len(lines[long - 1]):,} characters: a story (a line) "
                             f"of at most {MAX_STORY_CHARS:,} is scored; split it into lines")
    stories = [line for line in lines if line.strip()]
    del lines
    if not stories:
        raise EdgeInferError(f"{text_path} has no non-empty line to score")
    return stories


DEFAULT_WINDOW = 512


def _finite(mean_nll: float, model_dir, kv_dtype) -> float:
    if not math.isfinite(mean_nll):
        raise ModelFormatError(f"{model_dir} computed logits that are not finite (NaN or infinity): "
                               f"{broken_logits_cause(kv_dtype)}")
    return mean_nll


def _exp(mean_nll: float) -> float:
    """exp(mean NLL), infinity past float's range (a mean over ~709.8 nats: a broken model)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def _check_args(model_dir, text_path, **ints) -> None:
    """The Python API's arguments: paths are str or os.PathLike, the named ones integers (None allowed)."""
    for name, v in (("model_dir", model_dir), ("text_path", text_path)):
        if not isinstance(v, (str, os.PathLike)):
            raise InvalidArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {type(v).__name__}")
    for name, v in ints.items():
        if v is not None and not is_integer(v):
            raise InvalidArgumentTypeError(f"{name} must be an integer, got {v!r}")


def _nll(logits: np.ndarray, targets: list[int]) -> float:
    """Sum over rows of -log_softmax(logits[r])[targets[r]], in float32 as the method says."""
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
    picked = logits[np.arange(len(targets)), np.asarray(targets)]
    return float(np.sum((lse - picked).astype(np.float64)))


def _story_ids(tok: Tokenizer, story: str, vocab: int, text_path) -> list[int]:
    """The story's ids, BOS first; EdgeInferError naming an id past the embedding's rows (a tokenizer
    that knows more tokens than the model has rows for: the graph's quantized Gather reads past its
    table, with no error, and the score was an IndexError traceback)."""
    ids = tok.encode(story, add_bos=True)
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise EdgeInferError(f"{text_path}: its text encodes to token id {bad}, outside the model's vocabulary "
                             f"[0, {vocab}) (its tokenizer knows tokens the model has no rows for)")
    return ids


def window_nll(engine: Engine, cache: RingKVCache, ids: list[int], path: str = "prefill") -> tuple[float, int]:
    """Sum of NLL over ids[1:] given the prefix, from position 0 (the cache is reset): forward calls
    of up to `engine.max_chunk` tokens, each scored before the next ("prefill"), or one call per
    token ("decode")."""
    n = len(ids)
    if n < 2:
        return 0.0, 0
    cache.reset()
    step = 1 if path == "decode" else engine.max_chunk
    total = 0.0
    for start in range(0, n - 1, step):  # the last token is only a target, but goes in with its chunk (as the one
        chunk = ids[start:min(start + step, n)]  # call over the window did), so that no call is a lone row
        logits = engine.forward(cache, chunk, all_logits=True)  # [len(chunk), V] ([1, V] for one token)
        targets = ids[start + 1:start + 1 + len(chunk)]  # the next token of each row, the window's end aside
        total += _nll(logits[:len(targets)], targets)
    return total, n - 1


def perplexity(model_dir: Path | str, text_path: Path | str, *, window: int | None = None, threads: int | None = None,
               session: DecoderSession | None = None, path: str | None = None, progress=None) -> PerplexityResult:
    """window: tokens scored per window (None: 512, or the model's context or a portable model's ring
    if shorter). path: PATHS, None for the model's own ("prefill"; "decode" for a portable model, the
    only one it has). progress: called (windows done, windows in all, "windows") after each window."""
    _check_args(model_dir, text_path, window=window)
    window = None if window is None else int(window)
    if window is not None and window < 2:
        raise EdgeInferError(f"--window must be at least 2, got {window}")
    if path is not None and path not in PATHS:
        raise EdgeInferError(f"unknown --path {path!r} (choose from {', '.join(PATHS)})")
    stories = _read_stories(Path(text_path))
    session = session or DecoderSession(model_dir, threads=threads)
    context = session.manifest.arch.max_position_embeddings
    sliding = binding_window(session.manifest.arch)  # such a model's ring holds sliding - 1 tokens: a window
    # of `sliding` rows is one prefill call whose last query sees them all (`RingKVCache.call_room`)
    built = session.manifest.portable.capacity_tokens if session.manifest.portable is not None else None
    window = min(DEFAULT_WINDOW, context, sliding or context, built or context) if window is None else window
    if window > context:  # positions past what the model was trained on: a number that means nothing
        raise EdgeInferError(f"--window {window} is over the model's context of {context} tokens: use --window "
                             f"{context} or less")
    if sliding is not None and window > sliding:
        raise EdgeInferError(f"--window {window} is over the model's sliding window of {sliding} tokens: use "
                             f"--window {sliding} or less")
    if built is not None and path == "prefill":  # it was run as decode, and said so only in the result's line
        raise EdgeInferError("a portable model gives one position's logits per call, so it scores token by token: "
                             "--path decode (its default)")
    if built is not None and window > built:
        raise EdgeInferError(f"--window {window} is over the {built} tokens this portable model holds: "
                             f"use --window {built} or less")
    tok = Tokenizer(session.folder, session.manifest.tokenizer)
    session.check_not_replaced()  # the tokenizer of the folder the graph came from
    engine = open_engine(session, max_chunk=min(window, PREFILL_CHUNK), threads=threads)
    path = path or ("decode" if built is not None else "prefill")
    cache = engine.new_cache(min(window, sliding - 1) if sliding else window, 0)
    t0 = time.perf_counter()
    # the count for progress encodes the text twice (each story's ids held one at a time, as before)
    in_all = sum(-(-len(tok.encode(s, add_bos=True)) // window) for s in stories) if progress else 0
    total, count, windows = 0.0, 0, 0
    for story in stories:
        ids = _story_ids(tok, story, session.manifest.arch.vocab_size, text_path)
        for start in range(0, len(ids), window):
            nll, n = window_nll(engine, cache, ids[start:start + window], path)
            total, count, windows = total + nll, count + n, windows + 1
            if progress is not None:
                progress(windows, in_all, "windows")
    if count == 0:
        raise EdgeInferError(f"{text_path}: no token to score")
    mean = _finite(total / count, model_dir, cache.dtype)
    return PerplexityResult(_exp(mean), mean, count, len(stories), windows, time.perf_counter() - t0, path, window)


def stream_perplexity(model_dir: Path | str, text_path: Path | str, *, capacity: int, sinks: int | None = None,
                      threads: int | None = None, chunk: int = 64, progress=None) -> PerplexityResult:
    """Perplexity with each story as one stream through the ring-buffer KV cache (teacher forcing).

    Every token but the story's first is scored. While the ring has room, tokens go in chunks (each
    sees the whole story so far); once it is full they go one at a time, so each token sees exactly
    the sinks and the latest tokens the ring holds, at the positions the ring gives them, as in
    generation: once full, the ring re-bases them to follow the sinks (`kv_cache`), so they are not
    the tokens' positions in the story. sinks: None is `load`'s
    default (4, none for a model whose sliding window binds). progress: called (tokens scored, tokens
    to score, "tokens") after each call.
    """
    _check_args(model_dir, text_path, capacity=capacity, sinks=sinks, chunk=chunk)
    if capacity is None:
        raise InvalidArgumentTypeError("capacity must be an integer, got None")
    capacity, chunk, sinks = int(capacity), int(chunk), None if sinks is None else int(sinks)
    if chunk < 1:
        raise EdgeInferError(f"chunk must be at least 1, got {chunk}")
    session = DecoderSession(model_dir, threads=threads)
    sinks = resolve_sinks(session.manifest.arch, sinks)
    if capacity < 2 or not 0 <= sinks < capacity:
        raise EdgeInferError(f"--capacity must be >= 2 and --sinks in [0, capacity), got {capacity} and {sinks}")
    stories = _read_stories(Path(text_path))
    tok = Tokenizer(session.folder, session.manifest.tokenizer)
    session.check_not_replaced()  # the tokenizer of the folder the graph came from
    engine = open_engine(session, max_chunk=min(chunk, capacity), threads=threads)
    cache = engine.new_cache(capacity, sinks)
    t0 = time.perf_counter()
    in_all = sum(max(len(tok.encode(s, add_bos=True)) - 1, 0) for s in stories) if progress else 0
    total, count = 0.0, 0
    for story in stories:
        ids = _story_ids(tok, story, session.manifest.arch.vocab_size, text_path)
        cache.reset()
        pos = 0
        while pos < len(ids) - 1:
            room = cache.capacity - cache.n_valid
            s = min(engine.max_chunk, room if room > 0 else 1, len(ids) - 1 - pos)
            lg = engine.forward(cache, ids[pos:pos + s], all_logits=True)  # [s, V]: predicts ids[pos+1 : pos+s+1]
            total += _nll(lg, ids[pos + 1:pos + s + 1])
            count += s
            pos += s
            if progress is not None:
                progress(count, in_all, "tokens")
    if count == 0:
        raise EdgeInferError(f"{text_path}: no token to score")
    mean = _finite(total / count, model_dir, cache.dtype)
    return PerplexityResult(_exp(mean), mean, count, len(stories), len(stories), time.perf_counter() - t0,
                            "stream")

"""Drafters for speculative decoding (`speculative.SpeculativeStepper`): who guesses the next tokens.

One interface: `push(token)` records the history, `draft(k)` returns up to k ids that may follow it,
and `free` says whether drafting costs next to nothing (the stepper then drafts first and keeps what
pays) or a model's steps (the stepper chooses k first).
- `NgramDrafter` ("ngram", prompt lookup): the tokens that followed the most recent earlier
  occurrence of the last n tokens (n = max_n down to min_n) in the prompt and the text generated so
  far: text that quotes, summarises or edits its input repeats it, and so does a model looping on its
  own words. Where the model folder has an n-gram table (`ngram_table.NgramTable`: what followed
  each short context in text the model wrote itself at convert time), its chain is the other
  candidate, and the draft with more expected accepted tokens is the one offered.
- `ModelDrafter` ("draft"): a small model of the same tokenizer (`Model.set_draft`, kept as a
  `Draft`) continues the text greedily in its own ring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeinfer.engine import Engine
from edgeinfer.errors import InvalidArgumentError, ModelClosedError
from edgeinfer.ngram_table import NgramTable


class NgramDrafter:
    """Drafts from the history: the continuation of the most recent earlier occurrence of its last n
    tokens, longest n first. `index` maps every n-gram that ends before the last token to where its
    latest occurrence ends; `push` keeps it so in O(max_n) per token. The history is the last `window`
    tokens to `2 * window` (memory bounded: `BYTES_PER_TOKEN` each).

    Drafting costs next to nothing (`free`), so the stepper asks for the most it could verify and
    keeps what pays. `draft` sets `chances`: for each draft, the chance that it and every draft before
    it are accepted, which the stepper weighs against what a verify call costs. For the history's own
    copy: `match` is how many tokens before the draft agree with the text before that earlier
    occurrence (n at least, up to `max_match`), and by the rule of succession, after r - 1 agreed
    tokens the next j agree with chance r / (r + j), r = match - `match_discount` + 1 (a short
    n-gram often matches by chance): the longer the text has been a copy, the further ahead the copy
    is likely to go on. With a `table` (the model's n-gram table), its chain (`NgramTable.chain`,
    chances from its counts) is offered instead when its chances add up to more."""

    free = True
    max_match = 32
    match_discount = 2  # tokens of a match that prove nothing
    window = 8192  # the last tokens searched: a longer history is cut to these when it reaches twice as many
    BYTES_PER_TOKEN = 256  # the history and its index, per token held (244-250 measured with tracemalloc)

    def __init__(self, ids: Sequence[int], max_n: int = 3, min_n: int = 2, table: NgramTable | None = None):
        if not 1 <= min_n <= max_n:
            raise InvalidArgumentError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.table = max_n, min_n, table
        self.history = [int(t) for t in ids[-self.window:]]
        self._reindex()
        self.match = 0
        self.chances: list[float] = []

    def _reindex(self) -> None:
        """`index` as `push` would leave it: each n-gram ending before the last token, at its latest
        occurrence (later ends last)."""
        h, self.index = self.history, {}
        for n in range(self.min_n, self.max_n + 1):
            grams = zip(*(h[i:len(h) - n + i] for i in range(n)))
            self.index.update(zip(grams, range(n - 1, len(h) - 1)))

    def push(self, token: int) -> None:
        h, index = self.history, self.index
        end = len(h) - 1  # the old last token: its n-grams (the history's last n) become earlier occurrences
        for n in range(self.min_n, min(self.max_n, len(h)) + 1):
            index[tuple(h[-n:])] = end
        h.append(int(token))
        if len(h) >= 2 * self.window:  # a long request: its memory stays bounded (the index held every n-gram
            self.history = h[-self.window:]  # of everything it had seen, ~250 bytes a token); once per window
            self._reindex()  # tokens, so a token costs O(1) on average

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that may follow the history ([] if none), their `chances` set."""
        copied = self._copy(k)
        r = max(0, self.match - self.match_discount) + 1
        self.chances = [r / (r + j) for j in range(1, len(copied) + 1)]
        if self.table is not None and k > 0:
            drafts, chances = self.table.chain(self.history, k)
            if sum(chances) > sum(self.chances):
                self.chances = chances
                return drafts
        return copied

    def _copy(self, k: int) -> list[int]:
        """Up to k tokens that followed the last n tokens' latest earlier occurrence ([] if none); `match` set."""
        h = self.history
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(h) >= n:
                end = self.index.get(tuple(h[-n:]))
                if end is not None:  # h[end - n + 1 .. end] == h[-n:]; extend the agreement leftwards
                    m = n
                    while m < self.max_match and m <= end and h[end - m] == h[-1 - m]:
                        m += 1
                    self.match = m
                    return h[end + 1:end + 1 + k]
        self.match = 0
        return []


@dataclass(frozen=True)
class Draft:
    """A draft model as the target's engine keeps it (`Engine.draft`, set by `Model.set_draft`): its
    engine and the ring each request's `ModelDrafter` allocates."""

    engine: Engine
    capacity_tokens: int
    n_sink: int


class ModelDrafter:
    """Drafts with a small model of the same tokenizer: its greedy continuation of the history.

    One request owns one: a ring of the draft model (allocated here) that holds `fed`, the history's
    tokens from `base` on that it has consumed, then the last draft's tokens. `push` only records the
    true history; `draft(k)` first brings the ring in line with it (the drafts the target rejected are
    dropped by rewinding to the mark taken before they were fed), then feeds the tokens not yet fed as
    one prefill, and k - 1 decode steps follow (k at most capacity - 1). The ring never shifts: when
    the next draft would not fit, it starts again from the history's last tokens (half the capacity,
    less where the draft needs the room). The first draft feeds the prompt (up to that much): a
    one-time cost, as the target's prefill is. After a long stretch of plain steps (more than 2
    `resync_tokens` unfed: the stepper was not drafting) it starts again from the last
    `resync_tokens`, so that a probe costs the draft model a bounded prefill, not one of everything
    it missed. Its drafts need not be exact: the target verifies every one."""

    resync_tokens = 16
    free = False  # each drafted token is a step of the draft model: the stepper decides k first
    window = 8192  # the history kept: the last max(window, capacity) tokens, cut when twice as many (a
    # request's memory stays bounded, as `NgramDrafter`'s does; it grew by ~36 bytes a token for good)

    def __init__(self, draft: Draft, ids: Sequence[int]):
        self.engine = draft.engine
        try:
            self.cache = draft.engine.new_cache(draft.capacity_tokens, draft.n_sink)
        except ModelClosedError:
            raise _draft_closed() from None
        self.history: list[int] = [int(t) for t in ids[-self._keep():]]
        self.gone = False  # the draft model was closed while this request ran (`draft`)
        self.base = 0  # history index of the ring's first token
        self.fed: list[int] = []  # what the ring holds, in order
        self._mark: tuple | None = None  # the ring before the last draft's tokens were fed
        self._n_marked = 0  # len(fed) at that mark

    def _keep(self) -> int:
        """How many of the history's last tokens are kept: drafting never reaches further back than a
        ring's capacity (`_restart`)."""
        return max(self.window, self.cache.capacity)

    def push(self, token: int) -> None:
        self.history.append(int(token))
        keep = self._keep()
        if len(self.history) >= 2 * keep:  # cut to the last `keep`: once per `keep` tokens, O(1) a token
            cut = len(self.history) - keep
            if cut > self.base:  # the ring holds tokens cut here: it starts again at the next draft
                self.cache.reset()
                self.fed.clear()
                self._mark, self.base = None, cut
            del self.history[:cut]
            self.base -= cut

    def draft(self, k: int) -> list[int]:
        """Up to k drafts; none for the rest of the request once the draft model is closed (drafts decide no
        token: the request goes on plainly, as it does after set_draft(None); it died at its next step:
        a hostile round)."""
        if self.gone:
            return []
        try:
            return self._draft(k)
        except ModelClosedError:  # the draft's own engine (the target's says so at its own call)
            self.gone = True
            return []

    def _draft(self, k: int) -> list[int]:
        k = min(k, self.cache.capacity - 1)
        if k < 1 or not self.history:
            return []
        logits = self._sync(k)
        self._mark, self._n_marked = self.cache.mark(), len(self.fed)
        out = [int(np.argmax(logits))]
        while len(out) < k:
            logits = self.engine.decode_one(self.cache, out[-1])
            self.fed.append(out[-1])
            out.append(int(np.argmax(logits)))
        return out

    def _sync(self, k: int) -> np.ndarray:
        """Make the ring hold the history (from `base`) with room for k - 1 drafts; the logits after
        the history's last token."""
        h, fed = self.history[self.base:], self.fed
        n = next((i for i, (a, b) in enumerate(zip(fed, h)) if a != b), min(len(fed), len(h)))
        if n < len(fed) or n == len(h):  # drafts to drop (or nothing new to feed: feed the last token again)
            if self._mark is not None and self._n_marked < len(h) and self.cache.rewind(self._mark):
                del fed[self._n_marked:]
            else:
                self._restart(k)
            self._mark = None
        unfed = len(self.history) - self.base - len(fed)
        if fed and unfed > 2 * self.resync_tokens:
            self._restart(k, self.resync_tokens)  # a probe after plain steps: the recent text is enough
        if self.cache.n_valid + len(self.history) - self.base - len(fed) + k - 1 > self.cache.capacity:
            self._restart(k)  # the ring would shift: start again from the last tokens
        tail = self.history[self.base + len(fed):]
        logits = self.engine.prefill(self.cache, tail)
        fed.extend(tail)
        return logits

    def _restart(self, k: int, keep: int | None = None) -> None:
        """An empty ring, to be fed the history's last `keep` tokens (None: half the capacity), fewer
        where k - 1 drafts would not fit after them (k < capacity: at least one token)."""
        self.cache.reset()
        self.fed.clear()
        keep = min(keep or self.cache.capacity // 2, self.cache.capacity - k + 1)
        self.base = max(0, len(self.history) - max(1, keep))


def check_pair(target, draft) -> None:
    """Refuse (InvalidArgumentError) a draft Model that cannot draft for the `target` Model: a closed
    one, a portable graph on either side (it verifies or feeds no drafts), a graph of another vocabulary
    size (its ids would index past the other's embedding: the same tokenizer files with a padded or
    cut embedding passed, and every request then failed in ONNX Runtime's Gather), or another
    tokenizer (the same tokenizer files and settings, else every id mapped to the same token:
    `Tokenizer.same_as`)."""
    if draft.closed:
        raise InvalidArgumentError("the draft model was closed (Model.close): give an open one")
    if not isinstance(draft.engine, Engine) or not isinstance(target.engine, Engine):
        raise InvalidArgumentError("speculative decoding needs fused graphs (a portable one verifies nothing)")
    a, b = target.manifest, draft.manifest
    if a.arch.vocab_size != b.arch.vocab_size:
        raise InvalidArgumentError(f"the draft model {draft.folder} has a vocabulary of {b.arch.vocab_size} ids, this "
                                   f"model {a.arch.vocab_size}: a draft model needs the same tokenizer and vocabulary")
    tok_files = [n for n in sorted(set(a.files) | set(b.files)) if n.startswith("tokenizer")]
    same_files = tok_files and all(a.files.get(n, {}).get("sha256") == b.files.get(n, {}).get("sha256")
                                   for n in tok_files)
    if not (same_files and a.tokenizer == b.tokenizer) and not target.tokenizer.same_as(draft.tokenizer):
        raise InvalidArgumentError(f"the draft model {draft.folder} does not have this model's tokenizer "
                                   f"(vocabulary {b.arch.vocab_size} vs {a.arch.vocab_size}; special ids or "
                                   "token strings differ)")


def _draft_closed() -> InvalidArgumentError:
    """A request for drafts from an attached draft model that was closed: InvalidArgumentError, as
    `set_draft` of a closed one is; ModelClosedError says this Model was closed, and an app that loads
    its model again on it reloaded the wrong one (a hostile round)."""
    return InvalidArgumentError("the draft model was closed (Model.close): attach an open one with set_draft, or "
                                "detach it with set_draft(None)")

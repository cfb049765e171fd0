"""Speculative decoding: drafts checked in one graph call, the same tokens as plain decoding.

The drafts come from a drafter (`drafting.NgramDrafter` for "ngram", `drafting.ModelDrafter` for
"draft"): `push(token)`, `draft(k) -> list of up to k ids`, `free`.

`SpeculativeStepper.step(cache, token)` replaces a plain decode step (`Engine.decode_one`), same
contract: feed `token`, return the logits [V] for the next one. Its numbered steps:
1. If the previous call left verified rows and `token` is the draft they were computed for, commit
   that row and return its logits: no graph call.
2. Otherwise (no rows left, or the token differs from the draft: the rows after it are dropped,
   never committed), draft up to k tokens after `token`. None: a plain decode step.
3. Verify: one graph call over [token, d1 .. dk] with logits at every position and nothing committed
   (`Engine.forward(..., all_logits=True, commit=False)`); commit `token`'s row and return its logits.
   The draft rows wait, uncommitted, just past the valid slots, for step 1.

The caller samples each position exactly as plain decoding would (same sampler, same RNG draws in
the same order) and feeds the sampled token back, so the tokens equal plain decoding's: a draft only
decides which logits are computed ahead. Their exactness is the graph's: a call of several rows
computes the same logits as one-row calls up to float rounding in fp32 (accuracy level 0); at
accuracy level 4 (int8 activations) the multi-row path rounds differently (most rows within 1e-5, a
few by up to ~0.25 on the bundled int8; see `chunked.prefill_chunks`), so a near-tie may resolve the
other way.

The ring: a draft never runs past the ring's free slots (so no verified row evicts a token that a
plain step would still attend to, and a rejected row needs no undo: uncommitted rows past the valid
slots are not read); with the ring full (shifting), decoding is plain.

Adaptive (`Tuning`), by measurement: r[s], what a verify call of s rows costs in one-row steps, is
the engine's, measured once (`Engine.verify_ratios`) and the same for every request after, so that with
n-grams which rows share a call depends on the tokens alone (at accuracy level 4 a row's logits
depend on the size of its call, and so may the tokens: the same request then gives the same tokens
for as long as the model stays loaded; a new process measures afresh, and may differ at a near-tie). A draft model also needs the seconds of a plain step (a) and of drafting per drafted
token (d), running means of this request's own calls. Each step verifies the k drafts that
maximise the expected tokens per step, (1 + the chances that drafts 1..k are accepted) /
(r[k + 1] + k d / a), and drafts nothing when no k beats plain steps by `margin`: a graph that
verifies many rows for little more than one (a small model, int8 activations) speculates often and
far, one whose multi-row calls cost several steps (accuracy level 0 on a larger model) only on long
sure runs. The chances:
- a free drafter (n-grams: drafting costs nothing, so it drafts first and the rule keeps what pays)
  gives each draft's chance with it (`NgramDrafter.chances`: by the rule of succession on how far
  the text it copies already agrees, or from the counts of the model's n-gram table), scaled by
  this request's ratio of accepted to predicted drafts. Text being copied has long matches and gets
  long drafts; a chance bigram gets none.
- a draft model: each drafted token is accepted with probability p, counted separately after a
  draft that was accepted whole (text being copied: p near 1) and after one that was not.
While it drafts nothing it probes with a short draft every `probe_every` tokens, so that text which
starts to repeat itself is noticed; each probe that gains nothing doubles that interval (up to
`probe_backoff` times it), and any accepted draft puts it back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgeinfer.drafting import NgramDrafter
from edgeinfer.engine import Engine
from edgeinfer.kv_cache import RingKVCache


@dataclass(frozen=True)
class Tuning:
    k_max: int = 8  # longest draft
    margin: float = 0.05  # speculate when the expected tokens per second beat plain steps' by this much
    probe_every: int = 32  # while not speculating, a probe draft this often (tokens)
    probe_backoff: int = 16  # failed probes stretch the interval up to this many times probe_every
    probe_k: int = 2
    ema: float = 0.2  # weight of the newest call in the running means of a and d (a draft model's)
    decay: float = 0.9  # weight of the past in the acceptance counts
    fixed_k: int | None = None  # draft this many whenever a draft exists, measuring nothing (tests, benchmarks)


TUNING = Tuning()  # what requests use


def verify_buffer_bytes(vocab_size: int, tuning: Tuning = TUNING) -> int:
    """The buffer a speculating ring keeps for its verify calls' logits (`RingKVCache.verify_logits`):
    k_max + 1 rows of float32 logits, 5.5 MB for a 151,936-token vocabulary."""
    return (tuning.k_max + 1) * vocab_size * 4


@dataclass
class Stats:
    """What speculation did in one request."""

    verify_calls: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verify call (tokens gained per call beyond the one a plain step makes)."""
        return self.accepted_tokens / self.verify_calls if self.verify_calls else 0.0


class SpeculativeStepper:
    """A stepper (`batching.SoloStepper`'s methods) that speculates; one request, one cache."""

    def __init__(self, engine: Engine, inner, history: Sequence[int], max_new_tokens: int,
                 tuning: Tuning | None = None, drafter=None):
        """inner: the stepper plain steps go through (`batching.SoloStepper` or `DecodeBatcher`); drafts
        are verified only while it says the cache decodes alone. tuning: None for `TUNING`. drafter:
        None for an `NgramDrafter` over `history` and the model's n-gram table (`Engine.ngram_table`),
        else one that has seen `history` already."""
        self.engine, self.inner, self.tuning = engine, inner, tuning or TUNING
        self.drafter = drafter if drafter is not None else NgramDrafter(history, table=engine.ngram_table())
        self.stats = Stats()
        self.budget = max_new_tokens  # tokens this request may still sample (drafting past it is waste)
        self._rows: np.ndarray | None = None  # logits of the verified draft rows not yet served (a view of the
        # ring's verify_logits)
        self._draft: list[int] = []  # the drafts those rows were computed for
        self._next = 0  # index in _draft of the next row to serve
        self._step_s: float | None = None  # a: seconds per plain step (running mean; a draft model's k)
        self._ratios: tuple[float, ...] | None = None  # r[s - 1]: `Engine.verify_ratios`, when first needed
        self._draft_s = 0.0  # d: seconds of drafting per drafted token (running mean)
        self._draft_measured = False
        self._version = 0  # bumped when a measurement changes what k() answers
        self._k_memo = (-1, 0)  # (version, k) of k()'s last answer
        # per state (False: the last draft was cut short, True: accepted whole): [accepted tokens, runs cut short]
        self._counts = {False: [0.0, 0.0], True: [0.0, 0.0]}
        self._whole = False  # the state: was the last settled draft accepted whole?
        self._since_probe = 0
        self._probe_interval = self.tuning.probe_every  # stretched by failed probes
        self._probing = False  # the draft in flight is a probe
        # a free drafter's calibration: accepted tokens against those its chances predicted (running sums)
        self._calib = [1.0, 1.0]
        self._predicted = 0.0  # what the rule predicted for the draft in flight

    def join(self, cache: RingKVCache) -> None:
        self.inner.join(cache)

    def leave(self, cache: RingKVCache) -> None:
        self._rows = None
        self.inner.leave(cache)

    def step(self, cache: RingKVCache, token: int) -> np.ndarray:
        if self._rows is None and cache.n_valid >= cache.capacity - 1:  # full: it stays full (it shifts),
            return self.inner.step(cache, token)  # and no draft fits again in this request: plain, no bookkeeping
        self.drafter.push(token)
        self.budget -= 1
        if self._rows is not None:
            if token == self._draft[self._next]:  # 1. the draft was right: its row is already computed
                cache.commit(1)
                row = self._rows[self._next + 1]
                self._next += 1
                self.stats.accepted_tokens += 1
                if self._next == len(self._draft):
                    self._rows = None
                    self._adapt(len(self._draft), len(self._draft))
                return row
            self._adapt(self._next, len(self._draft))  # rejected: the rows after it are never committed
            self._rows = None
        draft = self._drafts(cache)  # 2.
        if not draft:
            return self._plain(cache, token)
        n = len(draft) + 1  # 3.
        out = cache.verify_logits  # the verify calls' logits: one buffer per ring, reused
        if out is None or out.shape[1] < n:
            out = cache.verify_logits = np.empty((1, max(n, self.tuning.k_max + 1), self.engine.spec.vocab_size),
                                                 np.float32)
        rows = self.engine.forward(cache, [token] + draft, all_logits=True, commit=False, out=out)
        cache.commit(1)
        self.stats.verify_calls += 1
        self.stats.drafted_tokens += len(draft)
        self._rows, self._draft, self._next = rows, draft, 0
        return rows[0]

    def _drafts(self, cache: RingKVCache) -> list[int]:
        room = min(self.budget - 1, self.engine.max_chunk - 1, cache.capacity - cache.n_valid - 1)
        if room < 1 or not self.inner.alone(cache):
            return []
        free = self.drafter.free and self.tuning.fixed_k is None
        if free:  # draft first (it costs nothing), then keep what pays
            draft = self.drafter.draft(min(self.tuning.k_max, room))
            k = self._k_for_chances(self.drafter.chances) if draft else 0
        else:
            k = min(self.k(), room)
        if k <= 0:
            self._since_probe += 1
            if (not free and self._step_s is None) or self._since_probe < self._probe_interval:
                return []
            k = min(self.tuning.probe_k, room)
            self._probing = True
        if free:
            draft = draft[:k]
            self._predicted = sum(min(1.0, c) for c in self.drafter.chances[:k])
        else:
            t0 = time.perf_counter()
            draft = self.drafter.draft(k)
            if draft and self.stats.verify_calls:  # the first draft's time includes a draft model's prompt: not per token
                self._draft_s = self._mean(self._draft_s if self._draft_measured else None,
                                           (time.perf_counter() - t0) / len(draft))
                self._draft_measured = True
                self._version += 1
        if not draft:
            self._probing = False
        else:
            self._since_probe = 0
        return draft

    def _k_for_chances(self, chances: Sequence[float]) -> int:
        """How many of a free drafter's drafts to verify, given the chance of each (with all before it)
        being accepted: the k with the most expected tokens per step, (1 + the first k chances, each
        scaled by g, this request's calibration: accepted over predicted, and capped at 1) / r[k + 1];
        0 when no k beats plain steps by `margin`. Nothing timed here: the same tokens give the same k."""
        g = self._calib[0] / self._calib[1]
        ratios = self._verify_ratios()  # r[s - 1]: ratios[k] is a call of k drafts (k_max + 1 rows at most)
        best_k, best, expected = 0, 1.0 + self.tuning.margin, 1.0
        for k, chance in enumerate(chances[:len(ratios) - 1], 1):
            chance *= g
            expected += chance if chance < 1.0 else 1.0
            if expected > best * ratios[k]:
                best_k, best = k, expected / ratios[k]
        return best_k

    def k(self) -> int:
        """The draft length with the most expected tokens per second for a drafter that is not free
        (a draft model: k is chosen before drafting), or `fixed_k`; 0: plain steps are better.
        Recomputed when a measurement changed (`_version`; plain steps count once per 16, their
        running mean moving slowly), else the last answer: this runs before every step."""
        if self.tuning.fixed_k is not None:
            return self.tuning.fixed_k
        if self._step_s is None:
            return 0  # measure a plain step first
        if self._k_memo[0] == self._version:
            return self._k_memo[1]
        t, a = self.tuning, self._step_s
        accepted, cut = self._counts[self._whole]
        p = (accepted + 1.0) / (accepted + cut + 2.0)
        best_k, best, expected, pk = 0, 1.0 + t.margin, 1.0, 1.0
        for k in range(1, t.k_max + 1):
            pk *= p
            expected += pk
            gain = expected * a / (self._verify_cost(k + 1) + k * self._draft_s)  # tokens/s over plain steps'
            if gain > best:
                best_k, best = k, gain
        self._k_memo = (self._version, best_k)
        return best_k

    def _verify_cost(self, s: int) -> float:
        """Seconds for a verify call of s rows: r[s] plain steps of this request's."""
        return self._ratio(s) * self._step_s

    def _ratio(self, s: int) -> float:
        ratios = self._verify_ratios()
        return ratios[min(s, len(ratios)) - 1]

    def _verify_ratios(self) -> tuple[float, ...]:
        if self._ratios is None:
            self._ratios = self.engine.verify_ratios(self.tuning.k_max)
        return self._ratios

    def _plain(self, cache: RingKVCache, token: int) -> np.ndarray:
        if self.drafter.free and self.tuning.fixed_k is None:  # n-grams: the rule reads the engine's ratios, no time
            self.stats.plain_steps += 1
            return self.inner.step(cache, token)
        t0 = time.perf_counter()
        logits = self.inner.step(cache, token)
        self._step_s = self._mean(self._step_s, time.perf_counter() - t0)
        self.stats.plain_steps += 1
        if self.stats.plain_steps % 16 == 1:
            self._version += 1
        return logits

    def _adapt(self, accepted: int, drafted: int) -> None:
        """A draft is settled: count how much of it was accepted, in the state it was drafted in."""
        if self._probing:  # a probe: stretch the interval if it gained nothing, else start over
            t = self.tuning
            self._probe_interval = t.probe_every if accepted else min(2 * self._probe_interval,
                                                                     t.probe_backoff * t.probe_every)
            self._probing = False
        elif accepted:
            self._probe_interval = self.tuning.probe_every
        self._version += 1
        d, c = self.tuning.decay, self._counts[self._whole]
        if self.drafter.free and self.tuning.fixed_k is None:  # what `_k_for_chances` predicted
            self._calib[0], self._calib[1] = self._calib[0] * d + accepted, self._calib[1] * d + self._predicted
        c[0], c[1] = c[0] * d + accepted, c[1] * d + (accepted < drafted)
        self._whole = accepted == drafted

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.tuning.ema * (new - old)

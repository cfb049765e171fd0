"""`Generation`: one request's loop, shared by `generate`, `stream` and conversations (its result types: `results`).

A Generation is an iterator of `Chunk`s whose `completion` is set when it ends; `Model.generate`,
`Model.chat` and `Conversation.say` are folds over one. Options and the prompt are checked when the
call is made; the steps below run from the first `next()`:
1. Take the context's lock (`ContextLock`: another thread waits its turn, the same thread with a
   live stream on it is refused) and ask the context for the prompt ids (`begin`: the Model resets
   its cache; a Conversation renders its history and finds what its cache has not seen).
2. Fit the prompt to the ring by the overflow policy (`overflow.fit_prompt`).
3. Prefill the prompt in chunks; sample the first token (time to first token ends here).
4. Decode one token at a time (paced by the power plan, if any): sample, let the sampler accept
   it (its penalty history), detokenize incrementally, hold back text that may be the start of a
   stop string; stop on EOS / a stop string / max_new_tokens / a full ring that may not shift.
5. Set `completion` and what a conversation needs next (`unfed`, `cached_text`, `cache_stale`),
   taking a stop string's tokens back out of the cache.
6. Whatever happened (finished, failed, closed or dropped half-way): `end(self)` runs, then the
   lock is released; a finished request then yields its last chunk, so a caller that stops right
   after it has the whole completion and leaves the context free (a conversation's history holds
   the reply).
"""

from __future__ import annotations

import copy
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from edgeinfer.batching import SoloStepper
from edgeinfer.context_lock import ContextBusyError, ContextLock
from edgeinfer.interrupts import interrupts_held
from edgeinfer.detokenize import Detokenizer, StopFilter
from edgeinfer.drafting import ModelDrafter, _draft_closed
from edgeinfer.engine import Engine
from edgeinfer.errors import (EdgeInferError, InvalidArgumentError, InvalidArgumentTypeError, ModelClosedError,
                              ModelFormatError, broken_logits_cause)
from edgeinfer.kv_cache import RingKVCache
from edgeinfer.options import GenerationOptions
from edgeinfer.overflow import ContextOverflowError, fit_prompt
from edgeinfer.results import Chunk, Completion, Timings, Usage
from edgeinfer.sampling import Sampler
from edgeinfer.speculative import SpeculativeStepper
from edgeinfer.tokenizer import Tokenizer

STOP_MARKS = 64  # how many recent tokens' cache marks a request keeps, to take a stop string back out


class GenerationCancelled(EdgeInferError):
    """The caller cancelled the request (its `cancelled` event) before it finished."""


class Generation:
    """Iterate for Chunks; `completion` is None until the request ends (and stays None if it was
    abandoned or failed). After it ends, for a conversation: `unfed` (the last sampled token, not yet
    in the cache: feed it first next turn), `cached_text` (the generated text whose tokens the cache
    holds: the reply less a stop string) and `cache_stale` (the cache no longer matches: start over).

    The request's state is a `Request`, which its steps (a generator) hold; nothing they hold refers
    back to the Generation, so a Generation dropped half-way is freed at once (reference counting,
    not the cycle collector's next pass): its steps close, `end` runs and the context's lock is
    released (step 6) when the caller lets go, in whichever thread that is."""

    def __reduce__(self):  # pickle, deepcopy: a request runs in this process's Model (it was mappingproxy's TypeError)
        raise InvalidArgumentTypeError("a Generation cannot be pickled or copied: it runs in this process's Model")

    def __init__(self, engine: Engine, tok: Tokenizer, cache: RingKVCache, options: GenerationOptions, overflow: str,
                 **kwargs):
        """The arguments are `Request`'s."""
        self._request = Request(engine, tok, cache, options, overflow, **kwargs)
        self._steps = self._request.steps()
        self._error: Exception | None = None  # what ended it (a copy: no traceback), raised again by later next()s
        self._iterating = threading.Lock()  # held by the one next() running
        self._closing = False  # close() was called: whichever of it and a running next() ends last closes

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Chunk:
        """The next chunk. A request that failed (refused as busy, a bad option, a broken model), or that
        an interrupt (Ctrl-C) ended inside its step, raises the same error again on each later call,
        rather than ending as if it had finished. One call at a time: a next() while another runs (in
        another thread) is refused with ContextBusyError and leaves the stream as it was (Python's
        "generator already executing" became the stream's own error, and its context stayed held)."""
        if not self._iterating.acquire(blocking=False):
            raise ContextBusyError("this stream is being read by another next() (another thread): read a stream "
                                   "from one thread at a time")
        try:
            return self._next()
        finally:
            self._iterating.release()
            if self._closing:  # a close() from another thread came while this ran (its last chunk, maybe)
                self._close_steps()

    def _next(self) -> Chunk:
        request = self._request
        if request.unsent is not None and self._unsent_ready():  # (None at every token but the last) a Ctrl-C
            chunk, request.unsent = request.unsent, None  # ended the finished request's steps before its last
            return chunk  # chunk went out: it goes out now, so that the chunks still join to the completion
        if self._error is not None:
            if self._closing and isinstance(self._error, GenerationCancelled):
                raise StopIteration  # closed: ended, whether the close's cancel reached a running next() or not
            raise copy.copy(self._error)
        try:
            chunk = next(self._steps)
            if chunk is request.unsent:
                request.unsent = None
            return chunk
        except StopIteration:
            raise
        except Exception as e:  # not KeyboardInterrupt and the like: those stop the caller, not the request
            try:  # a copy, made as pickle makes one: the error itself holds a traceback through this frame (a cycle)
                self._error = copy.copy(e)
            except Exception:  # a class that cannot be rebuilt from its args: a plain one with its message
                self._error = EdgeInferError(f"{type(e).__name__}: {e}")
            if self._unsent_ready():  # the request finished and its `end` failed: its last chunk first, then
                chunk, request.unsent = request.unsent, None  # the error on each later call
                return chunk
            raise
        except BaseException as e:  # a Ctrl-C inside the step ended the request (its steps closed): say so later
            if self._steps.gi_frame is None and self.completion is None:  # (one in the caller's own code does not)
                self._error = GenerationCancelled(f"this stream was interrupted ({type(e).__name__}) and ended "
                                                  "unfinished; start another")
            raise

    def _unsent_ready(self) -> bool:
        """Whether the request finished (its completion set) and its steps ended before its last chunk was
        yielded (`Request.unsent`), and the stream was not closed."""
        return (self._request.unsent is not None and self._steps.gi_frame is None and not self._closing
                and self.completion is not None)

    def run_to_end(self) -> Completion | None:
        """Consume every chunk; the completion (the fold `generate`, `chat` and `say` are)."""
        for _ in self:
            pass
        return self.completion

    def close(self) -> None:
        """Abandon the request, from any thread: when no next() runs, now (as a dropped Generation is);
        while one runs (another thread's, or the one a signal handler interrupted), as it returns (its
        chunk, or GenerationCancelled where the cancel set here reached it first). The context is then
        released and a later next() ends the iteration."""
        self._closing = True
        self.cancel()
        self._close_steps()

    def _close_steps(self) -> None:
        """Close the steps unless a next() runs (that one's end closes them)."""
        if self._iterating.acquire(blocking=False):
            try:
                self._steps.close()
            finally:
                self._iterating.release()

    def cancel(self) -> None:
        """Stop the request from any thread: the thread iterating it gets GenerationCancelled at the
        next prefill chunk or token, also from inside a power plan's pacing sleep or a wait for the
        context (another request's turn)."""
        self._request.cancelled.set()

    @property
    def completion(self) -> Completion | None:
        return self._request.completion

    @property
    def unfed(self) -> tuple[int, ...]:
        return self._request.unfed

    @property
    def cached_text(self) -> str:
        return self._request.cached_text

    @property
    def cache_stale(self) -> bool:
        return self._request.cache_stale

    @property
    def prompt_dropped(self) -> int:
        """Prompt tokens the overflow policy dropped before prefill."""
        return self._request.prompt_dropped

    @property
    def prefix(self) -> list[int]:
        """Tokens fed before the prompt: a reused prefix the cache held, or a conversation's earlier turns."""
        return self._request.prefix

    @property
    def speculation(self):
        """With options.speculative: the request's `speculative.Stats`; else None."""
        return self._request.speculation


class Request:
    """One request's state and steps (`steps()`), behind a `Generation`; `begin` and `end` get it."""

    def __init__(self, engine: Engine, tok: Tokenizer, cache: RingKVCache, options: GenerationOptions, overflow: str,
                 *, begin: Callable[["Request"], list[int]], end: Callable[["Request"], None] | None = None,
                 lock: ContextLock | None = None, load_ms: float = 0.0, logprobs: int | None = None,
                 stepper=None, prefix: Sequence[int] = (), cancelled: threading.Event | None = None,
                 power=None):
        """begin(request): run under the lock at the first `next()` (not when the request was cancelled
        before it, or its options cannot run on this engine: the context is left as it was), returns the prompt ids to feed
        (it may set `request.prefix`: the tokens fed before them, see `prefix` below; and `request.cut`: prompt
        tokens it left out, counted in usage as prompt tokens dropped). end(request): step 6.
        logprobs: None (off) or n >= 0: each chunk carries its token's logprob and the n best.
        stepper: how decode steps run (`batching.SoloStepper`, the default, or a `DecodeBatcher`
        that runs this conversation's steps together with others').
        prefix: tokens fed before this prompt (a reused prefix the cache holds, or a conversation's
        earlier turns, of which a full ring may have forgotten the oldest): the
        penalties and the detokenizer see them as the prompt's start, as if it had been fed whole.
        cancelled: when set, the request stops at the next prefill chunk or token (GenerationCancelled).
        power: the Model's `PowerController` (None: off): its plan paces decode steps, sets the
        prefill chunk and the cores in force (`power.controller.Pacer`)."""
        self.engine, self.tok, self.cache, self.options, self.overflow = engine, tok, cache, options, overflow
        self.load_ms, self.logprobs = load_ms, logprobs
        self.stepper = stepper if stepper is not None else SoloStepper(engine)
        # the event `Generation.cancel` sets (the daemon passes its own, set when a client leaves)
        self.prefix, self.cancelled = list(prefix), cancelled if cancelled is not None else threading.Event()
        self.pacer = power.pacer(self.cancelled) if power is not None else None
        self.completion: Completion | None = None
        self.unfed: tuple[int, ...] = ()
        self.fed: list[int] = []  # the prompt ids prefilled (after the overflow policy's cut)
        self.cached_ids: tuple[int, ...] = ()  # the generated ids the cache holds at the end (`cached_text`'s)
        self.cached_text = ""
        self.cache_stale = False
        self.prompt_dropped = 0  # prompt tokens the overflow policy dropped before prefill (and `cut`)
        self.cut = 0  # prompt tokens `begin` left out (a conversation rebuilding its cache feeds what the ring holds)
        self.speculation = None  # with options.speculative: the request's `speculative.Stats`
        self._begin, self._end, self._lock = begin, end, lock
        self.held: ContextLock | None = None  # the context's lock while the steps hold it
        self._token = 0  # its holding of the context's lock (`ContextLock.acquire`)
        self.failed = False  # it ended in an error (not finished, abandoned, interrupted or refused): its rows
        # may be bad
        self.unsent: Chunk | None = None  # the finished request's last chunk from just before `completion` is
        # set until `Generation` has it: where a Ctrl-C (or an error in `end`) ends the steps first, the
        # next `Generation.__next__` returns it

    def steps(self) -> Iterator[Chunk]:
        begin, end, lock = self._begin, self._end, self._lock
        self._begin = self._end = self._lock = None  # a kept, finished Generation holds no Model through them
        final = None
        try:
            while lock is not None and self.held is None:  # (a SIGINT handler that does not raise: wait again)
                with interrupts_held() as held:  # a Ctrl-C while waiting gives up; one as it takes the lock
                    token = lock.acquire(self, give_up=lambda: held.pending() or self.cancelled.is_set())
                    if token:  # (a Ctrl-C is raised once `held` says so)
                        self.held, self._token = lock, token
                if not token:  # a cancel (or close) while waiting for another request's turn: it waited that out
                    self._check_cancelled()
            self._check_cancelled()  # cancelled before its first next(): begin must not change the context
            draft = self._check_engine()  # so are options this engine cannot run (the ring kept what it held)
            final = yield from self._run(begin(self), draft)
        except (GenerationCancelled, InvalidArgumentError, ContextOverflowError):  # abandoned, as a dropped
            raise  # stream is, or refused by our own checks (a bias that bans every token, a prompt that does
            # not fit): its rows are sound
        except Exception:
            self.failed = True
            raise
        finally:
            with interrupts_held():  # end and the release as one (nested holds pass a Ctrl-C outwards)
                self.pacer = None  # a kept, finished Generation must not keep the Model's power control alive
                mine = self.held is not None and lock.settle(self._token)  # not taken back meanwhile
                try:
                    if end is not None and (lock is None or mine):  # not another thread's context
                        end(self)
                finally:
                    if self.held is not None:
                        self.held = None
                        lock.release(self._token)
        if final is not None:  # after the release: a caller that stops at the last chunk (its completion
            yield final  # set) leaves the context free, and a conversation's history holds the reply

    def _check_engine(self):
        """Refuse options this engine cannot run, before `begin` touches the context; the draft model
        (read once: set_draft may change it while this request runs) or None."""
        engine, opts = self.engine, self.options
        if opts.speculative and not isinstance(engine, Engine):  # it would run plain: say so
            raise InvalidArgumentError(f"speculative={opts.speculative!r} needs a fused graph; this model's portable graph "
                                       "(--target coreml/nnapi) has fixed shapes and verifies no drafts")
        draft = getattr(engine, "draft", None)
        if engine.closed:  # (its draft is gone too: that refusal would mislead)
            raise ModelClosedError()
        if opts.speculative == "draft" and draft is None:
            raise InvalidArgumentError("speculative='draft' needs a draft model: model.set_draft(DIR)")
        if opts.speculative == "draft" and draft.engine.closed:  # before begin: the ring keeps what it held
            raise _draft_closed()
        if opts.speculative == "ngram":
            engine.ngram_table()  # read now, once: a table that does not hold together is refused before begin
        opts.sampling.check_vocabulary(engine.spec.vocab_size)
        return draft

    def _run(self, prompt_ids: list[int], draft) -> Iterator[Chunk]:
        engine, tok, cache, opts = self.engine, self.tok, self.cache, self.options
        vocab = engine.spec.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        feed, dropped = fit_prompt(cache, prompt_ids, self.overflow, opts.max_new_tokens)
        self.fed, self.prompt_dropped = feed, self.cut + dropped
        dropped_before = cache.dropped
        detok, stops = Detokenizer(tok, self.prefix[-Detokenizer.CONTEXT:] + prompt_ids), StopFilter(opts.stop)
        generated = array("i")  # 4 bytes a token: a list held an int object and a pointer, 40 bytes (a stream of
        # 100 M tokens would have held 4 GB; the ring itself is constant)
        # (tokens fed, text length they make, no text pending, cache mark) of the last tokens, for stop strings
        marks: deque = deque(maxlen=STOP_MARKS if opts.stop else 1)

        t0 = time.perf_counter()
        # a plan's smaller prefill calls (a hot device) only where they cannot change the reply: a prompt that
        # shifts the ring as it enters is attended otherwise in calls of another size (18 of 30 replies
        # differed, hostile round), and a portable graph pads every call to its fixed P (more work, not less)
        chunk = self.pacer.prefill_chunk if self.pacer is not None else None
        if chunk is not None and (not isinstance(engine, Engine) or cache.n_valid + len(feed) > cache.capacity):
            chunk = None
        logits = engine.prefill(cache, feed, chunk, before_chunk=self._check_cancelled)  # cancellable between chunks
        marks.append((0, 0, True, cache.mark()))
        t_prefill = time.perf_counter()
        stepper = self.stepper
        if opts.speculative:  # drafts come from what the ring can hold (a conversation's prefix is all its turns:
            history = self.prefix[-cache.capacity:] + feed  # indexing them each turn cost 52 ms at turn 1,000)
            drafter = ModelDrafter(draft, history) if opts.speculative == "draft" else None
            stepper = SpeculativeStepper(engine, stepper, history, opts.max_new_tokens, drafter=drafter)
            self.speculation = stepper.stats
        stepper.join(cache)
        try:
            window = opts.sampling.penalty_last_n if opts.sampling.has_penalties else 0  # the ids it keeps, at most
            history = ((self.prefix[-window:] if window else []) + feed) if opts.penalize_prompt else []
            sampler = Sampler(opts.sampling, opts.seed, history)
            finish, final, t_first = yield from self._decode(logits, sampler, detok, stops, generated, marks, stepper)
            if self.pacer is not None:
                self.pacer.finish()
        finally:
            stepper.leave(cache)
        t_first = t_first or t_prefill
        t_end = time.perf_counter()
        self.unfed = tuple(generated[-1:]) if finish == "length" else ()
        self.cached_ids = tuple(generated[:-1] if finish == "length" else generated)
        self.cached_text = text = stops.text  # joined once
        if finish == "stop":  # keep in the cache only whole tokens of the text before the stop string
            kept = [(n, length, m) for n, length, clean, m in marks if clean and length <= len(text)]
            self.cache_stale = not kept or not cache.rewind(kept[-1][2])
            self.cached_text = text[:kept[-1][1]] if kept else ""
            self.cached_ids = tuple(generated[:kept[-1][0]]) if kept else ()
        n, decode_s = len(generated), t_end - t_first
        self.unsent = final
        self.completion = Completion(
            text=text, token_ids=tuple(generated), finish_reason=finish,
            usage=Usage(len(self.prefix) + self.cut + len(prompt_ids), n,
                        self.prompt_dropped + cache.dropped - dropped_before, len(self.prefix)),
            timings=Timings(load_ms=self.load_ms, ttft_ms=(t_first - t0) * 1e3,
                            tpot_ms=decode_s * 1e3 / (n - 1) if n > 1 else 0.0,
                            prefill_tok_s=len(feed) / max(t_prefill - t0, 1e-9),
                            decode_tok_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                            paced_ms=self.pacer.paced_s * 1e3 if self.pacer is not None else 0.0))
        return final  # `steps` yields it once the context is released

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise GenerationCancelled("the request was cancelled")

    def _decode(self, logits, sampler: Sampler, detok: Detokenizer, stops: StopFilter, generated: array,
                marks: deque, stepper):
        """Step 4: sample, yield, feed back, until a finish. Returns (finish_reason, the last chunk or
        None, time of the first token); the last chunk is yielded by the caller once the completion is set."""
        cache, opts, overflow = self.cache, self.options, self.overflow
        eos = set() if opts.ignore_eos else set(self.tok.eos_ids)
        step, cancelled, max_new, want_marks = stepper.step, self.cancelled, opts.max_new_tokens, bool(opts.stop)
        pace = self.pacer.pace if self.pacer is not None else None
        held = self.held
        lp, top, text_len, t_first = None, (), 0, None
        while True:
            try:
                if self.logprobs is None:
                    token = sampler.sample(logits)
                else:
                    r = sampler.sample_with_logprobs(logits, top_n=self.logprobs)
                    token, lp, top = r.token, r.logprob, r.top
            except ValueError as e:  # ids and biases were checked: the logits are wrong, unless the bias banned all
                if str(e).startswith("all logits are -inf") and np.isfinite(logits).any():  # the bias banned the rest
                    raise InvalidArgumentError("logit_bias bans every token the model could give next (-inf "
                                               f"on each), at generated token {len(generated) + 1}") from None
                raise ModelFormatError(f"the model computed logits the sampler cannot use ({e}) at generated token "
                                       f"{len(generated) + 1}: {broken_logits_cause(cache.dtype)}") from None
            if t_first is None:
                t_first = time.perf_counter()
            if token in eos:
                rest = stops.feed(detok.flush())  # what the detokenizer held back (an incomplete character)
                rest += stops.flush()  # and what the stop filter held back
                return ("stop" if stops.stopped else "eos"), (Chunk(rest, None) if rest else None), t_first
            generated.append(token)
            sampler.accept(token)
            piece = detok.add(token)
            text = stops.feed(piece)
            if stops.stopped:
                return "stop", Chunk(text, token, lp, top, piece), t_first
            if len(generated) >= max_new or (overflow != "shift" and cache.full):
                text += stops.feed(detok.flush())
                finish = "stop" if stops.stopped else "length"
                return finish, Chunk(text + stops.flush(), token, lp, top, piece), t_first
            yield Chunk(text, token, lp, top, piece)
            if held is not None:  # the thread that resumed the steps holds the context (a stream may change threads)
                held.hand_to(threading.current_thread())
            if pace is not None:
                pace()
            if cancelled.is_set():
                raise GenerationCancelled("the request was cancelled")
            logits = step(cache, token)
            if want_marks:
                text_len += len(piece)
                marks.append((len(generated), text_len, detok.read == len(detok.ids), cache.mark()))

"""`Conversation`: a multi-turn chat whose KV cache persists across turns (turn N prefills only its new text).

State, and the invariant every public method keeps: the cache holds exactly the tokens of
`_prompt_text` (the last turn's rendered prompt) followed by `_reply` (its reply) less the last
sampled token (`_unfed`, fed at the start of the next turn); `messages` ends with that reply. An
empty `_prompt_text` means "the cache holds nothing useful": the next turn re-prefills the whole
rendered history.

A turn that starts over (`_ids_for`: also a `reply` that edits or drops earlier messages, a chat
UI's edit and regenerate) keeps the prefix of its rendering's ids that the cache holds (`_keepable`)
and prefills the rest. Those rows, earlier replies' among them, came from decode steps, whose float
rounding differs from a fresh conversation's prefill: the reply is the same up to a near-tie, which
may resolve the other way, as for every continued turn and `Model.generate`'s prefix cache
(`prefix_cache`).

A turn's prompt is the whole conversation: `_held`, its ids so far, then its new ones. Its
penalties count them all and its usage says so (prompt_tokens: all of them, as a stateless request
would count them; cached_tokens: those earlier turns fed), so a turn gives the tokens that plain
decoding of the same ids gives while they fit the ring (once the conversation has outgrown it, its
turns attend only to the sinks and the last tokens, while a prefill of the same ids sees the whole
prompt in each call: the two may differ).

A turn's new text is encoded as the whole rendering encodes it (`Tokenizer.encode_continuation`), so a
conversation continued turn by turn feeds the ids that a fresh one renders from its messages, except
where the template writes a reply with whitespace other than the model generated around it (the
fallback template puts a space after "Assistant:" before a reply that began without one, "'s"), where
the reply holds a special token that its text leaves out and that ends no generation (SmolLM2's
`<|im_start|>` mid-reply; a GGUF's conversion also stops at its `<|endoftext|>`), and where the
reply's text encodes back to other ids (a word the model spelled in pieces): the cache keeps what
was generated, as llama.cpp's server keeps a slot's tokens, and the turns after it may differ from
a fresh conversation's.

A turn commits (history and bookkeeping updated) only when its generation finishes. A turn that is
refused (ContextOverflowError under overflow="error", a bad option), fails, or is abandoned (its
stream closed or dropped half-way, Ctrl-C) is rolled back: `messages` is left as it was, and the
cache is rewound to where the turn started (a turn that started over and wrote nothing yet gets
the emptied or cut cache back, `RingKVCache.unforget`); if the turn's tokens already evicted or moved older
ones (the ring wrapped or re-based), the cache is emptied instead and the next turn re-prefills the
history, as a fresh conversation would when there was none.
That rebuild (also after a stop string that could not be taken back out of a wrapped ring, or a step
cut short) feeds, under overflow="shift", only what the ring can hold: the history's first `n_sink`
tokens and its last `capacity - n_sink` (the rest counted as dropped). Feeding all of it would end
in the same ring but cost time in proportion to the whole conversation (17,539 tokens for one turn
after 400 turns in a 64-token ring); the ring's older tokens then see less context than when they
were first fed, so the next reply may differ from one the rolled-back turn never preceded.

One turn at a time: another thread waits; a second live stream in the same thread is refused
(`ContextBusyError`). Conversations of one Model run in parallel, each with its own cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from edgeinfer.chat import check_messages, check_variables
from edgeinfer.context_lock import ContextLock
from edgeinfer.interrupts import interrupts_held
from edgeinfer.errors import EdgeInferError, InvalidArgumentTypeError, ModelClosedError
from edgeinfer.generation import Generation, Request
from edgeinfer.results import Completion
from edgeinfer.options import GenerationOptions, resolve
from edgeinfer.overflow import fits_beside, sinks_and_tail
from edgeinfer.prefix_cache import keepable

if TYPE_CHECKING:
    from edgeinfer.model import Model


class Conversation:
    """`say(content)` adds a user message and returns the reply; `reply(messages)` continues with a
    full message list (its already-seen prefix is not re-prefilled). `reset()` forgets everything."""

    def __reduce__(self):  # pickle: its cache lives in this process's Model
        raise InvalidArgumentTypeError("a Conversation cannot be pickled: pass its messages to the other process "
                                       "and continue them with conversation().reply(messages)")

    def __init__(self, model: "Model", template_variables: dict | None = None):
        self.model = model
        self.template_variables = check_variables(template_variables)  # checked now, defused at each rendering
        self.cache = model.new_cache()
        engine = model.engine
        self.lock = ContextLock("this conversation", closed=lambda: engine.closed)
        self.messages: list[dict] = []
        self._forget()

    def _forget(self) -> None:
        """Empty the cache and its bookkeeping (messages are kept: the next turn re-prefills them). The
        bookkeeping first: cut between the two, it says "nothing held" of a cache that still holds rows,
        which the next turn empties (it starts over), never the reverse."""
        self._clear()
        self.cache.reset()
        self._open: dict | None = None  # the turn under way: begun (it may have changed the cache), not ended

    def _clear(self) -> None:
        """The bookkeeping of an empty cache."""
        self._prompt_text = ""  # the last turn's rendered prompt (its tokens are in the cache)
        self._reply = ""  # the reply generated after it (its tokens are in the cache, but the last)
        self._unfed: list[int] = []  # last sampled token, not yet fed to the cache
        # the conversation's ids so far, in order, less `_unfed`: what was fed (the ring may have forgotten
        # the oldest; a rebuild fed only the ends of its rendering, all of which count), then the reply's
        # ids the cache holds. A turn's prompt is these and its new ids, for the penalties and the usage.
        self._held: list[int] = []
        self._rebuild = False  # emptied to recover (a failed rollback): the next turn feeds what the ring holds

    def _state(self) -> tuple:
        return self._prompt_text, self._reply, self._unfed, self._held, self._rebuild

    def _set_state(self, state: tuple) -> None:
        self._prompt_text, self._reply, self._unfed, self._held, self._rebuild = state

    @staticmethod
    def _held_history(state: tuple) -> bool:
        """Whether a `_state` held a history in the cache, or had a rebuild pending."""
        prompt_text, _, _, _, rebuild = state
        return bool(prompt_text) or rebuild

    def reset(self) -> None:
        """Forget the messages and the cache (`ContextBusyError` while this thread has a turn open).
        Allowed once the model is closed (the ring is the conversation's own), also after a wait for
        another thread's turn."""
        with self.lock.hold(refuse_closed=False), interrupts_held():
            self.messages = []
            self._forget()

    def say(self, content: str, options: GenerationOptions | None = None, **overrides) -> Completion:
        """Add a user message `content` and return the reply (`stream_say`, run to its end); the reply is
        added to the history. A turn that fails or is abandoned is rolled back."""
        return self.stream_say(content, options, **overrides).run_to_end()

    def stream_say(self, content: str, options: GenerationOptions | None = None, **overrides) -> Generation:
        """Options are checked now; the turn runs (and holds the conversation) from the first next()."""
        return self._turn(None, _user_text(content), resolve(options, overrides))

    def reply(self, messages: Sequence[dict], options: GenerationOptions | None = None, **overrides) -> Completion:
        """Continue with a full message list (the history is replaced by it, then the reply added): the
        prefix it shares with what the cache holds is not prefilled again."""
        return self._turn(check_messages(messages), None, resolve(options, overrides)).run_to_end()

    def _turn(self, messages: list[dict] | None, content: str | None, opts: GenerationOptions) -> Generation:
        """One turn: messages given (reply) or the history plus a user message (say). It commits when
        its Generation completes; otherwise (refused, failed, abandoned) it is rolled back."""
        m, turn = self.model, {}
        if m.closed:
            raise ModelClosedError()
        opts.sampling.check_vocabulary(m.engine.spec.vocab_size)  # now, as the docstrings say

        def begin(req: Request) -> list[int]:  # under the lock, at the first next()
            with interrupts_held():  # the repairs whole or not at all (a Ctrl-C waits for their end)
                if self._open is not None:  # a turn whose `end` never ran (a Ctrl-C as its steps ended)
                    stale, self._open = self._open, None
                    try:
                        self._roll_back(stale)
                    except BaseException:  # (never seen) the cache emptied rather than this tried again each turn
                        self._recover()
                        raise
                if not self.cache.intact:  # a mutation was cut short (Ctrl-C inside a step): start clean
                    self._recover()
            msgs = list(messages) if messages is not None else self.messages + [{"role": "user", "content": content}]
            full = m.template.render(msgs, add_generation_prompt=True, defuse=m.tokenizer.defuse,
                                     variables=self.template_variables, undefuse=m.tokenizer.undefuse)
            ids, whole, over = self._ids_for(full, opts)
            keep = self._keepable(whole, opts) if over else 0
            if not ids:
                raise EdgeInferError("nothing new to say: the messages add no text")
            with interrupts_held():  # the turn's changes begin whole: from here until `end` has run, whatever
                turn.update(msgs=msgs, full=full, whole=whole, over=over, before=self._state(),  # stops the turn
                            mark=self.cache.mark())  # undoes it (`_roll_back`)
                self._open = turn
                if over:  # the cache is emptied but for the prefix it shares with the rendering (its rows kept
                    turn["forgotten"] = self.cache.forget(keep)  # until written: `unforget` takes it back)
                    self._clear()
                    keep = self.cache.n_valid
                    if keep:  # an edited or regenerated turn: the shared turns are not prefilled again
                        ids, req.prefix = whole[keep:], whole[:keep]
                else:  # the cache holds the history: the turn's prompt begins with it
                    req.prefix = self._held
                req.cut = len(whole) - keep - len(ids)
            return ids

        def end(req: Request) -> None:  # with Ctrl-C held off (`Request.steps`)
            if self._open is not turn:  # begin changed nothing (it failed first), or a later begin undid it
                return
            self._open = None
            if req.completion is not None:
                self._commit(turn["msgs"], turn["full"], turn["whole"], req)
            else:
                self._roll_back(turn)

        return Generation(m.engine, m.tokenizer, self.cache, opts, m.overflow, begin=begin, end=end, lock=self.lock,
                          load_ms=m.load_ms, power=m.power)

    def _commit(self, msgs: list[dict], full: str, whole: list[int], gen: Request) -> None:
        """The turn finished: the history gains the reply; the bookkeeping says what the cache holds
        (the reply's text less a stop string, the Generation having taken its tokens back out).
        `whole`: the turn's prompt ids past the cache's (a rebuild fed only some of them)."""
        self.messages = msgs + [{"role": "assistant", "content": gen.completion.text}]
        if gen.cache_stale:
            self._recover()
        else:
            # the reply as the next rendering holds it: control strings in it defused, as in `full`
            self._prompt_text, self._reply = full, self.model.tokenizer.defuse(gen.cached_text)
            self._unfed = list(gen.unfed)
            self._held = gen.prefix + (whole if gen.cut else gen.fed) + list(gen.cached_ids)
            self._rebuild = False

    def _roll_back(self, turn: dict) -> None:
        """The turn did not finish: the cache and its bookkeeping go back to where the turn began when
        they can (nothing it fed evicted or moved an older token; or, for a turn that started over,
        nothing was written since the cache was emptied). Otherwise the cache is emptied: the next
        turn feeds the history again, rebuilding what the ring holds when it held something (the
        module doc), or starting as a fresh conversation would when it held nothing. Any point at
        which the turn stopped (a Ctrl-C between two of `begin`'s steps) ends in one of these."""
        if turn["over"]:  # its `forget` may not have returned (then nothing can be taken back)
            restored = "forgotten" in turn and self.cache.unforget(turn["forgotten"])
        else:
            restored = self.cache.rewind(turn["mark"])
        if restored:
            self._set_state(turn["before"])
        elif self._held_history(turn["before"]):
            self._recover()
        else:
            self._forget()

    def _recover(self) -> None:
        """The cache no longer matches the history: empty it, and have the next turn rebuild it."""
        self._forget()
        self._rebuild = True

    def _ids_for(self, full: str, opts: GenerationOptions) -> tuple[list[int], list[int], bool]:
        """(token ids this turn feeds, the ids they stand for, whether it starts over): the new text
        after what the cache holds, or (starting over: the first turn, a template whose earlier turns
        render differently, truncation, a recovery, a rendering the cache holds whole: a reply with no
        text regenerated) the whole rendering; rebuilding after a recovery
        under overflow="shift", only its first n_sink and last capacity - n_sink tokens (the module
        doc). Under overflow="truncate", a turn that would not fit beside what the cache holds starts
        over, so that truncation drops the oldest turns, not the new one. Changes nothing."""
        m, cache = self.model, self.cache
        new_text = self._new_text(full)
        if new_text:  # ("": the rendering is what the cache holds, a reply with no text regenerated: start over)
            ids = self._unfed + m.tokenizer.encode_continuation(new_text)
            if ids and fits_beside(cache.n_valid, len(ids), cache.capacity, m.overflow, opts.max_new_tokens):
                return ids, ids, False
        ids = m.encode_rendered(full)
        if self._rebuild and m.overflow == "shift" and len(ids) > cache.capacity:
            return sinks_and_tail(ids, cache.n_sink, cache.capacity), ids, True
        return ids, ids, True

    def _keepable(self, whole: list[int], opts: GenerationOptions) -> int:
        """How many of a turn's first ids (`whole`, the rendering it starts over with) the cache can keep:
        their common prefix with `_held`, by the prefix cache's rules (`prefix_cache.keepable`), when the
        cache holds `_held` exactly (nothing evicted or re-based, no rebuild pending); else 0."""
        c = self.cache
        if not self._prompt_text or self._rebuild or len(self._held) != c.n_valid or c.dropped or c.rebased_tokens \
                or not c.intact:
            return 0
        return keepable(self._held, whole, c.capacity, self.model.overflow, opts.max_new_tokens)

    def _new_text(self, full: str) -> str | None:
        """The part of this turn's rendering that the cache has not seen, or None to start over.

        The cache holds the last rendered prompt and the generated reply; the template renders that
        reply again (maybe with other whitespace around it), so what follows it is the new text.
        """
        if not self._prompt_text or not full.startswith(self._prompt_text):
            return None
        rest = full[len(self._prompt_text):]
        i = rest.find(self._reply) if self._reply else 0
        if i < 0 or rest[:i].strip():
            return None
        return rest[i + len(self._reply):]


def _user_text(content) -> str:
    if not isinstance(content, str):
        raise InvalidArgumentTypeError(f"content must be a string, got {type(content).__name__}")
    return content


"""The public API: `edgeinfer.load(...) -> Model`, `Model.generate / stream / chat`, `Conversation`.

Ownership: a Model owns the ONNX Runtime session (read-only weights), one Engine (its run-state
buffers) and one default ring-buffer KV cache used by `generate` and `stream` (reset per call).
Each `Conversation` owns its own cache, allocated once when it is created, so a server can hold
several conversations over one Model.

Threads: a Model is safe to share. `generate`/`stream` serialise on the default context's lock
(`ContextLock`: another thread waits, the same thread with a live stream is refused); each
Conversation has its own lock and cache, so conversations run side by side, their graph calls
interleaving on the Engine's lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from edgeinfer.chat import ChatTemplate
from edgeinfer.portable_engine import open_engine
from edgeinfer.errors import (EdgeInferError, InvalidArgumentError, InvalidArgumentTypeError, ModelClosedError,
                              ModelFormatError, warn_user)
from edgeinfer.context_lock import ContextBusyError, ContextLock
from edgeinfer.interrupts import interrupts_held
from edgeinfer.conversation import Conversation
from edgeinfer.generation import Generation, Request
from edgeinfer.results import Completion
from edgeinfer.kv_cache import RingKVCache, Snapshot
from edgeinfer.options import GenerationOptions, resolve
from edgeinfer.prompt_ids import prompt_ids
from edgeinfer.prefix_cache import PrefixSnapshot, destination, held_after, reuse
from edgeinfer.sampling.params import is_integer
from edgeinfer.overflow import (DEFAULT_PREFILL_CHUNK, check_policy, rebase_warning, refuse_longer_than_ring,
                                resolve_capacity, resolve_sinks)
from edgeinfer.power.controller import PowerController, PowerState
from edgeinfer.power.policy import resolve_policy
from edgeinfer.power.sensors import Sensors
from edgeinfer.power.threads import SPIN_DURATION_US
from edgeinfer.integrity import LOAD_ATTEMPTS, folder_identity, replaced_while_loading
from edgeinfer.manifest import read_manifest
from edgeinfer.session import DecoderSession, check_threads
from edgeinfer.drafting import Draft, check_pair
from edgeinfer.tokenizer import Tokenizer

DEFAULT_MODEL = "stories260K-int8"


def default_model_path() -> Path:
    """The bundled model (stories260K at int8, converted by our converter), shipped as package data."""
    return Path(str(resources.files("edgeinfer.models") / DEFAULT_MODEL))


def load(path: str | Path | None = None, *, provider: str = "auto", threads: int | None = None,
         capacity_tokens: int | None = None, n_sink: int | None = None, overflow: str = "shift",
         prefill_chunk: int = DEFAULT_PREFILL_CHUNK, verbose: bool = False, power=None) -> "Model":
    """Load an edgeinfer model folder (None: the bundled default model).

    provider: "auto" (the detected device profile's, `platforms.detect`) | "cpu" | "cuda"; threads: None
    (the device profile's count, or onnxruntime's default where the profile says "auto") or a positive int;
    capacity_tokens: the KV ring's size, an int in [2, the model's trained length T] and more than
    n_sink (so at least 5 with the default 4 sinks; default: the
    manifest's, capped at the device profile's and at T less a sixteenth, the room a full ring
    re-bases in; a larger one re-bases more often, with a warning); n_sink: first tokens the ring
    never overwrites, in [0, capacity_tokens) (default 4). A model with a sliding window W < T attends to its last W tokens only, exactly as
    transformers masks it: its ring holds at most W - 1 (the default) and, by default, no sinks
    (`kv_cache.binding_window`);

    overflow: "shift" | "truncate" | "error"; prefill_chunk: a positive int (tokens per prefill call).
    power: None (off), "performance" | "balanced" | "battery" | "thermal-guard", or a
    `power.Policy` with limits: a controller samples this device's sensors twice a second and paces
    decoding, limits the cores and refuses background work as the policy says (docs/power.md).
    The KV memory is allocated here, once, and printed to stderr when `verbose`; a capacity whose KV
    cache needs more bytes than the memory available now is refused before allocating.
    A bad argument raises `InvalidArgumentError` (a ValueError) or `InvalidArgumentTypeError` (a
    TypeError), both `EdgeInferError`s; a bad folder raises `ModelFormatError`.
    """
    return Model(path, provider=provider, threads=threads, capacity_tokens=capacity_tokens, n_sink=n_sink,
                 overflow=overflow, prefill_chunk=prefill_chunk, verbose=verbose, power=power)


class Model:
    """A loaded model folder (made by `load`, whose docstring gives the arguments): its ONNX Runtime
    session, tokenizer and chat template, and a default KV context that `generate`, `stream`, `chat`
    and `encode_chat` share (one caller at a time: `ContextBusyError` for a second stream opened in
    the same thread); `conversation()` gives a context of its own. Thread-safe: calls from several
    threads take turns on the engine. Freed by `close()` (or at the end of a `with` block), else
    when the last reference to it (its streams' and conversations' included) goes; a forked child
    keeps the sessions it inherited until it exits (`ort_lifecycle`). It cannot be pickled."""

    def __reduce__(self):  # pickle (multiprocessing's spawn, Pool.map): a session does not travel
        raise InvalidArgumentTypeError("a Model cannot be pickled or copied: pass its folder to the other process "
                                       "and load it there (in this one, share the Model itself)")

    def __init__(self, path, *, provider, threads, capacity_tokens, n_sink, overflow, prefill_chunk, verbose, power,
                 spin_duration_us: int | None = None, device_capacity: bool = True):
        """`load`'s arguments; spin_duration_us: how long the session's idle workers spin (None: ONNX
        Runtime's default; power control and draft models spin briefly, `power.threads`); device_capacity:
        whether a load without capacity_tokens takes the device profile's (not for a draft model, whose
        ring is its own default, as the target's is not the device's when given)."""
        t0 = time.perf_counter()
        if path is not None and (not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str)):
            raise InvalidArgumentTypeError(f"path must be a folder path (str or os.PathLike giving str) or None, "
                                           f"got {type(path).__name__}")  # (one whose fspath is bytes: a TypeError)
        folder = Path(path) if path is not None else default_model_path()
        # numpy integers as the ints they are (they were refused as "not an integer", where generation's
        # options take them)
        threads, capacity_tokens, n_sink, prefill_chunk = (int(v) if is_integer(v) else v for v in
                                                           (threads, capacity_tokens, n_sink, prefill_chunk))
        check_policy(overflow)
        if not isinstance(verbose, bool):
            raise InvalidArgumentError(f"verbose must be True or False, got {verbose!r}")
        check_threads(threads, warn=False)  # early, before any work; the session warns
        from edgeinfer.platforms import detect, device_capacity_tokens
        profile = None
        if threads is None or capacity_tokens is None and device_capacity:  # the device profile's defaults
            profile = detect().profile
        if threads is None:  # ("auto" leaves ONNX Runtime's choice)
            threads = profile.session_threads
        policy = resolve_policy(power)
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InvalidArgumentError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.folder = folder
        self.threads = threads
        self.overflow = overflow
        spin = SPIN_DURATION_US if policy is not None else spin_duration_us
        for attempt in range(1, LOAD_ATTEMPTS + 1):  # one conversion's files (`folder_identity`)
            seen = folder_identity(folder)
            self.session = self.tokenizer = self.engine = None  # a replaced folder's freed before the next is made
            try:
                self.manifest = read_manifest(folder)
                spec = self.manifest.arch
                device = device_capacity_tokens(self.manifest.portable is not None, profile) \
                    if capacity_tokens is None and device_capacity else None
                capacity = resolve_capacity(self.manifest.default_capacity_tokens, spec, capacity_tokens, device)
                sinks = resolve_sinks(spec, n_sink)
                if (note := rebase_warning(capacity, spec.max_position_embeddings)) is not None:
                    warn_user(note)
                portable = self.manifest.portable
                if portable is not None:
                    portable.check_capacity(capacity)  # before the slow loading
                RingKVCache.check_geometry(spec, capacity, sinks, min(prefill_chunk, capacity),  # before the slow part
                                           rows=portable.ring_rows if portable is not None else None,
                                           itemsize=2 if self.manifest.interface.kv_dtype == "float16" else 4)
                self.capacity_tokens, self.n_sink = capacity, sinks
                self.session = DecoderSession(folder, threads=threads, provider=provider, manifest=self.manifest,
                                              spin_duration_us=spin)  # checks every listed file first
                self.tokenizer = Tokenizer(folder, self.manifest.tokenizer)  # so this reads checked files only
                # a portable engine opens the folder's prefill graph and embeddings: the same rule (it came
                # after, and a folder replaced meanwhile ran one conversion's graph with another's: a hostile round)
                self.engine = open_engine(self.session, min(prefill_chunk, capacity), threads, spin)
            except (EdgeInferError, OSError):
                if folder_identity(folder) == seen:
                    raise
                if attempt == LOAD_ATTEMPTS:
                    raise ModelFormatError(replaced_while_loading(folder)) from None
                continue
            if folder_identity(folder) == seen:
                break
        else:
            raise ModelFormatError(replaced_while_loading(folder))
        self.cache = self.new_cache()
        self.held: list[int] | None = None  # the ids the default cache holds, in order (None: not known)
        self.lent_to: str | None = None  # who took the default ring for good (`lend_default_cache`)
        engine = self.engine  # (not self: the lock would make a cycle that keeps a dropped model until gc runs)
        self.lock = ContextLock("the model's default context (generate/stream)", closed=lambda: engine.closed)
        tk = self.manifest.tokenizer
        self.template = ChatTemplate(tk.chat_template, self._piece(tk.bos_token_id),
                                     self._piece((tk.eos_token_ids or (None,))[0]))
        if self.template.error is not None:  # completions work; chat will refuse (said now, not first in a request)
            warn_user(f"{folder}: {self.template.error}; chat and conversations will refuse it")
        self.power = PowerController(policy, Sensors()).start() if policy is not None else None
        self.load_ms = (time.perf_counter() - t0) * 1e3
        if verbose:
            print(f"edgeinfer: loaded {folder} in {self.load_ms:.0f} ms; KV cache {self.cache.bytes / 2**20:.2f} MiB "
                  f"({spec.num_layers} layers x 2 x {spec.num_kv_heads} kv heads x {self.cache.rows} rows x "
                  f"{spec.head_dim} x {self.cache.dtype.itemsize} bytes; a ring of {self.capacity_tokens}), "
                  f"{self.n_sink} sinks, overflow={overflow}, provider {self.session.provider}",
                  file=sys.stderr)

    def _piece(self, token_id) -> str:
        """What a chat template gets as bos_token / eos_token: the token's own string ("<s>"), "" for none."""
        return "" if token_id is None else self.tokenizer.token_string(token_id)

    def new_cache(self) -> RingKVCache:
        """A ring of this model's capacity (refused before allocating if memory is short)."""
        return self.engine.new_cache(self.capacity_tokens, self.n_sink)

    def close(self) -> None:
        """Free the model now, rather than when the last reference to it goes: its ONNX Runtime
        sessions (the weights), its default KV ring and its power control, the freed pages given
        back to the system (glibc: `ort_lifecycle.return_freed_memory`); a draft model is detached
        (and freed unless the caller holds it). A graph call in flight in another thread ends first;
        that thread's stream then raises ModelClosedError at its next call. A stream, open or
        finished, holds the default ring until it is dropped; a conversation's ring is its own, freed
        when the conversation goes. Afterwards generating, chatting, snapshots, set_draft and new
        conversations raise ModelClosedError; the tokenizer and the model's description stay (until
        the Model goes). Idempotent, whole or not at all (a Ctrl-C waits for its end); `with
        edgeinfer.load(...) as model:` closes at the block's end. Called from a signal handler
        (SIGTERM's, say) while this thread is in a graph call, it frees the sessions once that call
        ends, and the generation raises at its next."""
        if self.cache is None and self.engine.dropped:  # (a signal's handler may call it again and again)
            return
        with interrupts_held():
            self.cache = self.held = None  # (a stream holds its own reference)
            self.engine.close()
            if self.power is not None:
                self.power.stop()

    @property
    def closed(self) -> bool:
        """Whether `close` has run (its sessions are let go once the call in flight ends)."""
        return self.engine.closed

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ModelClosedError()

    def _open_cache(self) -> RingKVCache:
        """The default ring, or ModelClosedError, or ContextBusyError once it is lent."""
        cache = self.cache
        if cache is None or self.engine.closed:
            if self.lent_to is not None and not self.engine.closed:
                raise self._lent_error()
            raise ModelClosedError()
        return cache

    def _lent_error(self) -> ContextBusyError:
        return ContextBusyError(f"the model's default context (generate, stream, snapshot, restore) belongs to "
                                f"{self.lent_to}: use model.conversation() for a context of its own, or load the "
                                "model a second time")

    def lend_default_cache(self, to: str) -> RingKVCache:
        """Give the default ring to `to` (a server's scheduler, which uses it as a slot) for the rest of
        the model's life, and return it: afterwards generate, stream, snapshot and restore raise
        ContextBusyError naming `to` (a stream made before, not yet begun, too), as they would otherwise
        write into rows the new owner holds; conversations keep their own rings. Once lent, a later
        call gets a new ring (a second server on the model). Waits for a stream of another thread that
        holds the default context to end (ContextBusyError if it is this thread's)."""
        if self.lent_to is None:
            try:
                with self.lock.hold():
                    if self.lent_to is None:  # (not lent while this waited for the lock)
                        with interrupts_held():  # both or neither (a Ctrl-C between left an open model read as closed)
                            cache, self.lent_to = self._open_cache(), to
                            self.cache = self.held = None
                        return cache
            except ContextBusyError as e:
                raise ContextBusyError(f"{to} cannot take the model's default context: {e}") from None
        self._check_open()
        return self.new_cache()

    def encode_prompt(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """The prompt's token ids.

        Text (str, valid UTF-8) is tokenized, with BOS as the model's tokenizer config says. Token ids
        (a list, tuple or other Sequence of ints, or a 1-D numpy array of an integer dtype) are used as they are, and
        each must be in [0, vocab_size). bytes are refused (decode them to text first), and so are bool
        or float ids. Errors: InvalidArgumentTypeError for a wrong type, InvalidArgumentError for an
        empty prompt or an id outside the vocabulary.
        """
        return prompt_ids(prompt, self.tokenizer, self.manifest.arch.vocab_size)

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat: BOS once, whether the template wrote it or the tokenizer
        config asks for it."""
        bos = self.tokenizer.add_bos
        if self.template.bos_token and text.startswith(self.template.bos_token):
            text, bos = text[len(self.template.bos_token):], True
        return self.tokenizer.encode(text, add_bos=bos)

    def encode_chat(self, messages: Sequence[dict], template_variables: dict | None = None) -> list[int]:
        """Token ids of `messages` in the model's chat template, ending with the assistant's cue;
        `template_variables` as `chat.check_variables` takes them ({"enable_thinking": False})."""
        return self.encode_rendered(self.template.render(messages, add_generation_prompt=True,
                                                         defuse=self.tokenizer.defuse, variables=template_variables,
                                                         undefuse=self.tokenizer.undefuse))

    def stream(self, prompt: str | Sequence[int], options: GenerationOptions | None = None, **overrides) -> Generation:
        """A Generation: iterate for Chunks (joined, their text equals `generate(...).text`); its
        `completion` is set when it ends.

        Options (a GenerationOptions, and/or its flat keywords: max_new_tokens, temperature, top_k,
        top_p, min_p, typical_p, repetition_penalty, frequency_penalty, presence_penalty,
        penalty_last_n, logit_bias, stop, seed, ignore_eos, penalize_prompt, speculative) and the prompt
        are checked now. From its first next() until it ends (or is closed or dropped) the stream holds
        the model's default context: `generate` or `stream` from another thread waits for it; from the same thread they
        raise ContextBusyError. Once a server serves this Model, the default context is the server's
        (`lend_default_cache`): they raise ContextBusyError; `conversation()` has a ring of its own.
        """
        opts, ids, cache = resolve(options, overrides), self.encode_prompt(prompt), self._open_cache()
        opts.sampling.check_vocabulary(self.engine.spec.vocab_size)  # (it waited for the first next(); a hostile round)

        begun = []

        def begin(req: Request) -> list[int]:  # the longest prefix the default cache holds is kept, the rest prefilled
            if self.cache is not cache and self.lent_to is not None:  # lent after this stream was made
                raise self._lent_error()
            if self.overflow == "error":  # before `reuse` empties the ring for it (a restored prefix was lost)
                refuse_longer_than_ring(ids, cache.capacity)
            held, self.held = self.held, None  # unknown while the request runs
            n = reuse(held, ids, cache, self.overflow, opts.max_new_tokens)
            req.prefix = ids[:n]
            begun.append(n)
            return ids[n:]

        def end(req: Request) -> None:  # not begun: held as it was (begin never ran: a cancel before the first
            # next()), or None (begin cut short by a Ctrl-C, after it forgot it)
            if begun:
                self.held = held_after(req, ids, cache) if self.cache is cache else None

        return Generation(self.engine, self.tokenizer, cache, opts, self.overflow, begin=begin, end=end,
                          lock=self.lock, load_ms=self.load_ms, power=self.power)

    def generate(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
                 **overrides) -> Completion:
        """Generate a completion of `prompt` (temperature 0: greedy); options as for `stream`."""
        return self.stream(prompt, options, **overrides).run_to_end()

    def chat(self, messages: Sequence[dict], options: GenerationOptions | None = None, *,
             template_variables: dict | None = None, **overrides) -> Completion:
        """One reply to `messages` with the model's chat template (stateless: a fresh conversation);
        `template_variables` as for `conversation`."""
        return self.conversation(template_variables).reply(messages, options, **overrides)

    def snapshot(self, prefix: str | Sequence[int] | None = None, path: str | Path | None = None) -> PrefixSnapshot:
        """A warmed prefix (a system prompt) to reuse: with `prefix`, the default cache is emptied and
        prefilled with it first (its ids as `encode_prompt` makes them); else what the cache holds now.
        Written to `path` too when given. `restore` puts it back; a later prompt that starts with its
        ids then prefills only the rest."""
        if path is not None:
            destination(path)  # checked before the cache is emptied for the prefix
        fingerprint = self.fingerprint()  # (refused: before it too)
        with self.lock.hold():
            cache = self._open_cache()
            if prefix is not None:
                ids = prompt_ids(prefix, self.tokenizer, self.manifest.arch.vocab_size, "prefix")
                if len(ids) > self.capacity_tokens:  # the ring would shift: it could not hold the prefix whole
                    raise InvalidArgumentError(f"the prefix has {len(ids)} tokens, more than the ring's "
                                               f"{self.capacity_tokens}")
                cache.reset()
                self.held = None
                self.engine.prefill(cache, ids)
                self.held = ids
            if not self.held or len(self.held) != cache.n_valid:
                raise InvalidArgumentError("the default cache holds no prefix known exactly: give `prefix`")
            snap = PrefixSnapshot(tuple(self.held), cache.snapshot(), fingerprint)
        if path is not None:
            snap.save(path)
        return snap

    def restore(self, snapshot: PrefixSnapshot | str | Path) -> None:
        """Put a `snapshot` (or the file it was saved to) back in the default cache. Refused
        (InvalidArgumentError) when it came from other weights or does not fit this model's ring."""
        spec, dtype = self.manifest.arch, self._open_cache().dtype
        if not isinstance(snapshot, (PrefixSnapshot, str, os.PathLike)):
            raise InvalidArgumentTypeError(f"path must be a str or a path, got {type(snapshot).__name__} (or a "
                                           "PrefixSnapshot, from Model.snapshot)")
        snap = snapshot if isinstance(snapshot, PrefixSnapshot) else \
            PrefixSnapshot.load(snapshot, spec.num_layers, (spec.num_kv_heads, spec.head_dim), self.capacity_tokens)
        if snap.model != self.fingerprint():
            raise InvalidArgumentError("the snapshot was taken from another model (its files differ: other "
                                       "weights, or another conversion of them: another capacity or format)")
        spec, n = self.manifest.arch, len(snap.token_ids)
        want = (n, spec.num_kv_heads, spec.head_dim)
        if n > self.capacity_tokens or len(snap.kv.k) != spec.num_layers or len(snap.kv.v) != spec.num_layers or \
                any(a.shape != want or a.dtype != dtype for a in snap.kv.k + snap.kv.v):
            raise InvalidArgumentError(f"the snapshot ({n} tokens) does not fit this model's ring "
                                       f"({self.capacity_tokens} tokens of {want[1:]} per layer)")
        if any(not 0 <= t < spec.vocab_size for t in snap.token_ids):
            raise InvalidArgumentError(f"the snapshot's token ids are outside the vocabulary [0, {spec.vocab_size})")
        if not all(np.isfinite(a).all() for a in snap.kv.k + snap.kv.v):  # it would poison every reuse of it
            raise InvalidArgumentError("the snapshot holds values that are not finite (NaN or infinity)")
        # a prefix's bookkeeping, in this ring's terms (its own sinks), whatever the file said
        with self.lock.hold():
            cache = self._open_cache()
            kv = Snapshot(snap.kv.k, snap.kv.v, np.arange(n, dtype=cache.positions.dtype), n, cache.n_sink, n, 0, 0)
            self.held = None
            cache.restore(kv)
            self.held = list(snap.token_ids)

    def fingerprint(self) -> str:
        """sha256 over the model's files' sha256s (from its manifest): which weights a snapshot needs.
        InvalidArgumentError for a folder whose manifest lists no files (edited by hand: every converter
        writes the list; loaded unchecked): it would be every such folder's, and `restore` took another
        model's snapshot (a hostile round)."""
        files = self.manifest.files
        if not files:
            raise InvalidArgumentError(f"{self.folder}'s manifest lists no files: a snapshot could not tell its "
                                       "weights from another model's; convert the model again")
        return hashlib.sha256("".join(f"{k}:{files[k]['sha256']};" for k in sorted(files)).encode()).hexdigest()

    def set_draft(self, draft: "Model | str | os.PathLike | None") -> "Model | None":
        """Attach a small model of the same tokenizer for `speculative="draft"` (None: detach); returns
        it. A folder is loaded with this model's threads (its own provider), its idle workers spinning only
        briefly (a draft's pool spinning between its bursts took 25 % of the target's speed on 2 cores,
        measured). Drafts are checked by this model, so the tokens are this model's whatever the draft
        says; each request gets its own ring of the draft model (the draft's capacity). Refused
        (InvalidArgumentError) unless both map every id to the same token (`Tokenizer.same_as`) and have
        the same vocabulary size (a padded embedding too: `drafting.check_pair`), and the draft runs the
        fused graph (a portable one cannot feed drafts); a closed draft is refused too. A folder refused
        so is closed again, its memory given back."""
        self._check_open()
        if draft is None:
            self.engine.draft = None
            return None
        loaded = isinstance(draft, (str, os.PathLike))
        if loaded:
            if not str(draft):
                raise InvalidArgumentError("the draft model's folder is empty: give its path")
            try:
                draft = Model(draft, provider="auto", threads=self.threads, capacity_tokens=None,
                              n_sink=None, overflow="shift", prefill_chunk=self.engine.max_chunk,
                              verbose=False, power=None, spin_duration_us=SPIN_DURATION_US, device_capacity=False)
            except EdgeInferError as e:
                raise type(e)(f"the draft model: {e}") from None
        if not isinstance(draft, Model):
            raise InvalidArgumentTypeError(f"draft must be a Model, a folder or None, got {type(draft).__name__}")
        try:
            check_pair(self, draft)
            self.engine.attach_draft(Draft(draft.engine, draft.capacity_tokens, draft.n_sink))  # unless closed meanwhile
        except BaseException:
            held = getattr(self.engine, "draft", None)  # a portable engine has none
            attached = held is not None and held.engine is draft.engine  # a Ctrl-C came after the attach: keep it
            if loaded and not attached:
                with contextlib.suppress(Exception):  # the refusal is what the caller must see
                    draft.close()  # loaded here for this model alone: nothing else holds it
            raise
        return draft

    def power_state(self) -> PowerState | None:
        """The power controller's last readings and plan (None when loaded with power=None)."""
        return self.power.state() if self.power is not None else None

    def conversation(self, template_variables: dict | None = None) -> Conversation:
        """A new conversation with its own KV cache (allocated now, the same size as the default).
        `template_variables`: more names for the chat template at every turn, as transformers'
        `apply_chat_template(**kwargs)` takes them ({"enable_thinking": False} for Qwen3; JSON values,
        `chat.check_variables`)."""
        return Conversation(self, template_variables)

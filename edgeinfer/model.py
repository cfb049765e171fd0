"""The public API: `edgeinfer.load(...) -> Model`, `Model.generate / stream / chat`, `Conversation`.

Ownership: a Model owns the ONNX Runtime session (read-only weights), one Engine (its run-state
buffers) and one default ring-buffer KV cache used by `generate` and `stream` (reset per call).
Each `Conversation` owns its own cache, allocated once when it is created, so a server can hold
several conversations over one Model. Calls are sequential: a Model is not thread-safe.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

from edgeinfer.chat import ChatTemplate
from edgeinfer.engine import Engine
from edgeinfer.errors import EdgeInferError
from edgeinfer.generation import Chunk, Completion, make_request, run
from edgeinfer.kv_cache import OVERFLOW_POLICIES, RingKVCache
from edgeinfer.manifest import read_manifest
from edgeinfer.session import DecoderSession
from edgeinfer.tokenizer import Tokenizer

DEFAULT_MODEL = "stories260K-int8"


def default_model_path() -> Path:
    """The bundled model (stories260K at int8, converted by our converter), shipped as package data."""
    return Path(str(resources.files("edgeinfer.models") / DEFAULT_MODEL))


def load(path: str | Path | None = None, *, provider: str = "auto", threads: int | None = None,
         capacity_tokens: int | None = None, n_sink: int = 4, overflow: str = "shift",
         prefill_chunk: int = 256, verbose: bool = False) -> "Model":
    """Load an edgeinfer model folder (None: the bundled default model).

    capacity_tokens: the KV ring's size (default: the manifest's, capped at the model's sliding
    window); n_sink: first tokens the ring never overwrites; overflow: "shift" | "truncate" | "error".
    The KV memory is allocated here, once, and printed to stderr when `verbose`.
    """
    return Model(path, provider=provider, threads=threads, capacity_tokens=capacity_tokens, n_sink=n_sink,
                 overflow=overflow, prefill_chunk=prefill_chunk, verbose=verbose)


class Model:
    def __init__(self, path, *, provider, threads, capacity_tokens, n_sink, overflow, prefill_chunk, verbose):
        t0 = time.perf_counter()
        folder = Path(path) if path is not None else default_model_path()
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
        self.manifest = read_manifest(folder)
        spec = self.manifest.arch
        capacity = capacity_tokens if capacity_tokens is not None else self.manifest.default_capacity_tokens
        if spec.sliding_window and capacity > spec.sliding_window:
            capacity = spec.sliding_window if capacity_tokens is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"capacity_tokens must be an integer >= 2, got {capacity!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.folder = folder
        self.overflow = overflow
        self.capacity_tokens, self.n_sink = capacity, n_sink
        self.tokenizer = Tokenizer(folder, self.manifest.tokenizer)
        self.session = DecoderSession(folder, threads=threads, provider=provider, manifest=self.manifest)
        self.engine = Engine(self.session, max_chunk=min(prefill_chunk, capacity))
        self.cache = self.new_cache()
        tk = self.manifest.tokenizer
        self.template = ChatTemplate(tk.get("chat_template"), self._piece(tk.get("bos_token_id")),
                                     self._piece((tk.get("eos_token_ids") or [None])[0]))
        self.load_ms = (time.perf_counter() - t0) * 1e3
        if verbose:
            print(f"edgeinfer: loaded {folder} in {self.load_ms:.0f} ms; KV cache {self.cache.bytes / 2**20:.2f} MiB "
                  f"({spec.num_layers} layers x 2 x {spec.num_kv_heads} kv heads x ({capacity} + "
                  f"{self.engine.max_chunk}) slots x {spec.head_dim} x 4 bytes), {n_sink} sinks, overflow={overflow}",
                  file=sys.stderr)

    def _piece(self, token_id) -> str:
        return "" if token_id is None else self.tokenizer.decode([token_id]) or ""

    def new_cache(self) -> RingKVCache:
        return self.engine.new_cache(self.capacity_tokens, self.n_sink)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Text is tokenized (with BOS as the model's tokenizer config says); a list of ids is used as-is."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: give text, or [bos_id] to generate from nothing")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty (no tokens): give text or at least one token id")
        return ids

    def stream(self, prompt: str | Sequence[int], **options) -> Iterator[Chunk]:
        """Yield one Chunk per generated token; joined, their text equals `generate(...).text`.

        Options are those of `generate`. The default cache is reset first.
        """
        req = make_request(**options)
        ids = self.encode_prompt(prompt)
        self.cache.reset()
        return run(self.engine, self.tokenizer, self.cache, ids, req, self.overflow, self.load_ms, {})

    def generate(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.8,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                 repetition_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 penalty_last_n: int = 64, logit_bias: dict[int, float] | None = None,
                 stop: str | Sequence[str] | None = None, seed: int | None = None,
                 ignore_eos: bool = False) -> Completion:
        """Generate a completion of `prompt` (temperature 0: greedy). The default cache is reset first."""
        req = make_request(max_new_tokens, temperature, top_k, top_p, min_p, typical_p, repetition_penalty,
                           frequency_penalty, presence_penalty, penalty_last_n, logit_bias, stop, seed, ignore_eos)
        ids = self.encode_prompt(prompt)
        self.cache.reset()
        result: dict = {}
        for _ in run(self.engine, self.tokenizer, self.cache, ids, req, self.overflow, self.load_ms, result):
            pass
        result.pop("unfed")
        return Completion(**result)

    def chat(self, messages: Sequence[dict], **options) -> Completion:
        """One reply to `messages` with the model's chat template (stateless: a fresh conversation)."""
        return self.conversation().reply(messages, **options)

    def conversation(self) -> "Conversation":
        return Conversation(self)


class Conversation:
    """A multi-turn chat whose KV cache persists across turns: turn N prefills only its new text.

    `say(content)` adds a user message and returns the reply; `reply(messages)` continues with a
    full message list (its already-seen prefix is not re-prefilled). `reset()` forgets everything.
    """

    def __init__(self, model: Model):
        self.model = model
        self.cache = model.new_cache()
        self.messages: list[dict] = []
        self._prompt_text = ""  # the last turn's rendered prompt (its tokens are in the cache)
        self._reply = ""  # the reply generated after it (its tokens are in the cache, but the last)
        self._unfed: list[int] = []  # last sampled token, not yet fed to the cache

    def reset(self) -> None:
        self.cache.reset()
        self.messages, self._prompt_text, self._reply, self._unfed = [], "", "", []

    def say(self, content: str, **options) -> Completion:
        return self.reply(self.messages + [{"role": "user", "content": content}], **options)

    def stream_say(self, content: str, **options) -> Iterator[Chunk]:
        return self._stream(self.messages + [{"role": "user", "content": content}], options)

    def reply(self, messages: Sequence[dict], **options) -> Completion:
        result: dict = {}
        for _ in self._stream(messages, options, result):
            pass
        return Completion(**{k: v for k, v in result.items() if k != "unfed"})

    def _stream(self, messages: Sequence[dict], options: dict, result: dict | None = None) -> Iterator[Chunk]:
        result = {} if result is None else result
        m = self.model
        req = make_request(**options)
        full = m.template.render(messages, add_generation_prompt=True)
        new_text = self._new_text(full)
        if new_text is not None:
            ids = self._unfed + m.tokenizer.encode(new_text, add_bos=False)
        else:  # first turn, or a template whose earlier turns render differently: start over
            self.cache.reset()
            self._unfed = []
            text, bos = full, m.tokenizer.add_bos
            if m.template.bos_token and text.startswith(m.template.bos_token):
                text, bos = text[len(m.template.bos_token):], True
            ids = m.tokenizer.encode(text, add_bos=bos)
        if not ids:
            raise EdgeInferError("nothing new to say: the messages add no text")
        self.messages = list(messages)
        for chunk in run(m.engine, m.tokenizer, self.cache, ids, req, m.overflow, m.load_ms, result):
            yield chunk
        self._unfed = result["unfed"]
        self.messages.append({"role": "assistant", "content": result["text"]})
        self._prompt_text, self._reply = full, result["text"]

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

"""`PortableEngine`: the Engine's `prefill` / `decode_one` / `forward` over the portable graphs
(converters/portable.py), with the same ring-buffer contract (sinks, overflow, re-basing, constant
memory). Here the graphs run on ONNX Runtime's CPU EP; on a phone or a Mac the same two files run
under NNAPI or CoreML (docs/platforms.md).

One call (s tokens, s <= P):
1. Re-base the ring if due; the new rows go at `cache.write_offset(s)` as for the fused graph.
2. On the host: the embedding rows (the table is `embeddings.npy`), the RoPE cos/sin of the
   positions, the additive attention mask over the ring's R rows and the s new ones, and the
   one-hot row that picks the last position's logits.
3. Run the decode graph (s = 1) or the prefill graph (s > 1, padded to P).
4. Write the s new K/V rows (keys roped) into the ring and `commit`; join the logits chunks into
   the cache's logits buffer.

The ring is [1, Hkv, R, Dh] per layer (the portable KV mode, heads outermost), bound whole;
R is fixed by the graphs, so a ring of smaller capacity uses the same R rows and a larger one is
refused at load. Thread-safe across caches like Engine (one lock around each graph call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from edgeinfer.chunked import ChunkedSteps
from edgeinfer.errors import ModelFormatError
from edgeinfer.kv_cache import RingKVCache
from edgeinfer.kv_mode import PORTABLE
from edgeinfer.portable import attention_mask, logit_chunks, rope_inputs
from edgeinfer.ort_lifecycle import new_session
from edgeinfer.session import PROVIDERS, DecoderSession, old_runtime_hint, some_names, session_options


class PortableEngine(ChunkedSteps):
    def __init__(self, session: DecoderSession, max_chunk: int | None = None, threads: int | None = None,
                 spin_duration_us: int | None = None):
        """max_chunk: tokens per call at most (a smaller prefill chunk than the graph's P is padded to P)."""
        m = session.manifest
        self.session, self.spec, self.info = session, m.arch, m.portable
        self.mode = PORTABLE
        self.kv_dtype = np.dtype(np.float32)
        self.max_chunk = min(int(max_chunk or self.info.prefill_tokens), self.info.prefill_tokens)
        folder = session.folder
        try:
            self.prefill_session = new_session(lambda: ort.InferenceSession(
                str(folder / self.info.prefill_file),
                session_options(threads, spin_duration_us, portable=session.portable_on_cpu),
                providers=[PROVIDERS[session.provider]]))
            try:
                self.embeddings = np.load(folder / self.info.embeddings_file, mmap_mode="r", allow_pickle=False)
            except ValueError as e:  # (numpy's advice, allow_pickle=True, is not one to take for a model file)
                raise ValueError(f"{self.info.embeddings_file} is not a .npy array (no array header)"
                                 if "pickle" in str(e) else str(e)) from None
            if not isinstance(self.embeddings, np.ndarray):  # a zip (.npz) under the name
                raise ValueError(f"{self.info.embeddings_file} is not a .npy array (a zip archive)")
        except Exception as e:
            raise ModelFormatError(f"cannot load the portable graphs of {folder}: {str(e).splitlines()[0][:300]}"
                                   f"{old_runtime_hint()}") from None
        if self.embeddings.shape != (self.spec.vocab_size, self.spec.hidden_size) or \
                self.embeddings.dtype not in (np.float16, np.float32):
            raise ModelFormatError(f"{folder / self.info.embeddings_file} is {self.embeddings.dtype} "
                                   f"{self.embeddings.shape}, expected float16 or float32 "
                                   f"{(self.spec.vocab_size, self.spec.hidden_size)}")
        self._check_graph(session.session, 1, folder / "model.onnx")
        self._check_graph(self.prefill_session, self.info.prefill_tokens, folder / self.info.prefill_file)
        self.names = session.names
        self.groups = self.spec.num_heads // self.spec.num_kv_heads
        self.chunks = logit_chunks(self.spec.vocab_size)
        self.inv_freq = self.spec.rope.inv_freq(self.spec.head_dim)
        self._init_turns("the model's engine")  # lock, waiting, ran (`chunked.ChunkedSteps`)
        self.calls = 0

    def _check_graph(self, sess, s: int, path) -> None:
        """The graph's static shapes are the manifest's geometry (a swapped or re-split file is refused)."""
        spec, R = self.spec, self.info.ring_rows
        want = {"inputs_embeds": [1, s, spec.hidden_size],
                self.session.names.past_key(0): [1, spec.num_kv_heads, R, spec.head_dim]}
        got = {i.name: list(i.shape) for i in sess.get_inputs()}
        for name, shape in want.items():
            if got.get(name) != shape:
                raise ModelFormatError(f"{path}: input {name} is {got.get(name)}, the manifest's geometry needs "
                                       f"{shape}: the folder's graphs and edgeinfer.json disagree")
        missing = self.session.io_names("outputs") - {o.name for o in sess.get_outputs()}
        if missing:  # (the decode graph's were checked as it loaded; an output cut was a traceback at the first call)
            raise ModelFormatError(f"{path}: the graph does not give the outputs edgeinfer.json names: missing "
                                   f"{some_names(missing)}")

    def _drop(self) -> None:  # (`ChunkedSteps.close`) both graphs' sessions, and the float embedding table
        self.session.close()
        self.prefill_session = self.embeddings = None

    def new_cache(self, capacity_tokens: int, n_sink: int) -> RingKVCache:
        self._check_open()
        self.info.check_capacity(capacity_tokens)
        return RingKVCache(self.spec, capacity_tokens, n_sink, self.max_chunk, PORTABLE, rows=self.info.ring_rows)

    def forward(self, cache: RingKVCache, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """As `Engine.forward`: logits [N, V] for the s = len(ids) new tokens (N = s with all_logits,
        else 1). The graphs give one position's logits per call, so all_logits runs token by token."""
        s = len(ids)
        if not 0 < s <= (self.spec.max_position_embeddings if all_logits else self.max_chunk):
            raise ValueError(f"a call takes 1..{self.max_chunk} tokens, got {s}")
        if all_logits and s > 1:
            return np.stack([self.forward(cache, ids[j:j + 1])[0].copy() for j in range(s)])
        me = threading.get_ident()
        self.waiting.add(me)  # until it has the lock: a prefill gives way to it (`ChunkedSteps`)
        with self.in_call, self.lock:
            self.waiting.discard(me)
            self._check_open()
            self.holder_prefills = me in self.prefilling
            t0 = time.perf_counter()
            try:
                return self._forward(cache, list(ids), s)
            finally:
                self.ran.s = time.perf_counter() - t0  # what a prefill gives way for (`ChunkedSteps.give_way`)

    def _forward(self, cache: RingKVCache, ids: list[int], s: int) -> np.ndarray:
        cache.rebase_if_due(s)
        t, off = cache.n_valid, cache.write_offset(s)
        s_graph = 1 if s == 1 else self.info.prefill_tokens  # the prefill graph's static chunk
        embeds = np.zeros((1, s_graph, self.spec.hidden_size), np.float32)
        embeds[0, :s] = self.embeddings[ids]
        pos = cache.next_position + np.arange(s_graph)
        cos, sin = rope_inputs(pos, self.inv_freq)
        select = np.zeros((1, 1, s_graph), np.float32)
        select[0, 0, s - 1] = 1.0
        feeds = {"inputs_embeds": embeds, "rope_cos": cos, "rope_sin": sin, "logits_select": select,
                 "attention_mask": attention_mask(t, s, s_graph, cache.rows, self.groups)}
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            feeds[self.names.past_key(i)], feeds[self.names.past_value(i)] = k, v
        sess = self.session.session if s_graph == 1 else self.prefill_session
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            k[0, :, off:off + s] = out[self.names.present_key(i)][0, :, :s]
            v[0, :, off:off + s] = out[self.names.present_value(i)][0, :, :s]
        cache.commit(s)
        self.calls += 1
        for c, (lo, hi) in enumerate(self.chunks):
            cache.logits[0, 0, lo:hi] = out[f"logits.{c}"][0, 0]
        return cache.logits[0]



def open_engine(session: DecoderSession, max_chunk: int, threads: int | None = None,
                spin_duration_us: int | None = None):
    """The engine for a model folder's flavour: `Engine` (fused) or `PortableEngine` (portable)."""
    if session.manifest.portable is not None:
        return PortableEngine(session, max_chunk, threads, spin_duration_us)
    from edgeinfer.engine import Engine
    return Engine(session, max_chunk=max_chunk)

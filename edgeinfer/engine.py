"""`prefill` and `decode_one` as twins: one graph call over a ring-buffer KV cache, zero-copy.

The ONNX Runtime IO binding points the graph straight at the cache's arrays, as the model's KV mode
(`kv_mode.KVMode`, from the manifest) says: a mode that appends in place (GroupQueryAttention) gets
the whole ring as past and present, bound once and reused across calls (one IO binding per call
shape of up to `Engine.SHAPED_ROWS` rows, so decode steps and speculative verify calls alternate
without rebinding; each holds its ring by a weak reference); otherwise `past` is
the contiguous block of valid slots and the graph writes its new K/V rows into the slots right after
them (`RingKVCache.write_offset`); a graph exported by Optimum (the optimum mode) also takes an
attention_mask, all ones over those slots and the new ones. The last token's logits land in the
cache's own buffer (a verify call's rows in the caller's `out`). RoPE's cos/sin table (a row per
position) is computed here once and bound as an input (graph interface version 2; a version 1 graph
computes its call's rows from position_ids). Per call, only pointers and shapes change; no array of
the model's or the cache's size is allocated.

One Engine serves any number of caches (conversations) from any number of threads: each call
holds `lock` for the graph run and the cache's bookkeeping (the IO binding and run-state buffers are
shared), and writes its logits into the cache's own buffer, so steps of different conversations
interleave safely. One cache must be driven by one caller at a time (its owner's lock).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np

from edgeinfer import fork_safety
from edgeinfer.chunked import ChunkedSteps, prefill_chunks  # noqa: F401 (prefill_chunks: re-exported)
from edgeinfer.kv_cache import BatchedKV, RingKVCache, binding_window
from edgeinfer.kv_mode import ATTENTION_MASK, SEQLENS_K, TOTAL_SEQUENCE_LENGTH
from edgeinfer.ngram_table import NgramTable
from edgeinfer.interface import ROPE_COS, ROPE_SIN, host_rope
from edgeinfer.session import DecoderSession


class Engine(ChunkedSteps):
    def __init__(self, session: DecoderSession, max_chunk: int = 256):
        self.session = session
        spec = session.manifest.arch
        self.spec = spec
        self.max_chunk = int(max_chunk)
        self.names = session.names
        self.mode = session.manifest.interface.kv_mode
        self.kv_dtype = np.dtype(session.manifest.interface.kv_dtype)  # float32, or float16 (the cuda target)
        self.row_bytes = spec.num_kv_heads * spec.head_dim * self.kv_dtype.itemsize  # one slot of one layer's K or V
        # the bound KV shapes (a mode that is not in place has its slots outermost after the batch: the
        # first T rows are one block, the S new rows the next); only the sequence dim changes per call
        self._seq_axis = self.mode.seq_axis
        self._past_dims = list(self.mode.cache_shape(0, spec.num_kv_heads, spec.head_dim))
        self._new_dims = list(self._past_dims)
        self._io = session.session.io_binding()  # the modes that are not in place: rebound every call
        # the in-place modes: one binding per call shape (`_binding`), so that decode steps and
        # verify calls of a few rows alternate without rebinding anything
        self._bindings: dict[object, _Binding] = {}
        # the cache lives in host memory; with CUDA, ORT copies the bound blocks (a device-resident
        # cache is the Jetson profile's work)
        self._device = "cpu"
        # run state, allocated once
        self._ids = np.zeros((1, self.max_chunk), np.int64)
        self._pos = np.zeros((1, self.max_chunk), np.int64)
        self._index = np.zeros(self.max_chunk, np.int64)
        self._seqlens = np.zeros(1, np.int32)
        self._total = np.zeros((), np.int32)
        # the optimum mode's attention_mask: ones over the T + S attended slots (grown to a ring's rows once)
        self._masked = any(e.name == ATTENTION_MASK for e in self.mode.extra_inputs)
        self._ones = np.ones((1, 0), np.int64)
        # RoPE (interface version 2): the graph takes the cos/sin table, row p for position p, computed
        # here once and grown when a ring's positions or length would pass it (GroupQueryAttention checks
        # its rows against the total length); a version 1 graph computes this call's rows itself
        self.host_rope = host_rope(session.manifest.interface.version, self.mode)
        self._inv_freq = spec.rope.inv_freq(spec.head_dim).astype(np.float32)  # the graph's float32 inv_freq
        self._rope_cos = self._rope_sin = np.zeros((0, spec.head_dim // 2), self.kv_dtype)
        self._rope_gen = 0  # bumped when the tables are replaced (the bindings then point at old ones)
        self.calls = 0
        self._init_turns("the model's engine")  # lock, waiting, ran (`chunked.ChunkedSteps`)
        self.draft = None  # a `drafting.Draft`: the small model `speculative="draft"` drafts with (Model.set_draft)
        self._ngrams: NgramTable | None = None  # `ngram_table`, once read
        self._ngrams_lock = threading.Lock()
        fork_safety.watch(self, "_ngrams_lock", "the model's n-gram table")  # held while it is read (~10 ms)
        self._ratios: tuple[float, ...] | None = None  # `verify_ratios`, once measured
        self._out_view: tuple | None = None  # (out, n, out[:, :n], its address) of forward's last caller's buffer
        self._ratios_lock = threading.Lock()
        fork_safety.watch(self, "_ratios_lock", "the model's speculation timing")  # held ~0.5 s while it measures

    def _drop(self) -> None:  # (`ChunkedSteps.close`) the session's last references, and what pointed into it
        self._bindings.clear()
        self._io = self.draft = self._out_view = None
        self.session.close()

    def ngram_table(self) -> NgramTable | None:
        """The model's n-gram table (`ngram_table.py`; None for a folder without one), which
        speculative="ngram" drafts from: read the first time asked, by the first request that
        speculates (before it touches its context) or by serve as it starts, and kept for the engine's
        life. Not at load: plain decoding never pays its read (~10 ms for the bundled model's) or its
        memory (~100 bytes a context). Its bytes are checked against the manifest's sha256 as they are
        read (the load hashed every file; this one is read later); a table that does not hold together,
        or that changed since, raises ModelFormatError."""
        info = self.session.manifest.ngrams
        if info is None or self._ngrams is not None:
            return self._ngrams
        with self._ngrams_lock:
            if self._ngrams is None:
                want = self.session.manifest.files.get(info.file)  # (hashed at load: the bytes read now must be those)
                self._ngrams = NgramTable.read(self.session.folder / info.file, self.spec.vocab_size, info.contexts,
                                               want["sha256"] if want else None)
            return self._ngrams

    def attach_draft(self, draft) -> None:
        """`draft` (a `drafting.Draft`) set, unless the engine is closed (ModelClosedError): under the
        lock, so that a close cannot come between the check and the setting. A model that drafts for
        itself is held by a weak reference: a strong one made a cycle that kept its session and thread
        pool, once the model was dropped without `close`, until the cycle collector ran."""
        if draft.engine is self:
            draft = dataclasses.replace(draft, engine=weakref.proxy(self))
        with self.in_call, self.lock:
            self._check_open()
            self.draft = draft

    def new_cache(self, capacity_tokens: int, n_sink: int) -> RingKVCache:
        self._check_open()  # (no lock: a ring allocated as the model closes is only freed with its owner)
        return RingKVCache(self.spec, capacity_tokens, n_sink, self.max_chunk, self.mode, dtype=self.kv_dtype)

    CALIBRATION_ROWS = (1, 2, 3, 4, 6, 9)  # call sizes `verify_ratios` times (the others: interpolated)

    def verify_ratios(self, k_max: int) -> tuple[float, ...]:
        """r[s - 1], s = 1 .. k_max + 1: the time of a call of s rows (a speculative verify) over a
        one-row step's, measured the first time asked and kept for the engine's life (speculation's
        rule reads it: with n-grams which rows share a call then follows the tokens alone). Measured
        with the engine to itself (its lock held: another request's calls would count as these), on a
        scratch ring of 64 slots holding 32 tokens (a model trained on fewer than 64 positions: half
        its length, and no call past the other half; larger sizes count as the largest): each size of
        CALIBRATION_ROWS (and k_max + 1) once to warm it, then up to 5 interleaved rounds (at least 2, about half a second at most), medians; the sizes
        between interpolated linearly, a larger call never counted cheaper than a smaller one."""
        with self._ratios_lock:
            if self._ratios is not None and len(self._ratios) >= k_max + 1:
                return self._ratios
            window = binding_window(self.spec)  # such a model's ring holds W - 1 and no sinks
            rows = min(64, self.spec.max_position_embeddings, window - 1 if window else 64)
            held = rows // 2
            top = max(1, min(k_max + 1, self.max_chunk, rows - held))
            sizes = sorted({s for s in self.CALIBRATION_ROWS if s < top} | {1, top})
            cache = self.new_cache(rows, min(4, held - 1) if held > 1 and not window else 0)
            ids = [(3 + i) % self.spec.vocab_size for i in range(held + top)]
            self.prefill(cache, ids[:held])
            out = np.empty((1, top, self.spec.vocab_size), np.float32)

            def call(s: int) -> float:
                logits = cache.logits if s == 1 else out[:, :s]
                t0 = time.perf_counter()
                self._forward(cache, ids[held:held + s], s, s, logits, commit=False)
                return time.perf_counter() - t0

            times: dict[int, list[float]] = {s: [] for s in sizes}
            with self.in_call, self.lock:
                self._check_open()
                for s in sizes:
                    call(s)
                deadline = time.perf_counter() + 0.5
                for i in range(5):
                    for s in sizes:
                        times[s].append(call(s))
                    if i >= 1 and time.perf_counter() > deadline:
                        break
            step = float(np.median(times[1]))
            measured = np.maximum.accumulate([float(np.median(times[s])) / step for s in sizes])
            ratios = np.interp(np.arange(1, k_max + 2), sizes, measured)
            self._ratios = tuple(float(x) for x in ratios)
            return self._ratios

    def forward(self, cache: RingKVCache, ids: Sequence[int], all_logits: bool = False,
                commit: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Run up to `max_chunk` new tokens at the cache's next positions; return logits [N, V].

        N = len(ids) with `all_logits`, else 1 (the last position). N = 1: a view of the cache's
        logits buffer, valid until the next call on the same cache; N > 1: a view of `out` (float32,
        C-contiguous [1, R, V] with R >= N: the caller's buffer, reused call after call, so nothing
        is allocated or rebound), or a new array without it. Mutates `cache` (its new rows and
        bookkeeping). Thread-safe across caches (see the module doc). commit=False leaves the new
        rows uncommitted, just past the valid slots (a speculative verify: the caller commits the
        accepted ones with `cache.commit`; the others are never read).
        """
        s = len(ids)
        if not 0 < s <= self.max_chunk:
            raise ValueError(f"a call takes 1..{self.max_chunk} tokens, got {s}")
        n = s if all_logits and s > 1 else 1
        if n == 1:
            logits = cache.logits
        elif out is None:
            logits = np.empty((1, n, self.spec.vocab_size), np.float32)
        else:
            view = self._out_view  # a caller's buffer reused call after call (a speculative verify's) is checked once
            if view is None or view[0] is not out or view[1] != n or not out.flags.writeable:
                _check_out(out, n, self.spec.vocab_size)
                view = self._out_view = (out, n, out[:, :n], out.ctypes.data)
            logits = view[2]
        me = threading.get_ident()
        self.waiting.add(me)  # until it has the lock: a prefill gives way to it (`ChunkedSteps`)
        with self.in_call, self.lock:
            self.waiting.discard(me)
            self._check_open()
            self.holder_prefills = me in self.prefilling
            if s == 1:
                return self._forward(cache, ids, s, n, logits, commit)
            t0 = time.perf_counter()
            try:
                return self._forward(cache, ids, s, n, logits, commit)
            finally:
                self.ran.s = time.perf_counter() - t0  # what a prefill gives way for (`ChunkedSteps.give_way`)

    def _forward(self, cache: RingKVCache, ids: Sequence[int], s: int, n: int, logits: np.ndarray,
                 commit: bool = True) -> np.ndarray:
        cache.rebase_if_due(s)
        t = cache.n_valid
        off = cache.write_offset(s)
        if s == 1:  # the decode step: plain stores, nothing allocated
            self._ids[0, 0] = ids[0]
            self._pos[0, 0] = cache.next_position
            self._index[0] = 0
        else:
            self._ids[0, :s] = ids
            self._pos[0, :s] = np.arange(cache.next_position, cache.next_position + s)
            self._index[:n] = np.arange(s) if n > 1 else s - 1
        if self.host_rope and max(cache.next_position + s, cache.rows) > self._rope_cos.shape[0]:
            if cache.next_position + s > cache.position_limit:  # re-basing keeps them below: a forged snapshot
                raise ValueError(f"positions up to {cache.next_position + s} pass the ring's limit "
                                 f"{cache.position_limit}: the cache's bookkeeping is corrupted")
            self._rope_fit(max(cache.position_limit, cache.rows))
        if self.mode.in_place:  # the graph (GroupQueryAttention) appends in place: past and present are the ring
            self._seqlens[0] = t + s - 1
            self._total[()] = t + s
            b = self._binding(s if s <= self.SHAPED_ROWS else "prefill")
            if b.kv() is not cache:  # the whole ring, whatever s: bound once per cache
                shape = list(self.mode.cache_shape(cache.rows, self.spec.num_kv_heads, self.spec.head_dim))
                b.kv = _dead  # (first: a rebind cut short by Ctrl-C is not taken for a whole one)
                self._bind_ring(b.io, cache.k, cache.v, shape, self._seqlens)
                b.kv = weakref.ref(cache)
            view = self._out_view
            address = cache.logits_address if logits is cache.logits else \
                view[3] if view is not None and view[2] is logits else logits.ctypes.data
            key = (s, n, address, self._rope_gen)
            if key != b.tokens:  # every call of this shape after the first reuses the binding
                b.tokens = None
                self._bind_tokens(b.io, self._ids, self._pos, [1, s], n, logits)
                b.tokens = key
            return self._run(b.io, cache, s if commit else 0, logits)
        else:  # past = the valid block; the graph's new rows are bound right after it
            io, dev, kvt = self._io, self._device, self.kv_dtype.type
            kv_past, kv_new = self._past_dims, self._new_dims  # bind_input copies the dims
            kv_past[self._seq_axis], kv_new[self._seq_axis] = t, s
            for i, (k, v) in enumerate(zip(cache.k, cache.v)):
                io.bind_input(self.names.past_key(i), dev, 0, kvt, kv_past, k.ctypes.data)
                io.bind_input(self.names.past_value(i), dev, 0, kvt, kv_past, v.ctypes.data)
                io.bind_output(self.names.present_key(i), dev, 0, kvt, kv_new, k.ctypes.data + off * self.row_bytes)
                io.bind_output(self.names.present_value(i), dev, 0, kvt, kv_new, v.ctypes.data + off * self.row_bytes)
            if self._masked:
                if self._ones.shape[1] < t + s:
                    self._ones = np.ones((1, cache.rows), np.int64)
                io.bind_input(ATTENTION_MASK, "cpu", 0, np.int64, [1, t + s], self._ones.ctypes.data)
        self._bind_tokens(self._io, self._ids, self._pos, [1, s], n, logits)
        return self._run(self._io, cache, s if commit else 0, logits)

    SHAPED_ROWS = 16  # calls of up to this many rows (decode steps, verify calls) get a binding each

    def _binding(self, key: object) -> "_Binding":
        b = self._bindings.get(key)
        if b is None:
            b = self._bindings[key] = _Binding(self.session.session.io_binding())
        return b

    def _bind_ring(self, io, ks: list[np.ndarray], vs: list[np.ndarray], shape: list[int], seqlens: np.ndarray) -> None:
        """Bind a call that appends in place: past and present are the same arrays, `seqlens` the
        valid slots per batch row (total - 1)."""
        dev, kvt = self._device, self.kv_dtype.type
        io.bind_input(SEQLENS_K, "cpu", 0, np.int32, [seqlens.size], seqlens.ctypes.data)
        io.bind_input(TOTAL_SEQUENCE_LENGTH, "cpu", 0, np.int32, [], self._total.ctypes.data)
        for i, (k, v) in enumerate(zip(ks, vs)):
            io.bind_input(self.names.past_key(i), dev, 0, kvt, shape, k.ctypes.data)
            io.bind_input(self.names.past_value(i), dev, 0, kvt, shape, v.ctypes.data)
            io.bind_output(self.names.present_key(i), dev, 0, kvt, shape, k.ctypes.data)
            io.bind_output(self.names.present_value(i), dev, 0, kvt, shape, v.ctypes.data)

    def _bind_tokens(self, io, ids: np.ndarray, pos: np.ndarray, dims: list[int], n: int, logits: np.ndarray) -> None:
        """Bind the token ids and positions ([B, S] = dims) and RoPE's table (version 2), which n
        positions get logits, and where."""
        io.bind_input("input_ids", "cpu", 0, np.int64, dims, ids.ctypes.data)
        io.bind_input("position_ids", "cpu", 0, np.int64, dims, pos.ctypes.data)
        if self.host_rope:
            table, dt = list(self._rope_cos.shape), self.kv_dtype.type
            io.bind_input(ROPE_COS, "cpu", 0, dt, table, self._rope_cos.ctypes.data)
            io.bind_input(ROPE_SIN, "cpu", 0, dt, table, self._rope_sin.ctypes.data)
        io.bind_input("logits_index", "cpu", 0, np.int64, [n], self._index.ctypes.data)
        io.bind_output("logits", "cpu", 0, np.float32, [dims[0], n, self.spec.vocab_size], logits.ctypes.data)

    def _rope_fit(self, rows: int) -> None:
        """RoPE's tables for positions 0..rows-1 (at least): `rope_table`, rounded to float16 for the
        cuda target's tables."""
        rows = max(rows, 2 * self._rope_cos.shape[0])  # grown rarely: a ring's limit is known when it is bound
        cos, sin = rope_table(rows, self._inv_freq)
        self._rope_cos, self._rope_sin = cos.astype(self.kv_dtype), sin.astype(self.kv_dtype)
        self._rope_gen += 1

    def _run(self, io, cache: RingKVCache, s: int, logits: np.ndarray) -> np.ndarray:
        """Run the bound call; commit its s new rows (0: none)."""
        self.session.session.run_with_iobinding(io)
        if s:
            cache.commit(s)
        self.calls += 1
        return logits[0]

    def decode_batch(self, kv: BatchedKV, tokens: dict[int, int]) -> None:
        """One decode step for rows `tokens` (row -> token) of `kv`, in one graph call (modes that
        append in place only: GroupQueryAttention takes a length per row). Every other row runs a
        throwaway step: its new row lands just past its valid slots and is not committed, so it
        changes nothing. Each stepped ring's logits land in its own buffer (`cache.logits`)."""
        if not self.mode.in_place:
            raise ValueError(f"batched decoding needs a mode that appends in place, not {self.mode.name}")
        caches = kv.caches
        me = threading.get_ident()
        self.waiting.add(me)  # until it has the lock: a prefill gives way to it (`ChunkedSteps`)
        with self.in_call, self.lock:
            self.waiting.discard(me)
            self._check_open()
            self.holder_prefills = me in self.prefilling
            for b, cache in enumerate(caches):
                cache.writes += 1  # a stepped row, or a throwaway one just past the valid slots
                if b in tokens:
                    cache.rebase_if_due(1)
                kv.ids[b, 0] = tokens.get(b, 0)
                kv.positions[b, 0] = cache.next_position
                kv.seqlens[b] = cache.n_valid  # total - 1, total = valid slots + this token
            self._total[()] = int(kv.seqlens.max()) + 1
            self._index[0] = 0
            if self.host_rope:
                rows = max(kv.k[0].shape[self._seq_axis], int(kv.positions.max()) + 1)
                if rows > self._rope_cos.shape[0]:
                    self._rope_fit(max(rows, *(c.position_limit for c in caches)))
            b = self._binding("batch")
            if b.kv() is not kv:  # every batched step after the first reuses the binding
                b.kv, b.tokens = _dead, None  # (first: a rebind cut short by Ctrl-C is not taken for a whole one)
                self._bind_ring(b.io, kv.k, kv.v, list(kv.k[0].shape), kv.seqlens)
                b.kv = weakref.ref(kv)
            key = (len(caches), kv.ids.ctypes.data, kv.logits.ctypes.data, self._rope_gen)
            if key != b.tokens:
                b.tokens = None
                self._bind_tokens(b.io, kv.ids, kv.positions, [len(caches), 1], 1, kv.logits)
                b.tokens = key
            self.session.session.run_with_iobinding(b.io)
            self.calls += 1
            for b in tokens:
                caches[b].commit(1)
                caches[b].logits[0, 0] = kv.logits[b, 0]


def rope_table(rows: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [rows, Dh/2] (float32) of RoPE's angles for positions 0..rows-1, the angles in
    float32 as a version 1 graph computed each call's rows (the position cast to float32, times the
    float32 inv_freq). numpy's cos and sin differ from ONNX Runtime's kernels by an ulp in ~11 % of
    entries, so logits differ from a version 1 graph's in the last bits (a near-tie of the int8
    bundled model's greedy text went the other way once); computing the table with ONNX Runtime
    instead would cost a cold start ~100 ms (importing onnx to build the graph)."""
    ang = np.arange(rows, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
    return np.cos(ang), np.sin(ang)


def _check_out(out, n: int, vocab_size: int) -> None:
    """Refuse an `out` the graph cannot write n rows of logits into (ONNX Runtime writes through the
    raw pointer: a read-only or strided buffer would be corrupted, or crash the process)."""
    if isinstance(out, np.ndarray):
        if (out.dtype == np.float32 and out.ndim == 3 and out.shape[0] == 1 and out.shape[1] >= n
                and out.shape[2] == vocab_size and out.flags.c_contiguous and out.flags.writeable):
            return
        got = f"{out.dtype} {out.shape}" + ("" if out.flags.c_contiguous else ", not C-contiguous") + \
              ("" if out.flags.writeable else ", read-only")
    else:
        got = type(out).__name__
    raise ValueError(f"out must be a writeable C-contiguous float32 [1, >= {n}, {vocab_size}] array, got {got}")


def _dead() -> None:
    return None


class _Binding:
    """One ONNX Runtime IO binding of an in-place mode and what it points at: the KV arrays of `kv`
    (a weak reference: a ring that is gone is never taken for a new one at the same address, and
    a binding left idle keeps no ring alive) and the token inputs and logits output (`tokens`:
    their shapes and the logits buffer). Each is cleared before its arrays are bound and set after:
    a KeyboardInterrupt between two layers' binds once left some layers bound to another ring while
    `kv` still named the old one (contexts wrote into each other's rows, or into freed memory once a
    conversation was dropped: a hostile round's segfaults)."""

    __slots__ = ("io", "kv", "tokens")

    def __init__(self, io):
        self.io = io
        self.kv = _dead
        self.tokens: tuple | None = None

"""The automatic prefix cache of `Model.generate/stream` and `Model.snapshot/restore` (edgeinfer/prefix_cache.py).

The reference is a cold start: the same prompt on a freshly loaded model gives the same tokens.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_SRC
from edgeinfer.errors import InvalidArgumentError, InvalidArgumentTypeError

GREEDY = dict(temperature=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32(converted):
    return converted(STORIES_SRC, "fp32")


def ids_of(m, n, seed):
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, m.manifest.arch.vocab_size, n - 1).tolist()


@pytest.mark.parametrize("which", ["fp32", "bundled int8"])
def test_a_shared_prefix_is_not_prefilled_again_and_the_reply_is_a_cold_starts(which, fp32):
    path = fp32 if which == "fp32" else None
    m, cold = edgeinfer.load(path, capacity_tokens=480), edgeinfer.load(path, capacity_tokens=480)
    prefix = ids_of(m, 300, 0)
    first = m.generate(prefix + ids_of(m, 17, 1)[1:], **GREEDY)
    assert first.usage.cached_tokens == 0
    for seed in (2, 3):
        prompt = prefix + ids_of(m, 17, seed)[1:]
        c = m.generate(prompt, **GREEDY)
        assert c.usage.cached_tokens == 300 and c.usage.prompt_tokens == len(prompt)
        assert c.token_ids == cold.generate(prompt, **GREEDY).token_ids


def test_the_reply_just_generated_is_reused_by_the_next_prompt(fp32):
    m, cold = edgeinfer.load(fp32, capacity_tokens=480), edgeinfer.load(fp32, capacity_tokens=480)
    prompt = m.tokenizer.encode("Lily had a red ball. She")
    c1 = m.generate(prompt, **GREEDY)
    nxt = prompt + list(c1.token_ids) + m.tokenizer.encode("Then Ben came.", add_bos=False)
    c2 = m.generate(nxt, **GREEDY)
    # the ring holds the prompt and every reply token but the last (sampled, never fed)
    assert c2.usage.cached_tokens == len(prompt) + len(c1.token_ids) - 1
    assert c2.token_ids == cold.generate(nxt, **GREEDY).token_ids


def test_no_reuse_when_the_ring_shifted_or_a_stop_string_was_taken_back(fp32):
    m = edgeinfer.load(fp32, capacity_tokens=64, n_sink=4)
    long = ids_of(m, 80, 4)  # overflows the ring: what it holds is no longer the prompt's start
    m.generate(long, **GREEDY)
    assert m.held is None
    assert m.generate(long, **GREEDY).usage.cached_tokens == 0
    m = edgeinfer.load(fp32, capacity_tokens=480)
    prompt = m.tokenizer.encode("Once upon a time")
    full = m.generate(prompt, temperature=0, max_new_tokens=40)
    stop = full.text.split()[5]
    cut = m.generate(prompt, temperature=0, max_new_tokens=40, stop=stop)
    assert cut.finish_reason == "stop"
    # what the cache holds after the stop string was taken back out is a prefix of prompt + reply
    assert m.held == (prompt + list(cut.token_ids))[:m.cache.n_valid]
    held, nxt = len(m.held), prompt + list(cut.token_ids)
    again = m.generate(nxt, **GREEDY)
    assert again.usage.cached_tokens == min(held, len(nxt) - 2) > 0  # two tokens are always fed
    cold = edgeinfer.load(fp32, capacity_tokens=480)
    assert again.token_ids == cold.generate(nxt, **GREEDY).token_ids


def test_threads_sharing_a_model_each_get_a_cold_starts_reply(fp32):
    m, cold = edgeinfer.load(fp32, capacity_tokens=480), edgeinfer.load(fp32, capacity_tokens=480)
    prefix = ids_of(m, 100, 5)
    prompts = [prefix + ids_of(m, 9, s)[1:] for s in range(6)]
    want = [cold.generate(p, **GREEDY).token_ids for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = m.generate(prompts[i], **GREEDY).token_ids
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_snapshot_restore_and_file_round_trip(fp32, tmp_path):
    m = edgeinfer.load(fp32, capacity_tokens=480)
    system = m.tokenizer.encode("Once upon a time there was a little girl named Lily. She loved to play.")
    snap = m.snapshot(system, path=tmp_path / "sys.npz")
    assert snap.token_ids == tuple(system)
    m.generate(ids_of(m, 50, 6), **GREEDY)  # the cache now holds something else
    tail = m.tokenizer.encode(" One day she saw a dog.", add_bos=False)
    cold = edgeinfer.load(fp32, capacity_tokens=480).generate(system + tail, **GREEDY)
    m.restore(snap)
    c = m.generate(system + tail, **GREEDY)
    assert c.usage.cached_tokens == len(system) and c.token_ids == cold.token_ids
    other = edgeinfer.load(fp32, capacity_tokens=480)  # another process would load the file
    other.restore(tmp_path / "sys.npz")
    c = other.generate(system + tail, **GREEDY)
    assert c.usage.cached_tokens == len(system) and c.token_ids == cold.token_ids


def test_snapshots_that_do_not_fit_are_refused(fp32, tmp_path):
    m = edgeinfer.load(fp32, capacity_tokens=480)
    snap = m.snapshot(ids_of(m, 100, 7))
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        edgeinfer.load(fp32, capacity_tokens=64).restore(snap)
    with pytest.raises(InvalidArgumentError, match="another model"):
        edgeinfer.load().restore(snap)  # the bundled int8 model: other weights
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a snapshot")
    with pytest.raises(InvalidArgumentError, match="not a prefix snapshot"):
        m.restore(bad)
    snap.save(tmp_path / "s.npz")
    data = bytearray((tmp_path / "s.npz").read_bytes())
    (tmp_path / "cut.npz").write_bytes(bytes(data[:len(data) // 2]))
    with pytest.raises(InvalidArgumentError, match="not a prefix snapshot"):
        m.restore(tmp_path / "cut.npz")
    small = edgeinfer.load(fp32, capacity_tokens=64)
    before = small.snapshot(ids_of(small, 10, 8))
    with pytest.raises(InvalidArgumentError, match="more than the ring's 64"):
        small.snapshot(ids_of(small, 65, 9))
    assert small.held == list(before.token_ids)  # refused before touching the cache
    m.cache.reset()
    m.held = None
    with pytest.raises(InvalidArgumentError, match="no prefix"):
        m.snapshot()


def _rewrite(src, dst, meta=None, **arrays):
    """A copy of snapshot file `src` at `dst` with some of its meta fields or arrays replaced."""
    with np.load(src) as z:
        data = {name: z[name] for name in z.files}
    m = json.loads(data["meta"].tobytes())
    m = meta(m) if callable(meta) else m
    data["meta"] = np.frombuffer(json.dumps(m).encode(), np.uint8)
    data.update(arrays)
    with open(dst, "wb") as f:
        np.savez(f, **data)
    return dst


def test_tampered_snapshot_files_are_refused_and_leave_the_model_working(fp32, tmp_path):
    """A file is untrusted: a NaN in its KV would poison every prompt that reuses the prefix, ids past
    the vocabulary or positions that are not a prefix's would corrupt the ring; all are refused, and
    the ring's own sinks decide where it wraps, not the file's bookkeeping."""
    m = edgeinfer.load(fp32, capacity_tokens=64, n_sink=4)
    system = ids_of(m, 20, 10)
    want = m.generate(system, **GREEDY).token_ids
    good = tmp_path / "good.npz"
    m.snapshot(system, path=good)
    nan_k = np.load(good)["k0"].copy()
    nan_k[3, 0, 0] = np.nan
    cases = {
        "not finite": _rewrite(good, tmp_path / "nan.npz", k0=nan_k),
        "outside the vocabulary": _rewrite(good, tmp_path / "ids.npz",
                                           meta=lambda d: {**d, "token_ids": [m.manifest.arch.vocab_size] * 20}),
        "not a prefix snapshot": _rewrite(good, tmp_path / "pos.npz", positions=np.arange(20) + 5),
    }
    (tmp_path / "list.npz").write_bytes(good.read_bytes())
    cases["not a prefix snapshot "] = _rewrite(good, tmp_path / "list.npz", meta=lambda d: [1, 2])
    for match, path in cases.items():
        with pytest.raises(InvalidArgumentError, match=match.strip()):
            m.restore(path)
        assert m.generate(system, **GREEDY).token_ids == want
    wide = edgeinfer.load(fp32, capacity_tokens=64, n_sink=8)  # the file says next_slot 4: this ring's sinks win
    wide.restore(_rewrite(good, tmp_path / "slot.npz", meta=lambda d: {**d, "next_slot": 0}))
    assert wide.cache.next_slot == 8 and wide.cache.n_sink == 8
    cold = edgeinfer.load(fp32, capacity_tokens=64, n_sink=8)
    tail = ids_of(m, 10, 11)[1:]
    long = dict(temperature=0, max_new_tokens=80, ignore_eos=True)  # the ring wraps after its own sinks
    got = wide.generate(system + tail, **long)
    assert got.usage.cached_tokens == 20 and got.token_ids == cold.generate(system + tail, **long).token_ids


def test_a_prompt_longer_than_the_ring_is_prefilled_whole_as_a_cold_start(fp32):
    """With the ring shifting inside the prefill, the chunks' starts decide what each token sees: a
    reused prefix would move them, so a prompt past the capacity is not reused."""
    m = edgeinfer.load(fp32, capacity_tokens=64, n_sink=4)
    system, tail = ids_of(m, 20, 13), ids_of(m, 80, 14)[1:]
    m.snapshot(system)
    c = m.generate(system + tail, **GREEDY)
    cold = edgeinfer.load(fp32, capacity_tokens=64, n_sink=4).generate(system + tail, **GREEDY)
    assert c.usage.cached_tokens == 0 and c.token_ids == cold.token_ids


def test_snapshot_files_that_cannot_be_written_are_refused_cleanly(fp32, tmp_path):
    m = edgeinfer.load(fp32, capacity_tokens=64)
    snap = m.snapshot(ids_of(m, 10, 12))
    (tmp_path / "dir").mkdir()
    with pytest.raises(InvalidArgumentError, match="is a folder"):
        snap.save(tmp_path / "dir")
    with pytest.raises(InvalidArgumentError, match="cannot write the snapshot"):
        m.snapshot(path=tmp_path / "missing" / "s.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"] and not any((tmp_path / "dir").iterdir())


def test_threads_saving_to_one_path_each_write_a_whole_file(fp32, tmp_path):
    """The temporary name was the same for every writer (".s.npz.partial"): two saves at once wrote into
    one file, a rename failed ("No such file") and readers got torn files ("Bad CRC-32")."""
    from edgeinfer.prefix_cache import PrefixSnapshot

    m = edgeinfer.load(fp32, capacity_tokens=64)
    snaps = [m.snapshot(ids_of(m, 12 + i, 20 + i)) for i in range(3)]
    path, errors, reads = tmp_path / "s.npz", [], []
    snaps[0].save(path)

    def write(snap):
        for _ in range(30):
            try:
                snap.save(path)
            except Exception as e:  # noqa: BLE001 (any failure is the defect)
                errors.append(e)

    def read():
        for _ in range(60):
            try:
                reads.append(len(PrefixSnapshot.load(path).token_ids))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=write, args=(s,)) for s in snaps] + [threading.Thread(target=read)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == [] and set(reads) <= {12, 13, 14}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]  # no temporary file left


@pytest.mark.parametrize("path, error", [(123, InvalidArgumentTypeError), (b"s.npz", InvalidArgumentTypeError),
                                         ("a\x00b.npz", InvalidArgumentError), ("\ud800.npz", InvalidArgumentError)])
def test_a_snapshot_path_of_the_wrong_kind_is_an_edgeinfer_error(fp32, path, error):
    m = edgeinfer.load(fp32, capacity_tokens=64)
    with pytest.raises(error):
        m.snapshot(ids_of(m, 10, 12), path=path)


def test_a_stream_cancelled_before_its_first_next_leaves_the_held_prefix_alone(fp32):
    """A cancel before the first next() ends the stream before `begin`: the default ring keeps what
    it held (the stream took the context, reset the ring to its own shared prefix, then stopped)."""
    m = edgeinfer.load(fp32, capacity_tokens=480)
    prefix = ids_of(m, 200, 5)
    m.generate(prefix + ids_of(m, 9, 6)[1:], **GREEDY)
    g = m.stream(ids_of(m, 40, 7), **GREEDY)  # shares only BOS with what the ring holds
    g.cancel()
    with pytest.raises(edgeinfer.GenerationCancelled):
        next(g)
    assert m.generate(prefix + ids_of(m, 9, 8)[1:], **GREEDY).usage.cached_tokens == 200


def test_a_request_refused_for_its_options_leaves_the_held_prefix_alone(fp32):
    """speculative='draft' with no draft model is refused; it was refused after `begin` had cut the
    ring to the prompt's shared prefix, and the request's failure then forgot what the ring held (a
    review)."""
    m = edgeinfer.load(fp32, capacity_tokens=480)
    prefix = ids_of(m, 200, 5)
    m.generate(prefix + ids_of(m, 9, 6)[1:], **GREEDY)
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        m.generate(ids_of(m, 40, 7), speculative="draft", **GREEDY)
    assert m.generate(prefix + ids_of(m, 9, 8)[1:], **GREEDY).usage.cached_tokens == 200


def test_a_request_refused_before_it_samples_keeps_the_restored_prefix(fp32):
    """A hostile round: a prompt longer than the ring under overflow="error" was refused only after
    `reuse` had emptied the ring for it (its message then said the context held 0 tokens), and a
    logit_bias that bans every token failed the request, which forgot sound rows: either way the next
    request prefilled the restored prefix again."""
    m = edgeinfer.load(fp32, capacity_tokens=64, overflow="error")
    system = ids_of(m, 40, 11)
    m.restore(m.snapshot(system))
    with pytest.raises(edgeinfer.ContextOverflowError, match="prompt of 80 tokens does not fit: the context holds "
                                                            "at most 64 tokens"):
        m.generate(system + ids_of(m, 41, 12)[1:], **GREEDY)
    assert m.generate(system + [7, 8], **GREEDY).usage.cached_tokens == 40
    m = edgeinfer.load(fp32, capacity_tokens=480)
    system = ids_of(m, 300, 13)
    m.restore(m.snapshot(system))
    with pytest.raises(InvalidArgumentError, match="bans every token"):
        m.generate(system + [5, 6], logit_bias={i: float("-inf") for i in range(512)}, **GREEDY)
    c = m.generate(system + [7, 8], **GREEDY)
    assert c.usage.cached_tokens == 300
    assert c.token_ids == edgeinfer.load(fp32, capacity_tokens=480).generate(system + [7, 8], **GREEDY).token_ids

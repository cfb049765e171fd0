"""The model's n-gram table (edgeinfer/ngram_table.py, converters/ngrams.py): hand-computed counts and
chains, the file's checks, `convert --ngram-tokens`, and the drafts it gives speculative decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC
from edgeinfer import speculative
from edgeinfer.drafting import NgramDrafter
from edgeinfer.errors import ConvertError, ModelFormatError
from edgeinfer.ngram_table import FILE, MAX_CONTEXTS, MIN_CHANCE, NgramTable, contexts_in, count_ngrams, sample_text
from edgeinfer.speculative import Tuning

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
TEXT = [1, 5, 6, 7, 5, 6, 8, 5, 6, 7]


def test_build_keeps_each_contexts_most_frequent_follower():
    """By hand, min_count 1: "5" is followed by 6 three times in 3 (chance 3 / (3 + 1)); "6" by 7 twice
    and 8 once (7: 2 / 4); "5 6" by 7, 8, 7 (2 / 4); "1 5 6" by 7 once (1 / 2); the last token's
    context, "6 7" at the end, is followed by nothing there."""
    t = NgramTable.build([TEXT], vocab_size=10, min_count=1)
    f = t.contexts()
    assert f[(5,)] == (6, 0.75) and f[(6,)] == (7, 0.5) and f[(5, 6)] == (7, 0.5) and f[(1, 5, 6)] == (7, 0.5)
    assert f[(6, 7)] == (5, 0.5)  # seen twice, followed once
    assert len(t) == 18  # 5 + 6 + 7 distinct contexts of orders 1, 2, 3
    # min_count 2 (the default): only followers seen twice or more
    t = NgramTable.build([TEXT], vocab_size=10)
    assert t.contexts() == {(5,): (6, 0.75), (6,): (7, 0.5), (5, 6): (7, 0.5)}


def test_ids_outside_the_vocabulary_match_no_context():
    """The table packs a context's ids into one int, `bits` bits each: an id past the vocabulary ran into
    its neighbour's bits, and (1, 16) found (2, 0)'s follower (a review). Such an id is in no context;
    those after it still match, as with tuples."""
    t = NgramTable.build([[2, 0, 5] * 3], vocab_size=10)
    assert t.get((2, 0)) == (5, 0.75) and t.get((1, 16)) is None and t.get((-1,)) is None and t.get(()) is None
    assert t.chain([1, 16], 4) == ([], []) and t.chain([16], 4) == ([], [])
    assert t.chain([16, 2, 0], 1) == t.chain([2, 0], 1) == ([5], [0.75])


def test_ties_go_to_the_lowest_id_and_texts_do_not_run_together():
    t = NgramTable.build([[4, 9], [4, 2], [4, 9], [4, 2]], vocab_size=10)
    assert t.contexts() == {(4,): (2, 2 / 5)}  # 9 and 2 twice each in 4: the lowest id; no (9, 4) or (2, 4)
    assert len(NgramTable.build([], vocab_size=10)) == 0
    assert len(NgramTable.build([[3], [3, 3]], vocab_size=10)) == 0  # one bigram, seen once


def test_chain_backs_off_to_shorter_contexts_and_stops_where_drafts_stop_paying():
    """After [3, 5]: no "3 5", "5" -> 6 (0.75); then "5 6" -> 7 (0.75 x 0.5); then "5 6 7" is absent
    (min_count 2), "6 7" absent, "7" absent: the chain ends."""
    t = NgramTable.build([TEXT], vocab_size=10)
    assert t.chain([3, 5], 8) == ([6, 7], [0.75, 0.375])
    assert t.chain([3, 5], 1) == ([6], [0.75])
    assert t.chain([9], 8) == ([], [])
    assert t.chain([], 8) == ([], [])
    # a loop: "1 -> 1" seen 99 times in 100: chances 0.98, 0.98^2, ... until under MIN_CHANCE
    loop = NgramTable.build([[1] * 101], vocab_size=2)
    drafts, chances = loop.chain([1], 1000)
    assert set(drafts) == {1} and chances[-1] >= MIN_CHANCE > chances[-1] * 98 / 99
    assert chances[:3] == pytest.approx(np.cumprod([100 / 101, 99 / 100, 98 / 99]))  # orders 1, 2, then 3


def test_the_drafter_offers_the_chain_that_promises_more():
    """Prompt lookup's copy after a short match (match 2, so r = 1: chances 1/2, 1/3) against the
    table's chain (0.75, 0.375): the table's adds up to more. After a long match the copy wins."""
    t = NgramTable.build([TEXT], vocab_size=10)
    d = NgramDrafter([2, 5, 9, 9, 3, 5], table=t)  # "3 5"? no; "9 3 5"? no: no copy at all
    assert d.draft(4) == [6, 7] and d.chances == [0.75, 0.375]
    d = NgramDrafter([4, 5, 9, 9, 4, 5], table=t)  # "4 5" copied: [9, 9], match 2
    assert d.draft(2) == [6, 7] and d.chances == [0.75, 0.375]  # 1.125 > 1/2 + 1/3
    d = NgramDrafter([8, 8, 8, 8, 4, 5, 9, 9, 8, 8, 8, 8, 4, 5], table=t)  # "8 8 8 8 4 5" agrees: match 6, r = 5
    assert d.draft(2) == [9, 9] and d.chances == [5 / 6, 5 / 7]
    d = NgramDrafter([1, 2, 3, 1, 2], table=None)
    assert d.draft(2) == [3, 1] and d.chances == [1 / 2, 1 / 3]


def test_a_saved_table_reads_back_the_same(tmp_path):
    arrays = count_ngrams([TEXT, [2, 5, 6, 7, 5, 6]])
    np.savez_compressed(tmp_path / FILE, **arrays)
    t = NgramTable.read(tmp_path / FILE, 10, contexts=contexts_in(arrays))
    n = contexts_in(arrays)
    assert t.contexts() == NgramTable.from_arrays(arrays, 10).contexts() and len(t) == n > 3
    with pytest.raises(ModelFormatError, match=f"holds {n} contexts, the manifest says {n + 1}"):
        NgramTable.read(tmp_path / FILE, 10, contexts=n + 1)


def _write(path, **arrays):
    np.savez(path, **arrays)


@pytest.mark.parametrize("bad, why", [
    ({"next_1": np.array([12], np.int32)}, "outside the vocabulary"),
    ({"count_1": np.array([5], np.uint32)}, "more often than its context"),
    ({"count_1": np.array([0], np.uint32)}, "counted 0 times"),
    ({"context_2": np.array([[1]], np.int32)}, r"context_2 has shape \(1, 1\), not \(m, 2\)"),
    ({"count_1": np.array([3, 3], np.uint32)}, "do not agree"),
    ({"seen_3": None}, "no array seen_3"),
    ({"next_1": np.array([[6]], np.int32)}, r"next_1 has shape \(1, 1\), not \(m,\)"),  # (a review: it loaded, and
    ({"next_1": np.array(6, np.int32)}, r"next_1 has shape \(\), not \(m,\)"),  # every request then failed)
    ({"context_3": np.zeros((MAX_CONTEXTS + 1, 3), np.int32)}, "with m at most"),
    ({"next_1": np.array([6], np.float32)}, "not integers"),
])
def test_a_table_that_does_not_hold_together_is_refused(tmp_path, bad, why):
    arrays = count_ngrams([TEXT] * 2)
    arrays = {**arrays, "context_1": np.array([[5]], np.int32), "next_1": np.array([6], np.int32),
              "count_1": np.array([3], np.uint32), "seen_1": np.array([4], np.uint32)}
    arrays.update(bad)
    _write(tmp_path / FILE, **{k: v for k, v in arrays.items() if v is not None})
    with pytest.raises(ModelFormatError, match=f"not a valid n-gram table.*{why}"):
        NgramTable.read(tmp_path / FILE, 10)


def test_files_that_are_no_table_are_refused(tmp_path):
    (tmp_path / "a").write_bytes(b"not a zip at all")
    np.save(tmp_path / "b.npy", np.zeros(3))
    (tmp_path / "b.npy").rename(tmp_path / "b")
    with np.errstate(all="ignore"):
        np.savez(tmp_path / "c.npz", next_1=np.array([object()], dtype=object))
    for name in ("a", "b", "c.npz", "missing"):
        with pytest.raises(ModelFormatError, match="not a valid n-gram table"):
            NgramTable.read(tmp_path / name, 10)


@pytest.fixture(scope="module")
def with_table(tmp_path_factory):
    from edgeinfer.converters import convert

    dst = tmp_path_factory.mktemp("ngrams") / "fp32-ngrams"
    convert(STORIES_SRC, dst, quant="fp32", ngram_tokens=3000)
    return dst


def test_convert_writes_a_table_the_folder_checks(with_table, capsys):
    from edgeinfer.inspect import describe, verify
    from edgeinfer.manifest import read_manifest

    m = read_manifest(with_table)
    assert m.ngrams is not None and m.ngrams.file == FILE and FILE in m.files
    assert m.ngrams.tokens == 3000 and m.ngrams.contexts == len(NgramTable.read(with_table / FILE, 512)) > 100
    assert not (with_table / ".edgeinfer-verified.json").exists()  # the converter's own load left no stamp
    assert verify(with_table) and "n-gram table of" in describe(with_table)
    model = edgeinfer.load(with_table)
    assert model.engine.ngram_table() is not None and len(model.engine.ngram_table()) == m.ngrams.contexts
    # the table is what the folder's own model samples: the same seeds, the same counts
    again = NgramTable.build(sample_text(model, 3000), 512)
    assert again.contexts() == model.engine.ngram_table().contexts()


def test_a_changed_table_is_refused_at_load(with_table, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(with_table, folder)
    raw = bytearray((folder / FILE).read_bytes())
    raw[len(raw) // 2] ^= 1
    (folder / FILE).write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=FILE):
        edgeinfer.load(folder)



def test_a_table_changed_after_load_is_refused_when_it_is_read(with_table, tmp_path):
    """The table is read by the first request that speculates, after the load hashed the folder: a
    file swapped in between (another conversion's table of the same size) was drafted from unchecked.
    Its bytes are now checked against the manifest as they are read; the request is refused before it
    touches its context, and plain decoding goes on."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(with_table, folder)
    m = edgeinfer.load(folder)
    before = m.generate("Once", max_new_tokens=5, temperature=0)
    n_valid = m.cache.n_valid
    arrays = dict(np.load(folder / FILE))
    arrays["next_1"] = (arrays["next_1"] + 1) % 512  # the same contexts, other followers
    np.savez_compressed(folder / FILE, **arrays)
    with pytest.raises(ModelFormatError, match=f"{FILE} does not match its sha256"):
        m.generate("Lily and Ben", max_new_tokens=5, speculative="ngram")
    again = m.generate("Once", max_new_tokens=5, temperature=0)
    assert m.cache.n_valid == n_valid and (again.token_ids, again.text) == (before.token_ids, before.text)
    shutil.copy(with_table / FILE, folder / FILE)  # put back: read and used
    plain = m.generate("Lily and Ben", max_new_tokens=20, temperature=0)
    spec = m.generate("Lily and Ben", max_new_tokens=20, temperature=0, speculative="ngram")
    assert spec.token_ids == plain.token_ids and m.engine.ngram_table() is not None

def test_ngram_tokens_is_refused_where_it_cannot_be_made(tmp_path):
    from edgeinfer.converters import convert

    for kw, why in ((dict(target="coreml"), "--target coreml"), (dict(ngram_tokens=-1), "0.."),
                    (dict(ngram_tokens=True), "0.."), (dict(ngram_tokens=10 ** 9), "0..")):
        with pytest.raises(ConvertError, match=why):
            convert(STORIES_SRC, tmp_path / "x", **{"ngram_tokens": 10, **kw})
        assert not (tmp_path / "x").exists()
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "convert", str(STORIES_SRC), "-o", str(tmp_path / "y"),
                        "--ngram-tokens", "lots"], capture_output=True, text=True)
    assert r.returncode == 2 and "--ngram-tokens: expected a number of tokens" in r.stderr


@pytest.fixture
def fixed_k(monkeypatch):
    monkeypatch.setattr(speculative, "TUNING", Tuning(fixed_k=4))


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3)], ids=["greedy", "t0.8"])
def test_table_drafts_give_plain_decodings_tokens_and_more_of_them_are_accepted(with_table, converted, sampling,
                                                                                fixed_k):
    """On the golden prompts (stories that do not repeat themselves): the tokens equal plain
    decoding's, and the table's drafts are accepted more often than prompt lookup's alone."""
    plain_folder = converted(STORIES_SRC, "fp32")
    accepted = {}
    for name, folder in (("table", with_table), ("prompt", plain_folder)):
        m = edgeinfer.load(folder, threads=2)
        accepted[name] = 0
        for case in GOLDEN["cases"]:
            m.held = None  # each from an empty ring (no prefix reused between the two)
            want = m.generate(case["prompt_ids"], max_new_tokens=120, ignore_eos=True, **sampling)
            m.held = None
            g = m.stream(case["prompt_ids"], max_new_tokens=120, ignore_eos=True, speculative="ngram", **sampling)
            got = g.run_to_end()
            assert (got.token_ids, got.text, got.usage) == (want.token_ids, want.text, want.usage)
            accepted[name] += g.speculation.accepted_tokens
    assert accepted["table"] > 2 * accepted["prompt"]


@pytest.mark.parametrize("edit, why", [
    (lambda d: d["ngrams"].update(file="../ngrams.npz"), "bad field ngrams.file"),
    (lambda d: d["ngrams"].update(tokens=-5), "bad field ngrams.tokens"),
    (lambda d: d["ngrams"].update(contexts="many"), "bad field ngrams.contexts"),
    (lambda d: d["files"].pop(FILE), FILE),  # named by the manifest but not hashed: it would be read unchecked
])
def test_a_manifest_whose_table_entry_is_wrong_is_refused(with_table, tmp_path, edit, why):
    import shutil

    from edgeinfer.manifest import CHECKSUM_KEY, MANIFEST_FILE

    folder = tmp_path / "m"
    shutil.copytree(with_table, folder)
    d = json.loads((folder / MANIFEST_FILE).read_text())
    edit(d)
    d.pop(CHECKSUM_KEY)  # an edit by hand, kept by deleting the checksum
    (folder / MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(ModelFormatError, match=why):
        edgeinfer.load(folder)


def test_a_small_file_that_would_unpack_into_a_large_allocation_is_refused_first(tmp_path):
    """A zip whose member's header declares 10**12 ids (a review: 19 KB asked numpy for 3.6 TiB), and a
    zip bomb (120 million zero contexts deflate to a few MB; it took 6.5 GB): refused from the headers."""
    import zipfile

    arrays = count_ngrams([TEXT] * 2)
    with zipfile.ZipFile(tmp_path / FILE, "w") as z:
        for key, a in arrays.items():
            header = a if key != "next_1" else np.lib.stride_tricks.as_strided(a[:1], (10 ** 12,), (0,))
            with z.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(header))
                f.write(a.tobytes())
    with pytest.raises(ModelFormatError, match=r"next_1 has shape \(1000000000000,\)"):
        NgramTable.read(tmp_path / FILE, 10)
    np.savez_compressed(tmp_path / "bomb.npz", **{**arrays, "context_3": np.zeros((3 * MAX_CONTEXTS, 3), np.int32)})
    assert (tmp_path / "bomb.npz").stat().st_size < 2 ** 22
    with pytest.raises(ModelFormatError, match="context_3 has shape"):
        NgramTable.read(tmp_path / "bomb.npz", 10)


def test_damaged_archives_are_refused_in_one_line(tmp_path):
    """Bits flipped anywhere in a compressed table: zlib's errors, an unknown compression method, a bad
    CRC are a ModelFormatError like any other damage (a review: 89 of 400 flips were zlib tracebacks)."""
    arrays = count_ngrams([list(range(1, 60)) * 3] * 2)
    np.savez_compressed(tmp_path / FILE, **arrays)
    raw = (tmp_path / FILE).read_bytes()
    rng = np.random.default_rng(0)
    outcomes = set()
    for i in range(150):
        bad = bytearray(raw)
        bit = int(rng.integers(0, len(bad) * 8))
        bad[bit // 8] ^= 1 << bit % 8
        (tmp_path / "bad.npz").write_bytes(bytes(bad))
        try:
            NgramTable.read(tmp_path / "bad.npz", 60, contexts=contexts_in(arrays))
            outcomes.add("read")  # a flip in a part nothing reads (a name's padding, the archive comment)
        except ModelFormatError as e:
            assert "not a valid n-gram table" in str(e) or "contexts, the manifest says" in str(e)
            outcomes.add("refused")
    assert "refused" in outcomes


def test_inspect_verify_reads_the_table_as_load_does(with_table, tmp_path):
    import shutil

    from edgeinfer.inspect import verify
    from edgeinfer.integrity import sha256_file
    from edgeinfer.manifest import CHECKSUM_KEY, MANIFEST_FILE

    folder = tmp_path / "m"
    shutil.copytree(with_table, folder)
    arrays = dict(np.load(folder / FILE))
    arrays["next_1"] = arrays["next_1"].reshape(-1, 1)
    np.savez_compressed(folder / FILE, **arrays)
    d = json.loads((folder / MANIFEST_FILE).read_text())
    d["files"][FILE] = {"bytes": (folder / FILE).stat().st_size, "sha256": sha256_file(folder / FILE)}
    d.pop(CHECKSUM_KEY)
    (folder / MANIFEST_FILE).write_text(json.dumps(d))
    lines = []
    assert not verify(folder, out=lines.append)
    assert any(line.startswith("MISMATCH") and "next_1 has shape" in line for line in lines)
    # the table is read by the first request that speculates (plain decoding never pays for it), which is
    # refused before it touches its context; serve reads it as it starts, and does not start
    m = edgeinfer.load(folder)
    before = m.generate("Once", max_new_tokens=5, temperature=0)
    n_valid = m.cache.n_valid
    with pytest.raises(ModelFormatError, match="next_1 has shape"):
        m.generate("Lily and Ben", max_new_tokens=5, speculative="ngram")
    again = m.generate("Once", max_new_tokens=5, temperature=0)
    assert m.cache.n_valid == n_valid and (again.token_ids, again.text) == (before.token_ids, before.text)
    from edgeinfer.server.config import ServeConfig
    from edgeinfer.server.run import build

    with pytest.raises(ModelFormatError, match="next_1 has shape"):
        build(ServeConfig(model=str(folder), speculative="ngram"))
    server = build(ServeConfig(model=str(folder), speculative="draft", draft_model=str(with_table)))  # no table read
    server.scheduler.close()


def test_sampling_ends_when_the_model_ends_every_text_at_once(tmp_path, monkeypatch):
    """A model whose first token is always EOS adds nothing per text: sampling stops after as many texts
    as tokens asked (it looped for ever, a review), and convert refuses the empty table in one line."""
    from types import SimpleNamespace

    from edgeinfer.converters import convert, ngrams

    calls = []
    silent = SimpleNamespace(manifest=SimpleNamespace(tokenizer=SimpleNamespace(bos_token_id=1, eos_token_ids=(2,))),
                             generate=lambda ids, **kw: calls.append(kw["seed"]) or SimpleNamespace(token_ids=()))
    assert sample_text(silent, 50) == [[1]] * 50 and calls == list(range(50))
    monkeypatch.setattr(ngrams, "sample_text", lambda model, tokens, log: [[1]] * tokens)
    with pytest.raises(ConvertError, match="hold no context followed twice"):
        convert(STORIES_SRC, tmp_path / "x", quant="fp32", ngram_tokens=40)
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())


def test_a_model_without_bos_or_eos_is_refused_before_any_work(tmp_path):
    import shutil

    from edgeinfer.converters import convert

    src = tmp_path / "src"
    shutil.copytree(STORIES_SRC, src)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((src / name).read_text())
        (src / name).write_text(json.dumps({**cfg, "bos_token_id": None, "eos_token_id": None}))
    cfg = json.loads((src / "tokenizer_config.json").read_text())  # (else its <s> and </s> are taken)
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": None, "eos_token": None}))
    (src / "special_tokens_map.json").unlink()  # (and so are this file's)
    with pytest.raises(ConvertError, match="no BOS or EOS id"):
        convert(src, tmp_path / "x", quant="fp32", ngram_tokens=40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_architecture_optimum_exports_refuses_ngram_tokens(tmp_path, monkeypatch):
    """--via auto hands an architecture the native builder lacks to Optimum, which makes no table: the
    flag is refused there, not dropped (a review)."""
    import importlib

    convert_module = importlib.import_module("edgeinfer.converters.convert")
    monkeypatch.setattr(convert_module, "_needs_optimum", lambda src, log: True)
    with pytest.raises(ConvertError, match="exported by Optimum"):
        convert_module.convert(STORIES_SRC, tmp_path / "x", ngram_tokens=40)
    assert not (tmp_path / "x").exists()


def test_cli_and_api_take_the_count_as_people_write_it(tmp_path):
    from edgeinfer.converters import convert

    m = convert(STORIES_SRC, tmp_path / "a", quant="fp32", ngram_tokens=np.int64(2000))  # a numpy integer
    assert m.ngrams.tokens == 2000
    for bad in ("\u0663", "1e3", "-5", "0x10", ""):
        r = subprocess.run([sys.executable, "-m", "edgeinfer", "convert", str(STORIES_SRC), "-o", str(tmp_path / "y"),
                            "--ngram-tokens", bad], capture_output=True, text=True)
        assert r.returncode == 2 and "--ngram-tokens: expected a number of tokens" in r.stderr, bad

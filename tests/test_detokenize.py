"""The incremental detokenizer against the whole decode: on SentencePiece (the bundled model's, byte
fallback) and on a byte-level BPE built here with the `tokenizers` library, over random mixes of
words, characters split into byte tokens and bytes that never make a character."""

from __future__ import annotations

import random

import pytest

import edgeinfer
from edgeinfer.detokenize import Detokenizer


@pytest.fixture(scope="module")
def bundled():
    return edgeinfer.load()


def _byte_level(folder):
    """A real `Tokenizer` (the `tokenizers` back end) over a byte-level BPE built here: GPT-2's byte
    alphabet, a few merges, one special token that decode drops. Returns it and its byte -> id map."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from edgeinfer.manifest import TokenizerInfo
    from edgeinfer.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©")]  # " the", "é" as one token
    for a, b in merges:
        vocab[a + b] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|end|>"])
    hf.save(str(folder / "tokenizer.json"))
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # GPT-2's byte -> character map
    extra = iter(range(256, 512))
    byte_char = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    return Tokenizer(folder, TokenizerInfo(kind="hf_tokenizers")), {b: vocab[byte_char[b]] for b in range(256)}


def _pieces(encode, byte_id, rng: random.Random, specials: tuple[int, ...] = ()) -> list[int]:
    """Random ids: words, characters of 2-4 bytes as byte tokens, lone bytes (lead bytes, stray
    continuation bytes) that never make a character, and runs of special tokens and of ids past the
    vocabulary (a padded embedding row's), which decode drops."""
    ids: list[int] = []
    for _ in range(rng.randrange(1, 30)):
        kind = rng.random()
        if specials and kind < 0.1:  # runs about the hold's bounds
            ids += [rng.choice(specials) for _ in range(rng.choice([1, 5, 15, 16, 17, 40, 63, 64, 65, 70, 130]))]
        elif kind < 0.4:
            ids += encode(rng.choice([" the", " a", "cat", " dog.", "é", " Once"]))
        elif kind < 0.7:
            char = [byte_id(b) for b in rng.choice(["é", "€", "😀", "ß", "中"]).encode()]
            if specials and rng.random() < 0.2:  # something decode drops between its bytes
                char.insert(rng.randrange(1, len(char)), rng.choice(specials))
            ids += char
        else:
            ids += [byte_id(rng.choice([0xE2, 0xF0, 0x82, 0xAC, 0xC3, 0xFF, 0x41]))
                    for _ in range(rng.randrange(1, 40))]
    return ids


def _check(tok, ids: list[int], context: list[int], cut: int = 0) -> None:
    """The pieces join to what `ids` add after `context`; `cut`: the context's last tokens begin a
    character (their text comes with the token that completes it)."""
    d = Detokenizer(tok, context)
    whole = tok.decode(context + ids)
    before = tok.decode(context[:len(context) - cut])
    assert whole.startswith(before)
    want = whole[len(before):]
    got = ""
    for t in ids:
        got += d.add(t)
        assert want.startswith(got)  # what is out is never taken back
    got += d.flush()
    assert got == want


@pytest.mark.parametrize("seed", range(6))
def test_sentencepiece_pieces_join_to_the_whole_decode(bundled, seed):
    tok = bundled.tokenizer
    rng = random.Random(seed)
    contexts = [(tok.encode(text, add_bos=False), 0) for text in ("", "Once upon a", "She said", "a \ufffd")]
    contexts += [([1], 0), (tok.encode("Once", add_bos=False) + [3 + 0xE2, 3 + 0x82], 2),  # BOS; cut mid-"€"
                 (tok.encode("Once", add_bos=False) + [3 + 0xE2, 600], 2)]  # then an id past the vocabulary
    for _ in range(150):
        context, cut = rng.choice(contexts)
        ids = _pieces(lambda s: tok.encode(s, add_bos=False), lambda b: 3 + b, rng, specials=(1, 2, 600, 700))
        _check(tok, ids, context, cut)


def test_byte_level_pieces_join_to_the_whole_decode(tmp_path):
    tok, byte = _byte_level(tmp_path)
    (end,) = tok.special_ids
    dropped = (end, len(byte) + 400)  # the special token; an id past the vocabulary

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_bos=False)

    rng = random.Random(11)
    for _ in range(600):
        context, cut = encode(rng.choice(["", "the cat", " é"])), 0
        if rng.random() < 0.4:  # the context ends mid-character, maybe with a dropped id among its bytes
            char = rng.choice(["€", "😀", "中"]).encode()
            k = rng.randrange(1, len(char))
            tail = [byte[b] for b in char[:k]]
            if rng.random() < 0.5:
                tail.insert(rng.randrange(1, len(tail) + 1), rng.choice(dropped))
            context, cut = context + tail, len(tail)
            ids = [byte[b] for b in char[k:]] + _pieces(encode, byte.__getitem__, rng, specials=dropped)
        else:
            ids = _pieces(encode, byte.__getitem__, rng, specials=dropped)
        _check(tok, ids, context, cut)


def test_bytes_that_never_make_a_character_cost_a_bounded_decode_each(bundled):
    """A hostile round: 16,000 lead bytes forced with logit_bias were held whole and re-decoded at
    every token (9.4 s; quadratic), and the reply's text was empty while decode gave 16,000 U+FFFD.
    Now what is final is let out: each token decodes at most about HOLD_TOKENS + SPLIT_TRIES ids."""

    class Counting:  # the tokenizer, counting what it decodes
        def __init__(self, tok):
            self.tok, self.decoded_ids = tok, 0

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def decode(self, ids):
            self.decoded_ids += len(ids)
            return self.tok.decode(ids)

    tok = Counting(bundled.tokenizer)
    n = 4000
    d = Detokenizer(tok)
    text = "".join(d.add(3 + 0xE2) for _ in range(n)) + d.flush()
    assert text == "\ufffd" * n
    per_token = 4 * (Detokenizer.CONTEXT + Detokenizer.HOLD_TOKENS + Detokenizer.SPLIT_TRIES)
    assert tok.decoded_ids < n * per_token  # before: about n * n / 2 = 8,000,000


def test_special_tokens_held_long_neither_cost_a_whole_decode_nor_lose_a_space(bundled):
    """A review: past HOLD_TOKENS, tokens that add no text became the left context, so the next
    token lost its leading space ("par,and" for "par, and"); and a lead byte followed by special
    tokens was held whole, decoded about 10 times a token (72 M ids for 4,000 tokens)."""
    tok = bundled.tokenizer
    context = tok.encode("Once upon a", add_bos=False)
    for n in (16, 17, 100):
        _check(tok, [2] * n + tok.encode(" time", add_bos=False), context)

    class Counting:  # the tokenizer, counting what it decodes
        def __init__(self):
            self.decoded_ids = 0

        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids):
            self.decoded_ids += len(ids)
            return tok.decode(ids)

    counting, n = Counting(), 4000
    d = Detokenizer(counting)
    text = "".join(d.add(t) for t in [3 + 0xE2] + [2] * (n - 1)) + d.flush()
    assert text == tok.decode([3 + 0xE2] + [2] * (n - 1)) == "\ufffd"
    assert counting.decoded_ids < n * 4 * (Detokenizer.FORCE_TOKENS + Detokenizer.SPLIT_TRIES)
    for prompt, seed, bias in (("Once upon a time", 1, {2: 26.0}),  # EOS, ignored, often: runs of it
                               ([1], 247, {2: 30.0, 410: 6.0}),  # from BOS alone, "▁" often (a review)
                               ("The sign said \ufffd", 0, {})):  # a prompt ending in a literal U+FFFD
        ids = bundled.encode_prompt(prompt)
        c = bundled.generate(ids, max_new_tokens=400, temperature=1.0, ignore_eos=True, seed=seed, logit_bias=bias)
        assert c.text == tok.decode(ids + list(c.token_ids))[len(tok.decode(ids)):]


@pytest.mark.parametrize("context, ids, want", [
    ([1], [2] * 16 + [410, 265], " the"),  # a "▁" after held specials kept its space (a review)
    ("Once upon a", [3 + 0x82] + [2] * 62 + [3 + 0xE2, 3 + 0x82, 3 + 0xAC], "\ufffd€"),  # a stray byte, specials, "€"
    ("Once upon a", [3 + 0xAC] + [2] * 129 + [280], "\ufffd c"),
    ("Once upon a", [600, 2, 378], " time"),  # an id past the vocabulary, then EOS (a review)
    ("Once upon a", [600] * 65 + [378], " time"),
    ("Once", [3 + 0xE2] + [600] * 64 + [3 + 0x82, 3 + 0xAC], "€"),
])
def test_cases_a_review_found(bundled, context, ids, want):
    tok = bundled.tokenizer
    context = tok.encode(context, add_bos=False) if isinstance(context, str) else context
    assert tok.decode(context + ids)[len(tok.decode(context)):] == want
    _check(tok, ids, context)


def test_a_reply_of_broken_bytes_has_the_text_decode_gives(bundled):
    """The reply's text was "" for any run of bytes that never made a character, and a reply that
    ended inside a character lost it; now it is what the tokenizer's decode of its ids gives, as the
    streamed chunks join to it."""
    m = bundled
    for n in (3, 40, 500):
        stream = m.stream("Once", max_new_tokens=n, temperature=0, ignore_eos=True, logit_bias={3 + 0xE2: 100})
        chunks = list(stream)
        text = "".join(ch.text for ch in chunks)
        assert text == m.tokenizer.decode([ch.token_id for ch in chunks if ch.token_id is not None])
        assert text == "\ufffd" * n == stream.completion.text
    c = m.generate("Once", max_new_tokens=40, temperature=0, ignore_eos=True, logit_bias={3 + 0xE2: 100})
    assert c.text == "\ufffd" * 40 and c.finish_reason == "length"


def test_a_stop_string_in_the_text_held_at_the_end_stops(bundled):
    """The held text comes out through the stop filter: a stop string in it ends the reply as "stop"."""
    c = bundled.generate("Once", max_new_tokens=3, temperature=0, ignore_eos=True, logit_bias={3 + 0xE2: 100},
                         stop=["\ufffd"])
    assert c.text == "" and c.finish_reason == "stop"


def _library_decode(tok, ids) -> str:
    """The back end's own decode of `ids`, with the ids `Tokenizer.decode` drops before decoding removed."""
    kept = [int(i) for i in ids if 0 <= int(i) < tok._n_vocab]
    return tok._sp.decode(kept) if tok.kind == "sentencepiece" else tok._hf.decode(kept, skip_special_tokens=True)


@pytest.mark.parametrize("backend", ["sentencepiece", "byte_level"])
def test_remembered_short_decodes_are_the_library_decodes(bundled, tmp_path, backend):
    """Decodes of one or two ids are remembered (the detokenizer asks for two per token): every
    single id (past the vocabulary and negative ones too) and random pairs (specials and bytes among
    them) give the library's decode, the first time and from memory, as lists, tuples and numpy ids;
    the memory stays within `SHORT_DECODES` as new pairs keep coming."""
    import numpy as np

    tok = bundled.tokenizer if backend == "sentencepiece" else _byte_level(tmp_path)[0]
    n = tok._n_vocab
    rng = random.Random(5)
    singles = [[i] for i in range(-2, n + 3)]
    pairs = [[rng.randrange(-1, n + 2), rng.randrange(-1, n + 2)] for _ in range(3 * tok.SHORT_DECODES)]
    for ids in singles + pairs:
        want = _library_decode(tok, ids)
        assert tok.decode(ids) == want
        assert tok.decode(tuple(ids)) == want and tok.decode(np.array(ids, np.int64).tolist()) == want
        assert tok.decode([np.int64(i) for i in ids]) == want
        assert len(tok._short) <= tok.SHORT_DECODES
    assert tok.decode([]) == ""
    assert tok.decode(iter(pairs[0])) == _library_decode(tok, pairs[0])  # any iterable, as before


def test_a_llama_style_tokenizer_json_decodes_broken_bytes_as_sentencepiece_does(tmp_path):
    """A hostile round: the tokenizer.json a SentencePiece GGUF's metadata becomes (Hugging Face's
    Llama-style decoder: Replace, ByteFallback, Fuse, Strip) showed a whole run of byte tokens as
    U+FFFD once one byte in it was invalid: "0", a lone 0xC3, then the three bytes of "中" decoded to
    five U+FFFD, streamed or whole, where SentencePiece and llama.cpp give "0\\ufffd中". Against
    SentencePiece on the same ids (runs of U+FFFD counted as one; SentencePiece keeps the leading
    space of a <0x20> byte where the decoder's Strip drops any), and the library's own decode wherever
    that has no U+FFFD. (Neither <unk>, which SentencePiece writes " \u2047 " and the decoder "<unk>",
    nor BOS and EOS, which end a run of bytes in SentencePiece and are dropped before decoding in
    the library, are among the ids compared with SentencePiece.)"""
    import re
    from pathlib import Path

    import sentencepiece as spm

    from converters.gguf_header import read_header
    from converters.gguf_tokenizer import tokenizer_json
    from edgeinfer.manifest import TokenizerInfo
    from edgeinfer.tokenizer import Tokenizer

    fixtures = Path(__file__).parent / "fixtures"
    meta, _ = read_header(fixtures / "gguf" / "stories260K-F32.gguf")
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(meta, "stories260K-F32.gguf"))
    tok = Tokenizer(tmp_path, TokenizerInfo(kind="hf_tokenizers", bos_token_id=1, eos_token_ids=(2,)))
    sp = spm.SentencePieceProcessor(model_file=str(Path(edgeinfer.__file__).parent.parent / "models" / "stories260K"
                                                   / "tokenizer.model"))
    ids = [3 + ord("0"), 3 + 0xC3] + [3 + b for b in "中".encode()]
    assert tok.decode(ids) == "0\ufffd中"
    d = Detokenizer(tok)
    assert "".join(d.add(t) for t in ids) + d.flush() == "0\ufffd中"

    def one(t: str) -> str:
        return re.sub("\ufffd+", "\ufffd", t)

    rng = random.Random(3)
    n = sp.get_piece_size()
    for _ in range(3000):
        ids = [3 + rng.randrange(256) if rng.random() < 0.5 else rng.randrange(3, n)
               for _ in range(rng.randrange(1, 12))]
        got, want = one(tok.decode(ids)), one(sp.decode(ids))
        assert got in (want, want[1:] if want.startswith(" ") else want), ids
        ids.insert(rng.randrange(len(ids) + 1), rng.choice([1, 2]))  # dropped before decoding, as the library does
        library = tok._hf.decode(ids, skip_special_tokens=True)
        if "\ufffd" not in library:
            assert tok.decode(ids) == library, ids
        _check(tok, ids, [], 0)


def test_where_two_stop_strings_cut_does_not_depend_on_how_the_tokens_split_the_text():
    """A hostile round: the reply was cut at the earliest start among the stops found in a piece, so a
    stop that ends later but arrived in the same token as an earlier-ending one won (" there was" by
    tokens, " there was a" a character at a time, for the stops " l" and " a littl"). It ends at the
    stop that ends first, whatever the split: against a character-at-a-time feed on random cases."""
    from edgeinfer.detokenize import StopFilter

    def cut(pieces, stops):
        f = StopFilter(tuple(stops))
        out = "".join(f.feed(p) for p in pieces)
        return out + ("" if f.stopped else f.flush())

    text, stops = " there was a little girl", [" l", " a littl"]
    assert cut([" there", " was", " a", " little", " girl"], stops) == cut(list(text), stops) == " there was a"
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 24)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert cut(pieces, stops) == cut(list(text), stops), (text, stops, pieces)

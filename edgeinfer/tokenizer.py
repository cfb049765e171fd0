"""Tokenizers: SentencePiece (`tokenizer.model`) or Hugging Face `tokenizers` (`tokenizer.json`).

`encode` never adds special tokens on its own: BOS is prepended when the manifest's tokenizer
section (a `TokenizerInfo`) says `add_bos` (the model's tokenizer_config), so both back ends behave
the same.
`decode` drops special tokens (BOS/EOS decode to ""); `token_string` gives a token's own string
in the vocabulary ("<s>", "<|im_end|>"), which is what chat templates want for bos/eos_token.
A rendered template holds those strings as text, so `encode` maps them back to their ids: the
`tokenizers` library does it for its added tokens; for SentencePiece, the control pieces' strings
are split out here and each piece of text between them is encoded on its own (as Hugging Face's
legacy Llama tokenizer does: text after "<s>" gets the usual leading-space marker).

Text a client sends inside a chat message must not become a control token (`<|im_end|>` then
`<|im_start|>system` would close the user's turn and forge a system one): `defuse` replaces each
control token's string in such text with a placeholder (private-use characters around a random
number drawn per Tokenizer) that the template carries through. `encode` splits the rendering at
the template's own control strings only, puts each placeholder's string back as text, and encodes
each stretch between them in one call that matches no control token (SentencePiece never matches
them in text; the `tokenizers` library is asked not to), so the string's plain-text tokens sit in
their context as any other text would. With the `tokenizers` library, a stretch is encoded as the
library encodes one after an added token: the whitespace an lstrip/rstrip token takes is taken, and
under Metaspace "first" it gets no word-start marker (encoded after an added token of a second
instance, whose id is dropped; `_after_control`). Text without control strings is tokenized as before.
Controls are SentencePiece's control pieces and the `tokenizers` library's special added tokens; a
SentencePiece user-defined piece or a non-special added token in a message is still matched (not a
role marker in the families converted here; Gemma's turn markers are user-defined pieces).
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from edgeinfer.errors import InvalidArgumentError, ModelFormatError
from edgeinfer.small_files import MAX_TEXT_BYTES, read_bytes
from edgeinfer.manifest import TokenizerInfo
from edgeinfer.versions import older_than


# Unicode's White_Space, which the tokenizers library's lstrip/rstrip take (Python's strip also takes
# U+001C-U+001F: a hostile round found '\x1f' dropped next to such a token)
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"


class Tokenizer:
    def __init__(self, folder: Path, info: TokenizerInfo):
        folder = Path(folder)
        self.kind = info.kind
        self.add_bos = info.add_bos
        self.bos_id = info.bos_token_id
        self.eos_ids = info.eos_token_ids
        if self.kind == "sentencepiece":
            import sentencepiece as spm

            path = folder / "tokenizer.model"
            if not path.exists():
                raise ModelFormatError(f"{folder} lacks tokenizer.model")
            proto = read_bytes(path, MAX_TEXT_BYTES, ModelFormatError)
            if not proto:  # SentencePiece takes it and is "not initialized": a RuntimeError at the first encode
                raise ModelFormatError("tokenizer.model is corrupted (empty)")
            try:  # from bytes: a path that is not UTF-8 is a TypeError in its file loader
                self._sp = spm.SentencePieceProcessor(model_proto=proto)
            except (RuntimeError, OSError) as e:
                raise ModelFormatError(f"tokenizer.model is corrupted ({e})") from None
            self._n_vocab = self._sp.get_piece_size()
            self._specials = {self._sp.id_to_piece(i): i for i in range(self._n_vocab)
                              if self._sp.is_control(i) and self._sp.id_to_piece(i)}
            self._encode_all = self._encode_text = self._sp.encode  # never matches a control piece
            self._decode = lambda ids: self._sp.decode(ids)
            self._token_string = lambda i: self._sp.id_to_piece(i)
        else:
            from tokenizers import Tokenizer as HFTokenizer

            path = folder / "tokenizer.json"
            if not path.exists():
                raise ModelFormatError(f"{folder} lacks tokenizer.json")
            raw = read_bytes(path, MAX_TEXT_BYTES, ModelFormatError)
            try:
                self._hf = HFTokenizer.from_buffer(raw)
            except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
                raise ModelFormatError(f"tokenizer.json is corrupted ({e}){_old_tokenizers_hint()}") from None
            # encode_batch of one text: the same ids as encode, but it releases the GIL (encode keeps it:
            # a 760 KB prompt stalled the daemon's event loop 0.4 s) and runs ~1.5x faster
            self._encode_all = lambda text: self._hf.encode_batch([text], add_special_tokens=False)[0].ids
            self._raw, self._hf_text = raw, None  # a second instance that matches no special token, made when
            # a defused text first needs it (`_encode_text`)
            self._n_vocab = self._hf.get_vocab_size(with_added_tokens=True)
            self._token_string = lambda i: self._hf.id_to_token(i)
            added = self._hf.get_added_tokens_decoder()
            self._specials = {t.content: i for i, t in added.items() if t.special and t.content}
            self._strips = {t.content: (t.lstrip, t.rstrip) for t in added.values() if t.special and t.content}
            self._decode = (_byte_fallback_decode(self._hf, self._n_vocab, set(self._specials.values()))
                            or (lambda ids: self._hf.decode(ids, skip_special_tokens=True)))
        for field, ids in (("bos_token_id", () if self.bos_id is None else (self.bos_id,)),
                           ("eos_token_ids", self.eos_ids)):  # (a hand-edited manifest: named now, not at a chat)
            bad = [t for t in ids if not 0 <= t < self._n_vocab]
            if bad:
                raise ModelFormatError(f"tokenizer.{field} holds {bad[0]}, outside the tokenizer's vocabulary "
                                       f"of {self._n_vocab}")
        controls = sorted(self._specials, key=len, reverse=True)  # the longest first, as the split matches
        self._control_re = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None
        nonce = "".join(secrets.choice("0123456789") for _ in range(16))  # digits: a template's upper() keeps them
        self._placeholder = {s: f"\ue000{nonce}.{i}\ue001" for i, s in enumerate(controls)}
        self._placeholder_re = re.compile(f"\ue000{nonce}\\.(\\d+)\ue001")
        # the same as Python's repr and JSON's ensure_ascii write it: a template that prints a dict variable
        # (`{{ extra }}`, a review; upper-cased by a filter, or escaped twice by tojson of tojson: a second review)
        self._escaped_re = re.compile(f"\\\\+ue000{nonce}\\.(\\d+)\\\\+ue001", re.IGNORECASE)
        self._after = f"\ue002{nonce}\ue003"  # `_after_control`'s added token
        self._controls = controls

        self.special_ids = frozenset(self._specials.values())  # what `decode` drops (BOS, EOS, chat controls)
        self._texts: dict[int, str | bytes] = {}  # token_text's cache
        self._short: dict[tuple, str] = {}  # decode's of 1-2 ids
        self._anchor = self._encode("a")[-1:]  # a plain token for token_text to put before another

    @property
    def id_limit(self) -> int:
        """One past the largest id `encode` can give (added tokens included)."""
        if self.kind == "sentencepiece":
            return self._n_vocab
        return max(self._hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` (valid Unicode: a lone surrogate, e.g. an undecodable byte of a
        command line, raises InvalidArgumentError), with BOS first when `add_bos` (default: the
        model's config)."""
        check_utf8(text)
        ids = self._encode(text)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, int(self.bos_id))
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of `text` where it follows plain text (not a control token) in one rendering: a
        conversation's new turn after the reply its cache holds, as `encode` of the whole gives them,
        without the word-start marker SentencePiece puts before a text's first piece ("\nUser:" alone
        is "\u2581", "\n", ...; after a reply, "\n", ...). Encoded after a newline whose ids are then
        dropped; where the two merge, `text` is encoded on its own. Text as `encode` takes it."""
        check_utf8(text)
        head = self._encode("\n")
        ids = self._encode("\n" + text)
        return ids[len(head):] if ids[:len(head)] == head else self._encode(text)

    def defuse(self, text: str) -> str:
        """`text` (a chat message's content) with each control token's string replaced by a placeholder
        that `encode` turns into that string's plain-text tokens (the module doc)."""
        if self._control_re is None:
            return text
        return self._control_re.sub(lambda m: self._placeholder[m.group(0)], text)

    def undefuse(self, text: str) -> str:
        """`text` with `defuse`'s placeholders put back as the control strings they stand for (as text: a
        template's error message quoting a message, a rendering that printed a dict or list variable)."""
        if "\ue000" in text:
            text = self._placeholder_re.sub(self._control_for, text)
        if "\\" in text:
            text = self._escaped_re.sub(self._control_for, text)
        return text

    def _control_for(self, m: re.Match) -> str:
        """A placeholder's control string; one a client wrote with an index past them, as it is (its index was
        read unchecked: an IndexError, a 500 from the daemon, once the nonce had leaked: a review)."""
        i = int(m.group(1))
        return self._controls[i] if i < len(self._controls) else m.group(0)

    def _encode(self, text: str) -> list[int]:
        """Ids of `text`, its control strings matched, `defuse`'s placeholders encoded as plain text."""
        if self._control_re is None:
            return list(self._encode_all(text))
        defused = (("\ue000" in text and self._placeholder_re.search(text) is not None)
                   or ("\\" in text and self._escaped_re.search(text) is not None))
        if self.kind != "sentencepiece" and not defused:
            return list(self._encode_all(text))  # the library splits at its special tokens itself
        ids: list[int] = []
        pieces = self._control_re.split(text)
        for i, part in enumerate(pieces):
            if i % 2:  # the split keeps the matched control strings at odd indices
                ids.append(self._specials[part])
                continue
            if defused:
                part = self.undefuse(part)
            if self.kind == "sentencepiece":  # (as Hugging Face's legacy Llama tokenizer encodes the text between
                ids.extend(self._encode_text(part) if part else [])  # controls)
                continue
            # the tokenizers back end, a rendering whose message holds a control string: each stretch as the
            # library encodes it between its added tokens (whitespace they strip, no word-start marker after one
            # under Metaspace "first": a review found stretches encoded as texts of their own)
            if i > 0 and self._strips[pieces[i - 1]][1]:
                part = part.lstrip(WHITE_SPACE)
            if i + 1 < len(pieces) and self._strips[pieces[i + 1]][0]:
                part = part.rstrip(WHITE_SPACE)
            if part:
                ids.extend(self._encode_text(part) if i == 0 else self._after_control(part))
        return ids

    def _after_control(self, text: str) -> list[int]:
        """`_encode_text(text)` as the library encodes text that follows an added token in one call
        (Metaspace "first", Mistral v0.3's and stories260K's, puts no word-start marker there; Llama 2's
        Prepend normalizer does): encoded after `_after`, an added token of the plain instance alone
        (private-use characters around this Tokenizer's random number), whose id is then dropped. A
        review's probe with a "\n" before the text failed where "\n" merges with what follows
        (236 of 3,000 texts in such a vocabulary; 0 now)."""
        ids = self._encode_text(self._after + text)
        return ids[1:] if ids[:1] == [self._after_id] else self._encode_text(text)

    def _encode_text(self, text: str) -> list[int]:
        """Ids of `text` with no special added token matched (the tokenizers back end; the
        SentencePiece one sets its own `_encode_text`)."""
        if self._hf_text is None:
            from tokenizers import AddedToken, Tokenizer as HFTokenizer

            plain = HFTokenizer.from_buffer(self._raw)
            plain.encode_special_tokens = True
            plain.add_tokens([AddedToken(self._after, normalized=False, special=False)])  # `_after_control`'s
            self._after_id = plain.token_to_id(self._after)
            self._hf_text = plain
        return self._hf_text.encode_batch([text], add_special_tokens=False)[0].ids

    SHORT_DECODES = 4096  # decodes of 1-2 ids kept (0.7 MB for a SentencePiece vocabulary), forgotten all at once when full

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; an id past the tokenizer's vocabulary (a model's padded embedding rows,
        which Hugging Face checkpoints often have: Qwen2.5's 151,936 rows for 151,665 tokens) adds
        nothing, as a special token does.

        Decodes of one or two ids, which incremental detokenizing asks for twice per generated token
        (`detokenize.Detokenizer`), are remembered (`SHORT_DECODES` of them): 0.1 µs instead of 3."""
        if isinstance(ids, (list, tuple)) and len(ids) <= 2:
            key = tuple(ids)
            text = self._short.get(key)
            if text is None:
                if len(self._short) >= self.SHORT_DECODES:
                    self._short.clear()
                text = self._short[key] = self._decode([i for i in map(int, ids) if 0 <= i < self._n_vocab])
            return text
        return self._decode([i for i in map(int, ids) if 0 <= i < self._n_vocab])

    def drops(self, token_id: int) -> bool:
        """Whether `decode` drops `token_id` before decoding, as if it were not there: an id past the
        vocabulary (a padded row's), or a special token of the `tokenizers` back end. SentencePiece's
        control pieces (`special_ids`) decode to nothing too, but end a run of byte pieces: the bytes
        before one never join those after it."""
        return not 0 <= token_id < self._n_vocab or (self.kind != "sentencepiece" and token_id in self.special_ids)

    def token_text(self, token_id: int) -> str | bytes:
        """What the token adds to a text, as an API shows one token of logprobs: its text after other
        text (leading space kept: "▁the" -> " the"; "<0x0A>" -> "\n"; "" for a special token, which
        decodes to nothing), or its bytes where they are not whole UTF-8 (a byte-fallback or byte-level
        piece of a character: "<0xE4>" -> b"\xe4"). So the texts of generated tokens, with runs of
        bytes decoded together, join to their decoded text. Cached per id."""
        token_id = int(token_id)
        text = self._texts.get(token_id)
        if text is None and not 0 <= token_id < self._n_vocab:
            return ""  # a padded row's id: no text (`decode`)
        if text is None:
            piece = self.token_string(token_id)
            anchor = self.decode(self._anchor)  # the token after other text: its leading space is kept
            text = self.decode(self._anchor + [token_id])[len(anchor):]
            if "\ufffd" in text:
                text = _piece_bytes(piece) or text
            self._texts[token_id] = text
        return text

    def token_string(self, token_id: int) -> str:
        """The token's own string in the vocabulary, special tokens included ("<s>" for Llama's BOS,
        where `decode` gives ""); a normal token's raw piece ("▁the", "Ġthe"), not decoded text."""
        token_id = int(token_id)
        piece = self._token_string(token_id) if 0 <= token_id < self._n_vocab else None
        if piece is None:
            raise ModelFormatError(f"token id {token_id} is not in the tokenizer's vocabulary of {self._n_vocab}")
        return piece

    def same_as(self, other: "Tokenizer") -> bool:
        """Whether `other` maps ids to the same tokens: the same vocabulary size, BOS id and rule, EOS
        id (the first of the ids that end a generation: the one a chat template writes), and the same
        string for every id (whatever files or back end hold them: a GGUF's tokenizer and its Hugging
        Face folder's compare equal). The other ids that end a generation may differ: a GGUF's adds
        the tokens llama.cpp stops at by their text (SmolLM2's <|endoftext|>), its Hugging Face
        folder's does not, and a draft model's stop set is never used (a review)."""
        if (self._n_vocab, self.bos_id, tuple(self.eos_ids[:1]), self.add_bos) != \
                (other._n_vocab, other.bos_id, tuple(other.eos_ids[:1]), other.add_bos):
            return False
        return all(self._token_string(i) == other._token_string(i) for i in range(self._n_vocab))


def _old_tokenizers_hint() -> str:
    """"" unless the installed tokenizers library is older than 0.20, which cannot read the files 0.20
    and later write (BPE merges as pairs: stories260K's), and calls them malformed."""
    import tokenizers

    if not older_than(tokenizers.__version__, (0, 20)):
        return ""
    return f"; or tokenizers {tokenizers.__version__} is too old to read it: pip install -U 'tokenizers>=0.20'"


def check_utf8(text: str, what: str = "the text") -> None:
    """InvalidArgumentError unless `text` is valid Unicode (a lone surrogate, e.g. an undecodable byte
    of a command line, is not), naming it as `what` and the character's position in it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{what} is not valid UTF-8: character {e.start} is {text[e.start]!r} (an undecodable byte "
            f"or a lone surrogate)") from None


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_DECODER = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]  # a Llama-style tokenizer.json's decoder, less its optional last step:
_SPM_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}  # the dummy prefix's space dropped


def _byte_fallback_decode(hf, n_vocab: int, specials: set[int]):
    """A decode for a SentencePiece-style tokenizer.json (the decoder `_SPM_DECODER`, as our GGUF
    import and Hugging Face's Llama tokenizers write it) that joins the tokens' bytes and decodes
    them once, invalid bytes as U+FFFD, as SentencePiece and llama.cpp do; None for any other decoder.
    The ByteFallback decoder turns a whole run of byte tokens into U+FFFD once one byte in it is
    invalid, so a finished character in that run (and an ASCII byte before it) was lost from the text
    for good, streamed or whole. Otherwise the same text: special tokens give nothing, "\u2581" is a space."""
    import json

    try:  # the decoder's own JSON (pickle's state): parsing the whole file doubled a load's tokenizer time
        decoder = json.loads(hf.decoder.__getstate__()) if hf.decoder is not None else {}
    except (AttributeError, TypeError, ValueError):
        return None
    steps = decoder.get("decoders") if isinstance(decoder, dict) and decoder.get("type") == "Sequence" else None
    if not isinstance(steps, list) or steps[:3] != _SPM_DECODER or steps[3:] not in ([], [_SPM_STRIP]):
        return None
    strip = bool(steps[3:])
    pieces = ["" if i in specials else hf.id_to_token(i) or "" for i in range(n_vocab)]
    if any("\0" in p for p in pieces):
        return None
    # each piece's bytes, "\u2581" as a space, in one pass over all of them (0.07 s against 0.12 s piece
    # by piece for a 256k vocabulary); then the byte pieces ("<0xE4>") as their byte
    table = "\0".join(pieces).replace("\u2581", " ").encode("utf-8").split(b"\0")
    for i, piece in enumerate(pieces):
        if piece.startswith("<0x") and (byte := _BYTE_PIECE.fullmatch(piece)):
            table[i] = bytes([int(byte.group(1), 16)])

    def decode(ids: list[int]) -> str:
        text = b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        return text[1:] if strip and text.startswith(" ") else text

    return decode


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE
    vocabulary ("Ġ" for a space), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


def _piece_bytes(piece: str) -> bytes | None:
    """The bytes a token's piece stands for, when it is a byte-fallback piece ("<0xE4>") or written
    in the byte-level alphabet ("ä½"); None otherwise."""
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None

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
"""

from __future__ import annotations

import re
from pathlib import Path

from edgeinfer.errors import InvalidArgumentError, ModelFormatError
from edgeinfer.manifest import TokenizerInfo


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
            try:
                self._sp = spm.SentencePieceProcessor(model_file=str(path))
            except (RuntimeError, OSError) as e:
                raise ModelFormatError(f"tokenizer.model is corrupted ({e})") from None
            self._n_vocab = self._sp.get_piece_size()
            self._specials = {self._sp.id_to_piece(i): i for i in range(self._n_vocab)
                              if self._sp.is_control(i) and self._sp.id_to_piece(i)}
            self._special_re = re.compile("(" + "|".join(map(re.escape, sorted(self._specials, key=len,
                                                                                reverse=True))) + ")") \
                if self._specials else None
            self._encode = self._encode_sentencepiece
            self._decode = lambda ids: self._sp.decode(ids)
            self._token_string = lambda i: self._sp.id_to_piece(i)
        else:
            from tokenizers import Tokenizer as HFTokenizer

            path = folder / "tokenizer.json"
            if not path.exists():
                raise ModelFormatError(f"{folder} lacks tokenizer.json")
            try:
                self._hf = HFTokenizer.from_file(str(path))
            except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
                raise ModelFormatError(f"tokenizer.json is corrupted ({e})") from None
            self._encode = lambda text: self._hf.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: self._hf.decode(ids, skip_special_tokens=True)
            self._n_vocab = self._hf.get_vocab_size(with_added_tokens=True)
            self._token_string = lambda i: self._hf.id_to_token(i)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text` (valid Unicode: a lone surrogate, e.g. an undecodable byte of a
        command line, raises InvalidArgumentError), with BOS first when `add_bos` (default: the
        model's config)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgumentError(
                f"the text is not valid UTF-8: character {e.start} is {text[e.start]!r} (an undecodable byte "
                f"or a lone surrogate)") from None
        ids = list(self._encode(text))
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, int(self.bos_id))
        return ids

    def _encode_sentencepiece(self, text: str) -> list[int]:
        if self._special_re is None or not self._special_re.search(text):
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:  # the split keeps the matched special strings at odd indices
                ids.append(self._specials[part])
            elif part:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._decode([int(i) for i in ids])

    def token_text(self, token_id: int) -> str:
        """A token's text on its own, leading space kept ("▁the" -> " the"; byte tokens as their
        piece): what an API shows as one token of logprobs."""
        piece = self.token_string(token_id)
        return piece.replace("\u2581", " ") if self.kind == "sentencepiece" else self.decode([token_id])

    def token_string(self, token_id: int) -> str:
        """The token's own string in the vocabulary, special tokens included ("<s>" for Llama's BOS,
        where `decode` gives ""); a normal token's raw piece ("▁the", "Ġthe"), not decoded text."""
        token_id = int(token_id)
        piece = self._token_string(token_id) if 0 <= token_id < self._n_vocab else None
        if piece is None:
            raise ModelFormatError(f"token id {token_id} is not in the tokenizer's vocabulary of {self._n_vocab}")
        return piece

    def same_as(self, other: "Tokenizer") -> bool:
        """Whether `other` maps ids to the same tokens: the same vocabulary size, BOS/EOS ids and
        BOS rule, and the same string for every id (whatever files or back end hold them: a GGUF's
        tokenizer and its Hugging Face folder's compare equal)."""
        if (self._n_vocab, self.bos_id, tuple(self.eos_ids), self.add_bos) != \
                (other._n_vocab, other.bos_id, tuple(other.eos_ids), other.add_bos):
            return False
        return all(self._token_string(i) == other._token_string(i) for i in range(self._n_vocab))

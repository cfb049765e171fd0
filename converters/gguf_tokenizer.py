"""A GGUF file's tokenizer (its `tokenizer.ggml.*` metadata) rebuilt as a `tokenizers` tokenizer.json.

Two vocabulary kinds, as llama.cpp names them in `tokenizer.ggml.model`:

    llama   SentencePiece BPE: pieces with scores ("▁the"), byte pieces "<0x0A>". Rebuilt as
            Hugging Face does for Llama: a BPE model with byte fallback whose merges are every
            pair of pieces that joins into a piece, ranked by the joined piece's score; spaces
            become "▁", with one prepended when `add_space_prefix` (the default).
    gpt2    byte-level BPE with its merge list; the pre-tokenizer split follows
            `tokenizer.ggml.pre`, which names the model's regex (`PRE_TOKENIZERS`; another name is
            refused rather than guessed, since a wrong split silently changes the ids).

Control and user-defined tokens (token types 3 and 4) are added tokens, so a chat template's
"<|im_start|>" encodes to its one id. `TokenizerInfo` (BOS, EOS, add_bos, chat template) comes
from the same metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgeinfer.errors import ConvertError
from edgeinfer.manifest import TokenizerInfo

CONTROL, USER_DEFINED = 3, 4
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
          r"""\s+(?!\S)|\s+""")
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# tokenizer.ggml.pre -> (regex, digits one by one, NFC normaliser, ignore_merges)
PRE_TOKENIZERS = {"default": (_GPT2, False, False, False), "gpt2": (_GPT2, False, False, False),
                  "smollm": (_GPT2, True, False, False), "qwen2": (_QWEN2, False, True, False),
                  "llama-bpe": (_LLAMA3, False, False, True), "llama3": (_LLAMA3, False, False, True)}


def tokenizer_json(meta: dict, name: str) -> str:
    """The tokenizer.json text for a GGUF's metadata `meta` (`name`: the file's name, for errors)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, Regex

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConvertError(f"{name}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ConvertError(f"{name} metadata: {len(types)} token types for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ConvertError(f"{name} metadata: a llama (SentencePiece) vocabulary needs one score per token")
        unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types), byte_fallback=True,
                                   fuse_unk=True, unk_token=tokens[unk] if 0 <= unk < len(tokens) else None))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.normalizer = normalizers.Sequence([*([normalizers.Prepend("\u2581")] if prefix else []),
                                               normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    elif kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ConvertError(f"{name}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                               f"{', '.join(sorted(PRE_TOKENIZERS))})")
        regex, digits, nfc, ignore_merges = PRE_TOKENIZERS[pre]
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
            raise ConvertError(f"{name} metadata: a gpt2 (BPE) vocabulary needs its merges (tokenizer.ggml.merges)")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                   ignore_merges=ignore_merges))
        if nfc:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *([pre_tokenizers.Digits(individual_digits=True)] if digits else []),
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        raise ConvertError(f"{name}: GGUF tokenizer model {kind!r} is not supported (supported: llama, gpt2)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL and t])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t])
    return tok.to_str()


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal piece into two pieces, the joined
    piece's score deciding the order (higher first, then the lower id), as Hugging Face's
    SentencePiece converter ranks them."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    found = []
    for piece, pid in ids.items():
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in ids and b in ids:
                found.append((-float(scores[pid]), pid, ids[a], ids[b], a, b))
    found.sort()
    return [(a, b) for *_, a, b in found]


def tokenizer_info(meta: dict) -> TokenizerInfo:
    """BOS/EOS, add_bos and the chat template from the GGUF metadata."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id")]
    add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    template = meta.get("tokenizer.chat_template")
    return TokenizerInfo(kind="hf_tokenizers", add_bos=bool(add_bos) and bos is not None,
                         bos_token_id=int(bos) if isinstance(bos, int) else None,
                         eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if isinstance(e, int))),
                         chat_template=template if isinstance(template, str) else None)


def write_tokenizer(meta: dict, name: str, folder: Path) -> list[str]:
    """Write tokenizer.json into `folder`; returns the files written."""
    text = tokenizer_json(meta, name)
    json.loads(text)  # the library wrote valid JSON
    (Path(folder) / "tokenizer.json").write_text(text)
    return ["tokenizer.json"]

"""A GGUF file's tokenizer (its `tokenizer.ggml.*` metadata) rebuilt as a `tokenizers` tokenizer.json.

Two vocabulary kinds, as llama.cpp names them in `tokenizer.ggml.model`:

    llama   SentencePiece BPE: pieces with scores ("▁the"), byte pieces "<0x0A>". Rebuilt as
            Hugging Face does for Llama: a BPE model with byte fallback whose merges are every
            pair of pieces that joins into a piece, ranked by the joined piece's score; spaces
            become "▁", with one prepended when `add_space_prefix` (the default).
    gpt2    byte-level BPE with its merge list; the pre-tokenizer split follows
            `tokenizer.ggml.pre`, which names the model's regex (`PRE_TOKENIZERS`; another name,
            llama.cpp's fallback "default" included, is refused rather than guessed, since a wrong
            split silently changes the ids).

Every field is checked (types, lengths, ids in range, merges that join two tokens into a third, a
chat template that parses): a damaged vocabulary is a ConvertError, never the tokenizers
library's bare Exception or a folder that will not load.

Control and user-defined tokens (token types 3 and 4) are added tokens, so a chat template's
"<|im_start|>" encodes to its one id. `TokenizerInfo` (BOS, EOS, add_bos, chat template) comes
from the same metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgeinfer.errors import ConvertError
from edgeinfer.manifest import TokenizerInfo

CONTROL, USER_DEFINED = 3, 4
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
          r"""\s+(?!\S)|\s+""")
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# tokenizer.ggml.pre -> (regex, digits one by one, NFC normaliser, ignore_merges)
PRE_TOKENIZERS = {"gpt-2": (_GPT2, False, False, False), "gpt2": (_GPT2, False, False, False),
                  "smollm": (_GPT2, True, False, False), "qwen2": (_QWEN2, False, True, False),
                  "llama-bpe": (_LLAMA3, False, False, True), "llama3": (_LLAMA3, False, False, True)}


def tokenizer_json(meta: dict, name: str) -> str:
    """The tokenizer.json text for a GGUF's metadata `meta` (`name`: the file's name, for errors)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, Regex

    kind = meta.get("tokenizer.ggml.model")
    for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if k in meta and not isinstance(meta[k], str):
            raise ConvertError(f"{name} metadata: {k} must be a string, got {type(meta[k]).__name__}")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ConvertError(f"{name}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    types = _numbers(meta, "tokenizer.ggml.token_type", len(tokens), name, integer=True)
    types = [1] * len(tokens) if types is None else [int(t) for t in types]
    bad = next((i for i, t in enumerate(types) if not 0 <= t <= 6), None)
    if bad is not None:  # llama.cpp's LLAMA_TOKEN_TYPE_* (0 undefined ... 6 byte); -1 for all made no merges at all
        raise ConvertError(f"{name} metadata: tokenizer.ggml.token_type of token {bad} is {types[bad]}, not a token "
                           "type (0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)")
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for an empty token
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):  # a text twice: it would encode to one id, and the other id have no token (it
        first: dict[str, int] = {}  # decoded to "", a reply's logprobs naming it were a 500, and the vocabulary's
        for i, t in enumerate(tokens):  # last token lost its text: a hostile round; llama.cpp refuses it too)
            if t in first:
                raise ConvertError(f"{name} metadata: the token {t!r:.60} is both id {first[t]} and id {i}")
            first[t] = i
    if kind == "llama":
        scores = _numbers(meta, "tokenizer.ggml.scores", len(tokens), name)
        if scores is None:
            raise ConvertError(f"{name} metadata: a llama (SentencePiece) vocabulary needs one score per token")
        unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens), name)
        merges = _spm_merges(tokens, scores.tolist(), types, name)
        model = lambda: models.BPE(vocab=vocab, merges=merges,  # noqa: E731
                                   byte_fallback=True, fuse_unk=True, unk_token=tokens[unk if unk is not None else 0])
        prefix = _flag(meta, "tokenizer.ggml.add_space_prefix", True, name)
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Sequence([*([normalizers.Prepend("\u2581")] if prefix else []),
                                               normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    elif kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            why = (" (llama.cpp's fallback split, which we do not reproduce exactly)" if pre == "default" else "")
            raise ConvertError(f"{name}: GGUF pre-tokenizer {pre!r:.60}{why} is not supported (supported: "
                               f"{', '.join(sorted(PRE_TOKENIZERS))})")
        regex, digits, nfc, ignore_merges = PRE_TOKENIZERS[pre]
        pairs = _merges(meta.get("tokenizer.ggml.merges"), vocab, name)
        model = lambda: models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)  # noqa: E731
        tok = Tokenizer(models.BPE())
        if nfc:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *([pre_tokenizers.Digits(individual_digits=True)] if digits else []),
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        raise ConvertError(f"{name}: GGUF tokenizer model {kind!r} is not supported (supported: llama, gpt2)")
    try:
        tok.model = model()
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ConvertError(f"{name}: the GGUF's vocabulary does not make a tokenizer ({e})") from None
    except BaseException as e:  # its Rust panics (pyo3 PanicException) derive from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConvertError(f"{name}: the GGUF's vocabulary does not make a tokenizer ({e})") from None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok.to_str()


def _numbers(meta: dict, key: str, n: int, name: str, integer: bool = False):
    """A numeric array field of `n` items as numpy, None when absent; ConvertError when ill-typed."""
    v = meta.get(key)
    if v is None:
        return None
    a = np.asarray(v) if isinstance(v, (list, np.ndarray)) else None
    if a is None or a.ndim != 1 or a.dtype.kind not in ("iu" if integer else "iuf") or len(a) != n \
            or (a.dtype.kind == "f" and not np.isfinite(a).all()):
        raise ConvertError(f"{name} metadata: {key} must be {n} {'integers' if integer else 'numbers'}, one per token")
    return a


SPM_DEFAULT_IDS = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}  # llama.cpp's, for a
# SentencePiece ("llama") vocabulary whose file leaves them out


def _token_id(meta: dict, key: str, n: int, name: str) -> int | None:
    v = meta.get(key)
    if v is None and meta.get("tokenizer.ggml.model") == "llama" and key in SPM_DEFAULT_IDS:
        v = SPM_DEFAULT_IDS[key] if SPM_DEFAULT_IDS[key] < n else None  # as llama.cpp runs such a file
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise ConvertError(f"{name} metadata: {key} must be a token id below {n}, got {v!r}")
    return v


def _flag(meta: dict, key: str, default: bool, name: str) -> bool:
    v = meta.get(key, default)
    if not isinstance(v, bool):
        raise ConvertError(f"{name} metadata: {key} must be true or false, got {v!r}")
    return v


def _merges(merges, vocab: dict, name: str) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` ("a b" each) as pairs, every part and every result in the vocabulary; a
    pair listed again keeps its first rank, as llama.cpp ranks it (the tokenizers library took the
    last, so one repeated merge changed how a real vocabulary split text: a hostile round)."""
    if not isinstance(merges, list):
        raise ConvertError(f"{name} metadata: a gpt2 (BPE) vocabulary needs its merges (tokenizer.ggml.merges)")
    pairs: dict[tuple[str, str], None] = {}
    for m in merges:
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2 or not all(p in vocab for p in parts) or parts[0] + parts[1] not in vocab:
            raise ConvertError(f"{name} metadata: merge {m!r} is not two tokens of the vocabulary that join into "
                               "a third")
        pairs.setdefault((parts[0], parts[1]))
    return list(pairs)


MAX_SPM_PIECE_CHARS = 256  # SentencePiece trains pieces of at most 16 characters by default (the flag caps it)
SPM_MERGE_CHARS_PER_VOCAB_CHAR = 32  # real vocabularies: a few; the bound keeps a crafted one's cost near its size


def _spm_merges(tokens: list[str], scores: list[float], types: list[int], name: str) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal piece into two pieces, the joined
    piece's score deciding the order (higher first, then the lower id), as Hugging Face's
    SentencePiece converter ranks them. Time and memory stay in proportion to the vocabulary's size:
    a normal piece longer than MAX_SPM_PIECE_CHARS, or merges whose pieces add up to more than
    SPM_MERGE_CHARS_PER_VOCAB_CHAR times the vocabulary's characters (nested pieces z, zz, zzz, ...:
    quadratic in their count), are refused, not built (a 1.7 MB file took 3.2 GB before)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    budget = SPM_MERGE_CHARS_PER_VOCAB_CHAR * sum(map(len, ids)) + 4096
    found, spent = [], 0
    for piece, pid in ids.items():
        if len(piece) > MAX_SPM_PIECE_CHARS:
            raise ConvertError(f"{name}: SentencePiece vocabulary piece {pid} is {len(piece)} characters long; "
                               f"at most {MAX_SPM_PIECE_CHARS} are supported")
        for cut in range(1, len(piece)):
            a, b = ids.get(piece[:cut]), ids.get(piece[cut:])
            if a is not None and b is not None:
                found.append((-float(scores[pid]), pid, a, b))
                spent += len(piece)
        if spent > budget:
            raise ConvertError(f"{name}: the SentencePiece vocabulary's pieces nest into more merges than a real "
                               f"vocabulary has ({len(found)} for {len(ids)} pieces): not converted")
    found.sort()
    return [(tokens[a], tokens[b]) for *_, a, b in found]


# Tokens that end a generation by their text, whatever the metadata's ids say, as llama.cpp's vocabulary
# loader has them (llama-vocab.cpp, as vendored by llama-cpp-python 0.3.36): a file whose EOS is
# <|endoftext|> while its chat template ends each turn with <|im_end|> (an older Llama 3 Instruct's
# <|end_of_text|> and <|eot_id|>) stops at the turn's end there, and its replies ran on here.
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                           "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                           "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                           "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
# Code-completion (fill-in-the-middle) separators llama.cpp also stops at: the id its key names, else
# the token of one of these texts (Qwen2.5-Coder's <|file_sep|> between a repository's files)
FIM_STOPS = {"tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
             "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
             "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",)}


def tokenizer_info(meta: dict, name: str = "") -> TokenizerInfo:
    """BOS/EOS, add_bos and the chat template from the GGUF metadata. The ids that end a generation,
    as llama.cpp's vocabulary loader finds them: EOS, then the EOT and EOM ids, the FIM_STOPS, and
    every token whose text is in END_OF_GENERATION_TEXTS."""
    name = name or "the GGUF"
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:  # (else "bos_token_id must be a token id below 0")
        raise ConvertError(f"{name} metadata: tokenizer.ggml.tokens (the vocabulary) is missing or not a list of "
                           "strings: a GGUF without its tokenizer cannot be converted")
    n = len(tokens)
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", n, name)
    eos = [_token_id(meta, k, n, name) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                 "tokenizer.ggml.eom_token_id")]
    # llama.cpp adds BOS by default for SentencePiece vocabularies and the Llama 3 pre-tokenizer
    default_bos = meta.get("tokenizer.ggml.model") == "llama" or meta.get("tokenizer.ggml.pre") in ("llama-bpe", "llama3")
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", default_bos, name)
    if _flag(meta, "tokenizer.ggml.add_eos_token", False, name):  # llama.cpp and transformers append EOS to
        raise ConvertError(f"{name} metadata: tokenizer.ggml.add_eos_token is true: every prompt would end with "
                           "EOS, which a text generator cannot continue (an embedding model's setting): not supported")
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        if not isinstance(template, str):
            raise ConvertError(f"{name} metadata: tokenizer.chat_template must be text, got {type(template).__name__}")
        _check_template(template, name)
    for key, texts in FIM_STOPS.items():
        fim = _token_id(meta, key, n, name)
        eos.append(fim if fim is not None else next((i for i, t in enumerate(tokens) if t in texts), None))
    eos += [i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS]
    return TokenizerInfo(kind="hf_tokenizers", add_bos=add_bos and bos is not None, bos_token_id=bos,
                         eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
                         chat_template=template or None)


def _check_template(template: str, name: str) -> None:
    """The chat template compiles as the runtime will compile it (`edgeinfer.chat.compile_template`:
    its sandbox, its `{% generation %}` tag; an unknown filter fails there, not only bad syntax)."""
    from edgeinfer.chat import compile_template
    from edgeinfer.errors import ModelFormatError

    try:
        compile_template(template)
    except ModelFormatError as e:
        raise ConvertError(f"{name}: {e}") from None  # "the model's chat template does not parse: ..."


def write_tokenizer(meta: dict, name: str, folder: Path) -> list[str]:
    """Write tokenizer.json into `folder`; returns the files written."""
    (Path(folder) / "tokenizer.json").write_text(tokenizer_json(meta, name))
    return ["tokenizer.json"]

"""A Hugging Face folder's tokenizer settings, as the manifest's `tokenizer` section holds them:
which tokenizer files a folder takes over (`TOKENIZER_FILES`), its BOS and EOS ids and BOS rule, and
its chat template in any of Hugging Face's forms (`tokenizer_info`); and the check, on a finished
folder, that the tokenizer loads as `edgeinfer.load` will load it (`check_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from edgeinfer.converters.source_files import read_json, read_text
from edgeinfer.errors import ConvertError
from edgeinfer.manifest import Manifest, TokenizerInfo

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def json_object(path: Path) -> dict:
    """A source's optional JSON settings file ({} when absent); ConvertError when it is not an object."""
    if not path.exists():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise ConvertError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def chat_template(template, where: Path, log) -> str | None:
    """Hugging Face's forms of a chat template: text, or a list of {"name", "template"} of which
    apply_chat_template uses the one named "default" (none: no template, said in the log). One that
    does not parse is kept and said in the log: chat refuses it when used, completion still works."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            log(f"note: {where} lists chat templates {sorted(map(str, named))} but none named 'default': the "
                "folder gets none (chat renders plain 'User: ...' lines)")
            return None
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ConvertError(f"{where}: chat_template must be text or a list of named templates, "
                           f"got {type(template).__name__}")
    if template:
        from edgeinfer.chat import compile_template
        from edgeinfer.errors import ModelFormatError

        try:
            compile_template(template)
        except ModelFormatError as e:
            log(f"note: {where}: {e}; kept as it is, chat will refuse it")
    return template or None


def tokenizer_info(src: Path, spec, log=lambda msg: None) -> TokenizerInfo:
    cfg_path = src / "tokenizer_config.json"
    cfg = json_object(cfg_path)
    gen_path = src / "generation_config.json"
    gen = json_object(gen_path)
    template, where = cfg.get("chat_template"), cfg_path
    if (src / "chat_template.jinja").exists():
        template, where = read_text(src / "chat_template.jinja"), src / "chat_template.jinja"
    template = chat_template(template, where, log)
    # tokenizer.json first, as transformers loads a folder: a fine-tune's added tokens (ChatML's markers on
    # a Llama or Mistral) and the rule for the space marker after a control token (Mistral v0.3's Metaspace
    # "first") are there, not in tokenizer.model
    kind = "hf_tokenizers" if (src / "tokenizer.json").exists() or not (src / "tokenizer.model").exists() \
        else "sentencepiece"
    # (generation_config's null: not given there, config.json's then; a review)
    eos = gen.get("eos_token_id") if gen.get("eos_token_id") is not None else list(spec.eos_token_ids)
    eos = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    bos = gen.get("bos_token_id") if gen.get("bos_token_id") is not None else spec.bos_token_id

    def token_id(v) -> bool:
        return type(v) is int and 0 <= v < spec.vocab_size

    if not all(map(token_id, eos)) or not (bos is None or token_id(bos)):
        raise ConvertError(f"{gen_path if gen else src / 'config.json'}: bos_token_id {bos!r} and eos_token_id "
                           f"{eos!r} must be token ids in [0, {spec.vocab_size})")
    if bos is None or not eos:  # neither config names them: the tokenizer's own, as transformers' tokenizer takes
        # them (a config without them converted with no BOS before prompts and nothing to stop at; a hostile round)
        for key in (("bos_token",) if bos is None else ()) + (("eos_token",) if not eos else ()):
            name, found = _named_token(src, cfg, key)
            if found is None or not token_id(found):
                continue
            log(f"note: neither config.json nor generation_config.json gives {key}_id: took {name!r} (id {found}), "
                f"the tokenizer's {key}")
            bos, eos = (found, eos) if key == "bos_token" else (bos, [found])
    add_bos = cfg.get("add_bos_token")
    if add_bos is None:  # a SentencePiece family (tokenizer.model there: Llama 2, Mistral, Gemma) adds it, as it
        # was trained and as llama.cpp runs it (transformers 5.24 adds none there); otherwise as tokenizer.json's
        # post-processor says
        add_bos = (src / "tokenizer.model").exists() or _post_processor_adds(src / "tokenizer.json", bos)
    if not isinstance(add_bos, bool):  # "false" read as true (any non-empty string did)
        raise ConvertError(f"{cfg_path}: add_bos_token must be true or false, got {add_bos!r:.40}")
    add_eos = cfg.get("add_eos_token")
    if not isinstance(add_eos, bool | None):
        raise ConvertError(f"{cfg_path}: add_eos_token must be true or false, got {add_eos!r:.40}")
    if add_eos:  # a fine-tuning recipe's setting that save_pretrained kept: transformers' encode() then ends
        # every prompt with EOS, its chat templates (add_special_tokens=False) do not, and neither does the runtime
        log(f"note: {cfg_path.name} sets add_eos_token (a training setting): prompts are not ended with EOS here, "
            "as transformers' chat templates do not end them")
    return TokenizerInfo(kind=kind, add_bos=add_bos, bos_token_id=bos, eos_token_ids=tuple(eos),
                         chat_template=template)


def _named_token(src: Path, cfg: dict, key: str) -> tuple[str | None, int | None]:
    """tokenizer_config.json's `key` ("bos_token", "eos_token": text, or an object with its "content"),
    else special_tokens_map.json's (older checkpoints keep them only there, and transformers reads it),
    and its id in the tokenizer (tokenizer.json's added tokens, then its vocabulary; else
    tokenizer.model's pieces); (name, None) where it names no token there."""
    name = cfg.get(key)
    if name is None and (src / "special_tokens_map.json").exists():
        name = json_object(src / "special_tokens_map.json").get(key)
    name = name.get("content") if isinstance(name, dict) else name
    if not isinstance(name, str) or not name:
        return None, None
    if (src / "tokenizer.json").exists():
        tj = json_object(src / "tokenizer.json")
        for t in tj.get("added_tokens") if isinstance(tj.get("added_tokens"), list) else []:
            if isinstance(t, dict) and t.get("content") == name and type(t.get("id")) is int:
                return name, t["id"]
        model = tj.get("model") if isinstance(tj.get("model"), dict) else {}
        vocab = model.get("vocab")
        found = vocab.get(name) if isinstance(vocab, dict) else None
        return name, found if type(found) is int else None
    try:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
        found = sp.piece_to_id(name)
        return name, found if sp.id_to_piece(found) == name else None
    except (OSError, RuntimeError):  # a damaged file: refused, in its own words, by `check_tokenizer`
        return name, None


def _post_processor_adds(path: Path, bos: int | None) -> bool:
    """Whether tokenizer.json's post-processor puts BOS (`bos`, an id) before a text, as transformers
    then encodes a prompt (Llama 3's tokenizer_config has no add_bos_token: its TemplateProcessing,
    inside a Sequence, adds <|begin_of_text|>)."""
    if bos is None or not path.exists():
        return False
    tj = json_object(path)

    def obj(v) -> dict:  # the file's shapes are not trusted: anything else reads as absent
        return v if isinstance(v, dict) else {}

    def items(v) -> list:
        return v if isinstance(v, list) else []

    added = {t["content"]: t.get("id") for t in map(obj, items(tj.get("added_tokens")))
             if isinstance(t.get("content"), str)}
    procs = [tj.get("post_processor")]
    while procs:
        p = obj(procs.pop())
        if p.get("type") == "Sequence":
            procs += items(p.get("processors"))
        elif p.get("type") == "TemplateProcessing":
            first = (items(p.get("single")) or [None])[0]
            name = obj(obj(first).get("SpecialToken")).get("id")
            if not isinstance(name, str):
                return False
            ids = items(obj(obj(p.get("special_tokens")).get(name)).get("ids"))
            return bos in ids or added.get(name) == bos
    return False


def check_tokenizer(folder: Path, manifest: Manifest, log=lambda msg: None) -> None:
    """The folder's tokenizer loads and knows its BOS and EOS ids, as `edgeinfer.load` will need:
    a source whose tokenizer files are corrupt is refused here, not after a successful convert."""
    check_tokenizer_info(folder, manifest.tokenizer, manifest.arch.vocab_size, log)


def check_tokenizer_info(folder: Path, info: TokenizerInfo, vocab_size: int, log=lambda msg: None) -> None:
    """`check_tokenizer` before a manifest exists (`--via optimum` checks the source's, before its export)."""
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.tokenizer import Tokenizer

    try:
        tok = Tokenizer(folder, info)
        for t in [info.bos_token_id, *info.eos_token_ids]:
            if t is not None:
                tok.token_string(t)
    except EdgeInferError as e:
        raise ConvertError(f"the source's tokenizer cannot be used: {e}") from None
    if tok.id_limit > vocab_size:  # as transformers loads it: a prompt holding such a token is refused
        log(f"note: the tokenizer gives ids up to {tok.id_limit - 1}, past the model's {vocab_size} "
            "embedding rows: a prompt holding such a token will be refused")

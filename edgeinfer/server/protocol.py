"""OpenAI's HTTP JSON requests -> edgeinfer's types, for the OpenAI-compatible daemon. Pure functions, no I/O.

Requests: `parse_chat` / `parse_completion` take a decoded JSON body and return a frozen request whose
`options` come from `GenerationOptions.from_kwargs`, or raise `APIError` (an HTTP status and OpenAI's
error body). Every bad field is a 400 whose `param` names it. A null optional field counts as absent
(OpenAI's schema makes them nullable); an absent sampling field takes edgeinfer's default. Unknown
fields are ignored (OpenAI's newer ones, a client's own), unless the name is a near miss of one this
server reads (`max_token`, `temprature`: a 400 that names the field meant, where the typo was served
with the default), and except `tools` / `functions` / `tool_choice` / `function_call` /
`response_format` / `modalities` / `audio` and, on completions, `echo`, `best_of` and `suffix`: each
is refused unless it asks for what this server does anyway (no tools, plain text, no echo), so a
client that relies on them does not get something else silently; nor is the other endpoint's
`prompt`, `messages`, `max_completion_tokens`, `top_logprobs`, `chat_template_kwargs`, `echo`,
`best_of` or `suffix` ignored when it asks for something (a 400 names where it belongs). Chat reads
`chat_template_kwargs` too (vLLM's and llama.cpp's name): more variables for the chat template.

Responses are built in `replies`.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass

from edgeinfer.chat import check_variables
from edgeinfer.errors import InvalidArgumentError, shown
from edgeinfer.options import GenerationOptions
from edgeinfer.sampling.params import INT32_MAX, MIN_TEMPERATURE, PENALTY_LIMIT

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs
MAX_LEGACY_LOGPROBS = 5  # completions' logprobs
# fields this server does not implement -> the values that ask for nothing it does not do anyway (no
# tools, so a tool choice of "auto" calls none; plain text)
UNSUPPORTED = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
               "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
               "modalities": (None, ["text"]), "audio": (None,)}
UNSUPPORTED_COMPLETION = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}
# the other endpoint's fields -> (where each belongs, its values that ask for nothing): sent here asking for
# something, each is a 400 naming where it belongs (ignored, max_completion_tokens on /v1/completions let a
# reply run to the server's limit, and top_logprobs or echo gave a reply without what they ask for)
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_NOR_THERE = _COMPLETIONS + " (where this server does not support it either)"
OTHER_ENDPOINT = {"chat": {"prompt": (_COMPLETIONS, (None,)), "echo": (_NOR_THERE, (None, False)),
                           "best_of": (_NOR_THERE, (None, 1)), "suffix": (_NOR_THERE, (None, ""))},
                  "completion": {"messages": (_CHAT, (None,)),
                                 "max_completion_tokens": (_CHAT + " (here: max_tokens)", (None,)),
                                 "top_logprobs": (_CHAT + " (here: logprobs, a number)", (None, 0)),
                                 "chat_template_kwargs": (_CHAT, (None, {}))}}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# (field, test, range in words): numbers passed through to the sampler once checked
_NUMBERS = (
    ("temperature", lambda v: 0 <= v <= 2, "in [0, 2]"),  # below MIN_TEMPERATURE: greedy, as 0 (`_options`)
    ("top_p", lambda v: 0 <= v <= 1, "in [0, 1]"),  # 0: the most likely token alone (top_k 1), as OpenAI allows
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("typical_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("repetition_penalty", lambda v: 1 / PENALTY_LIMIT <= v <= PENALTY_LIMIT,
     f"in [{1 / PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]"),
)

# the fields each endpoint reads (a near miss of one is taken for a typo: `_refuse_near_misses`)
READ_COMMON = ("model", "n", "stream", "stream_options", "stop", "seed", "logit_bias", "top_k", "ignore_eos",
               *(name for name, _, _ in _NUMBERS), *UNSUPPORTED)
READ_CHAT = frozenset(READ_COMMON + ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                                     "chat_template_kwargs"))
READ_COMPLETION = frozenset(READ_COMMON + ("prompt", "max_tokens", "logprobs", *UNSUPPORTED_COMPLETION))
NEAR_MISS = 0.85  # difflib's ratio: one letter off in a name of 6 or more


class APIError(Exception):
    """An OpenAI-shaped error: HTTP status + body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None):
        """retry_after_s: sent as the Retry-After header (429 defaults to 1 s)."""
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after_s = retry_after_s if retry_after_s is not None else (1 if status == 429 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked /v1/chat/completions request. `messages`: {"role": "system"|"user"|"assistant",
    "content": str} dicts (text parts joined, "developer" -> "system"), as `chat.check_messages` wants.
    `top_logprobs` is 0 unless `logprobs`. `template_variables`: the body's `chat_template_kwargs`
    (vLLM's and llama.cpp's name; Qwen3's {"enable_thinking": false}), checked by `chat.check_variables`."""

    model: str
    messages: tuple[dict, ...]
    options: GenerationOptions
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    template_variables: dict | None = None


@dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions request. `prompt`: text, or token ids (>= 0; the vocabulary bound is
    checked when generating). `logprobs`: how many top logprobs per token (0..5), None = off."""

    model: str
    prompt: str | tuple[int, ...]
    options: GenerationOptions
    stream: bool
    include_usage: bool
    logprobs: int | None


# ---- requests -------------------------------------------------------------------------------------

def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _number(body: dict, name: str, ok, words: str):
    """body[name] (an int or float a float holds, not NaN or inf, not a bool) for which ok() holds;
    None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= sys.float_info.max:
        raise _bad(name, f"{name} must be a number {words}, got {shown(v)}")
    if not ok(v):
        raise _bad(name, f"{name} must be {words}, got {shown(v)}")
    return v


def _integer(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """body[name] as a JSON integer (not a float, not a bool) in [lo, hi]; None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    bounds = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
    if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, f"{name} must be an integer{bounds}, got {shown(v)}")
    return v


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise _bad(name, f"{name} must be true or false, got {shown(v)}")
    return v


def _common(body, model_id: str) -> None:
    """The checks both endpoints share: a JSON object, the served model, no unsupported feature, n=1."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", f"model is required and must be a string, got {shown(model)}")
    if model != model_id:
        raise APIError(404, f"The model {shown(model)} does not exist", param="model", code="model_not_found")
    _refuse_unsupported(body, UNSUPPORTED)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise _bad("n", f"only n=1 is supported, got n={shown(n)}")


def _refuse_near_misses(body: dict, read: frozenset) -> None:
    """A 400 for an unknown field whose name is one letter or so from a field this endpoint reads."""
    for name in body:
        if isinstance(name, str) and name not in read:
            meant = difflib.get_close_matches(name, read, n=1, cutoff=NEAR_MISS)
            if meant:
                raise _bad(name, f"unknown field {name[:100]!r}: did you mean {meant[0]!r}? (other unknown fields "
                                 "are ignored; one this close to a known one is taken for a typo)")


def _refuse_other_endpoint(body: dict, endpoint: str) -> None:
    for name, (where, harmless) in OTHER_ENDPOINT[endpoint].items():
        if not _harmless(body.get(name), harmless):
            raise _bad(name, f"{name} belongs to {where}")


def _harmless(value, harmless: tuple) -> bool:
    """`value` is one of `harmless`, compared with their types (1 is not True, [] is not {})."""
    return any(value is h or (type(value) is type(h) and value == h) for h in harmless)


def _refuse_unsupported(body: dict, unsupported: dict) -> None:
    """A 400 naming the first field in `unsupported` whose value asks for more than its harmless
    values (compared with their types: 1 is not True, [] is not {})."""
    for name, harmless in unsupported.items():
        value = body.get(name)
        if not _harmless(value, harmless):
            raise _bad(name, f"{name}={shown(value)} is not supported by this server")


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options is allowed only with stream true."""
    stream = bool(_bool(body, "stream"))
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    include_usage = so.get("include_usage") if isinstance(so, dict) else "not an object"
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _bad("stream_options", f"stream_options must be {{'include_usage': true|false}}, got {shown(so)}")
    return True, bool(include_usage)


def _max_tokens(body: dict, names: tuple[str, ...], limit: int) -> tuple[int, str]:
    """(value, field it came from): each of `names` present is checked; two present must agree (OpenAI
    refuses both at once; a client that sends the same number twice is served); none present -> the
    server's limit."""
    given = {}
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if type(v) is not int or not 1 <= v <= limit:
            raise _bad(name, f"{name} must be an integer in [1, {limit}] (this server's limit), got {shown(v)}")
        given[name] = v
    if len(set(given.values())) > 1:
        (a, va), (b, vb) = list(given.items())[:2]
        raise APIError(400, f"{a} ({va}) and {b} ({vb}) differ: set one of them", param=a,
                       code="invalid_parameter_combination")
    if not given:
        return limit, names[-1]
    name = next(reversed(given))  # (they agree)
    return given[name], name


def _stop(body: dict) -> tuple[str, ...] | None:
    v = body.get("stop")
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOP} of them, got {shown(v)}")
    return tuple(stops)


def _logit_bias(body: dict) -> dict[int, float] | None:
    """{"token id": bias in [-100, 100]} -> {id: bias}; ids above the sampler's range are refused by
    SamplingParams (still a 400 naming logit_bias), ids past the vocabulary when generating."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("logit_bias", f"logit_bias must be an object of token id -> bias, got {shown(v)}")
    out = {}
    for k, b in v.items():
        if not isinstance(k, str) or not (k.isascii() and k.isdecimal()) or len(k) > 10:
            raise _bad("logit_bias", f"logit_bias keys must be token ids (decimal strings), got {shown(k)}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad("logit_bias", f"logit_bias[{k}] must be a number in [-100, 100], got {shown(b)}")
        out[int(k)] = float(b)
    return out


def _options(body: dict, max_names: tuple[str, ...], limit: int) -> GenerationOptions:
    """GenerationOptions from the body's sampling fields; only the fields present are passed, so
    from_kwargs supplies the defaults. Its InvalidArgumentError becomes a 400."""
    max_new_tokens, max_source = _max_tokens(body, max_names, limit)
    kw, source = {"max_new_tokens": max_new_tokens}, {"max_new_tokens": max_source}
    for name, ok, words in _NUMBERS:
        kw[name] = _number(body, name, ok, words)
    kw["top_k"] = _integer(body, "top_k", 0, INT32_MAX)
    kw["seed"] = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)  # 64 bits, signed or not (the API masks any int)
    kw["stop"] = _stop(body)
    kw["logit_bias"] = _logit_bias(body)
    kw["ignore_eos"] = _bool(body, "ignore_eos")
    if kw["temperature"] is not None and 0 < kw["temperature"] < MIN_TEMPERATURE:  # OpenAI allows it; the sampler
        kw["temperature"] = 0.0  # refuses it (logits / 1e-310 overflow), and its limit is the argmax: greedy
    if kw["top_p"] == 0:  # the nucleus of no probability: the most likely token alone
        kw["top_p"], kw["top_k"] = 1.0, 1
    if kw["presence_penalty"] or kw["frequency_penalty"]:  # OpenAI's rule: the ids this reply sampled, all of them
        if kw["repetition_penalty"] not in (None, 1):  # (one window serves the three: it counts the prompt too)
            raise APIError(400, "repetition_penalty counts the prompt's tokens and frequency_penalty / "
                                "presence_penalty only the reply's (OpenAI's rule): send one kind",
                           param="repetition_penalty", code="invalid_parameter_combination")
        kw["penalize_prompt"], kw["penalty_last_n"] = False, max_new_tokens
    kw = {k: v for k, v in kw.items() if v is not None}
    try:
        return GenerationOptions.from_kwargs(**kw)
    except InvalidArgumentError as e:  # messages start with the option's name ("logit_bias[3] must ...")
        name = str(e).split(" ", 1)[0].split("[", 1)[0]
        raise APIError(400, str(e), param=source.get(name, name if name in kw else None)) from None


def _content(m: dict, i: int) -> str:
    """A message's text. An assistant turn that refused (OpenAI's `refusal`: content null and the refusal's
    text beside it, or a content part of type "refusal") is that text, as the model said it; a client
    replaying such a history got a 400 that blamed the content."""
    c, assistant = m.get("content"), m.get("role") == "assistant"
    if c in (None, "") and assistant and isinstance(m.get("refusal"), str):  # ("": clients that turn null into it)
        return m["refusal"]
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise _bad("messages", f"messages[{i}].content must be a string or a list of text parts, got {shown(c)}")
    texts = []
    for j, part in enumerate(c):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" and assistant else "text"
        if kind != key:
            raise _bad("messages", f"messages[{i}].content[{j}] has type {shown(kind)}: only text parts are supported")
        if not isinstance(part.get(key), str):
            raise _bad("messages", f"messages[{i}].content[{j}].{key} must be a string, got {shown(part.get(key))}")
        texts.append(part[key])
    return "".join(texts)


def _messages(body: dict) -> tuple[dict, ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", f"messages must be a non-empty list of message objects, got {shown(msgs)}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad("messages", f"messages[{i}] must be an object, got {shown(m)}")
        role = m.get("role")
        if role is None:
            raise _bad("messages", f"messages[{i}] has no role (one of {', '.join(ROLES)})")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad("messages", f"messages[{i}].role {shown(role)} is not supported "
                                   f"(supported: {', '.join(ROLES)}; this server has no tool calling)")
        for key in ("tool_calls", "function_call"):  # an assistant turn that called tools: dropped, the history
            if m.get(key) not in (None, []):  # the model sees would lie; with content null, the error blamed it
                raise _bad("messages", f"messages[{i}].{key}: this server has no tool calling")
        out.append({"role": ROLES[role], "content": _content(m, i)})
    return tuple(out)


def parse_chat(body, *, model_id: str, max_tokens_limit: int) -> ChatRequest:
    """A /v1/chat/completions body -> ChatRequest, or APIError (400 naming the field; 404 for another
    model). max_tokens and max_completion_tokens are one limit (both given: equal); checked against
    `max_tokens_limit`, which is also the default."""
    _common(body, model_id)
    _refuse_other_endpoint(body, "chat")
    _refuse_near_misses(body, READ_CHAT)
    messages = _messages(body)
    options = _options(body, ("max_tokens", "max_completion_tokens"), max_tokens_limit)
    logprobs = bool(_bool(body, "logprobs"))
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _bad("top_logprobs", "top_logprobs is only allowed when logprobs is true")
    stream, include_usage = _stream(body)
    variables = body.get("chat_template_kwargs")
    try:
        variables = check_variables(variables) or None
    except InvalidArgumentError as e:
        raise _bad("chat_template_kwargs", f"chat_template_kwargs: {e}") from None
    return ChatRequest(model=model_id, messages=messages, options=options, stream=stream,
                       include_usage=include_usage, logprobs=logprobs, top_logprobs=top or 0,
                       template_variables=variables)


def _prompt(body: dict) -> str | tuple[int, ...]:
    """One prompt: a string or a list of token ids, each alone or as a batch of one (OpenAI's
    `["text"]` and `[[1, 2, 3]]`; a batch of several is refused: one choice per request)."""
    sent = p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p):
        return tuple(p)
    raise _bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids (integers >= 0), "
                         f"alone or as a list of exactly one, got {shown(sent)}")


def parse_completion(body, *, model_id: str, max_tokens_limit: int) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest, or APIError (400 naming the field; 404 for
    another model). max_tokens is checked against `max_tokens_limit`, which is also the default."""
    _common(body, model_id)
    _refuse_other_endpoint(body, "completion")
    _refuse_near_misses(body, READ_COMPLETION)
    _refuse_unsupported(body, UNSUPPORTED_COMPLETION)
    prompt = _prompt(body)
    options = _options(body, ("max_tokens",), max_tokens_limit)
    logprobs = _integer(body, "logprobs", 0, MAX_LEGACY_LOGPROBS)
    stream, include_usage = _stream(body)
    return CompletionRequest(model=model_id, prompt=prompt, options=options, stream=stream,
                             include_usage=include_usage, logprobs=logprobs)


__all__ = ["APIError", "ChatRequest", "CompletionRequest", "parse_chat", "parse_completion"]

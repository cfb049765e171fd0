"""edgeinfer's results -> OpenAI's HTTP JSON objects, for the OpenAI-compatible daemon: pure builders,
and two small per-reply helpers (`TextOffsets`, `LogprobGate`).

The builders return dicts shaped field for field like OpenAI's objects (they validate as the official
`openai` client's types). A finish reason may be edgeinfer's ("eos", "stop", "length") or OpenAI's; a
logprob below -9999.0 (or -inf, which JSON cannot carry) is sent as -9999.0, OpenAI's value for
"very unlikely". Requests are parsed in `protocol`.
"""

from __future__ import annotations

from collections import deque

MIN_LOGPROB = -9999.0
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
OWNED_BY = "edgeinfer"


def finish_reason(edgeinfer_reason: str) -> str:
    """"eos" -> "stop", "stop" -> "stop", "length" -> "length"; anything else is a bug (ValueError)."""
    if edgeinfer_reason not in FINISH:
        raise ValueError(f"unknown finish reason {edgeinfer_reason!r}")
    return FINISH[edgeinfer_reason]


_finish = finish_reason  # the builders' keyword argument `finish_reason` shadows the function


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, dropped_tokens: int = 0) -> dict:
    """OpenAI's usage object, plus edgeinfer's `dropped_tokens` (prompt tokens truncated and tokens
    the ring forgot), an extra field clients keep."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}, "dropped_tokens": dropped_tokens}


def _logprob(v: float) -> float:
    return float(v) if v >= MIN_LOGPROB else MIN_LOGPROB  # also NaN -> MIN_LOGPROB


def _entry(token: str | bytes, logprob: float) -> dict:
    if isinstance(token, bytes):  # a byte token that is not whole UTF-8: its bytes are exact, its text is not
        return {"token": token.decode("utf-8", errors="replace"), "logprob": _logprob(logprob), "bytes": list(token)}
    return {"token": token, "logprob": _logprob(logprob), "bytes": list(token.encode("utf-8"))}


def token_logprob(token_text: str | bytes, logprob: float, top: list[tuple[str | bytes, float]]) -> dict:
    """Chat's per-token logprob {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}. A token may be given as bytes (a piece of a UTF-8 character): "bytes" keeps them exact."""
    return {**_entry(token_text, logprob), "top_logprobs": [_entry(t, lp) for t, lp in top]}


class LogprobGate:
    """Logprob entries released in step with the reply's text, so that their tokens join to it: an
    entry waits while the text its token added (`Chunk.piece`) runs past the text sent so far (text
    held back for a stop string that may follow), and a token whose bytes the detokenizer still holds
    (no piece yet, its bytes a character's start) waits for the later piece that lets them out. At the
    end all that waits goes out, except at a stop string, where the token that runs into it keeps only
    its part before it and the later ones (the stop string's) are dropped. Counted in UTF-8 bytes of
    the pieces, which is the reply's text whatever the tokens' own texts are (a first token's dropped
    space, a prompt ending mid-character)."""

    def __init__(self):
        self.pending: deque[tuple[dict | None, str]] = deque()  # (entry or None, its token's piece)
        self.text_bytes = 0  # of the reply's text sent so far
        self.sent_bytes = 0  # of the pieces released so far

    def feed(self, text: str, entry: dict | None, piece: str) -> list[dict]:
        """The entries that may go out with `text` (the next piece of the reply) now."""
        self.text_bytes += len(text.encode("utf-8"))
        self.pending.append((entry, piece))
        out = []
        while self.pending:
            e, released = self.pending[0]
            if released or not _holds_bytes(e):  # its text (maybe none) waits while it runs past what is sent
                ready = self.sent_bytes + len(released.encode("utf-8")) <= self.text_bytes
            else:  # bytes held: out with the first later piece that has text, once that piece is
                later = next((p for _, p in self.pending if p), None)
                ready = later is not None and self.sent_bytes + len(later.encode("utf-8")) <= self.text_bytes
            if not ready:
                break
            self.pending.popleft()
            self.sent_bytes += len(released.encode("utf-8"))
            if e is not None:
                out.append(e)
        return out

    def finish(self, stopped: bool) -> list[dict]:
        """What still waits, at the end of the reply (`stopped`: it ended on a stop string).

        At a stop string the first waiting token with text (the one that runs into it) and the tokens
        whose bytes wait for its piece (held bytes, before it) share out the reply's text left
        (`room`): the bytes of theirs that make whole characters within it go out, in order, a token
        cut where the text ends; the rest is the stop string's and is dropped."""
        waiting, self.pending = list(self.pending), deque()
        if not stopped:
            return [e for e, _ in waiting if e is not None]
        group = []  # (entry, its bytes): held entries, then the one whose piece lets them out
        for e, piece in waiting:
            if not piece:
                if e is not None:
                    group.append((e, bytes(e["bytes"])))
                continue
            if e is not None:  # after held bytes its token's own bytes, else its piece (a first token's space dropped)
                group.append((e, bytes(e["bytes"]) if any(b for _, b in group) else piece.encode("utf-8")))
            break
        end = _whole_text_within(b"".join(b for _, b in group), self.text_bytes - self.sent_bytes)
        out, at = [], 0
        for e, own in group:
            take = own[:max(0, end - at)]
            if take == own and (own or at < end):
                out.append(e)
            elif take:
                out.append({**e, "token": take.decode("utf-8", errors="replace"), "bytes": list(take)})
            at += len(own)
        return out


def _whole_text_within(data: bytes, room: int) -> int:
    """The longest prefix of `data` that decodes on its own to text of at most `room` UTF-8 bytes and
    leaves no character split (decoding it and the rest apart gives the whole's text)."""
    whole, best = data.decode("utf-8", errors="replace"), 0
    for j in range(1, len(data) + 1):
        head = data[:j].decode("utf-8", errors="replace")
        if head + data[j:].decode("utf-8", errors="replace") == whole:  # (a split character's U+FFFD may be
            if len(head.encode("utf-8")) > room:  # longer than the character: room is checked at whole ones)
                break
            best = j
    return best


def _holds_bytes(entry: dict | None) -> bool:
    """A token's entry whose token has bytes of its own (not a special token's empty text)."""
    return entry is not None and bool(entry.get("bytes"))


class TextOffsets:
    """Legacy completions' `text_offset`, token after token, across the chunks of a reply: each
    token's character offset in prompt + text. A token that is a piece of a character (its "bytes"
    not whole UTF-8) has that character's offset, and the character counts once, after its last
    piece (the pieces pending may end one chunk and go on in the next)."""

    def __init__(self, start: int):
        self.next, self.pending = start, b""

    def take(self, entry: dict) -> int:
        """The offset of `entry` (a `token_logprob` dict); moves past its text. Bytes that never make a
        character count as the decode shows them (U+FFFD), once the next bytes show they never will:
        a lone lead byte's U+FFFD comes before the token after it."""
        new = bytes(entry["bytes"])
        if self.pending and not _continues(self.pending, new):  # the character begun before is never made
            self.next, self.pending = self.next + len(self.pending.decode("utf-8", errors="replace")), b""
        at = self.next
        final, self.pending = _incomplete_end(self.pending + new)
        self.next += len(final.decode("utf-8", errors="replace"))
        return at


def _continues(pending: bytes, new: bytes) -> bool:
    """Whether `new` goes on with the character whose first bytes are `pending` (or ends it whole)."""
    try:
        (pending + new).decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start > 0 or e.reason == "unexpected end of data"
    return True


def _incomplete_end(data: bytes) -> tuple[bytes, bytes]:
    """`data` split before a character's first bytes at its end (at most 3, more may complete it)."""
    for k in (3, 2, 1):
        if len(data) < k:
            continue
        try:
            data[-k:].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data" and e.start == 0:
                return data[:-k], data[-k:]
    return data, b""


def completion_logprobs(entries: list[dict], *, text_offset: "int | TextOffsets") -> dict:
    """Legacy completions' logprobs {"tokens", "token_logprobs", "top_logprobs", "text_offset"} from
    `token_logprob` dicts; `text_offset`: the first token's character offset (the prompt's length),
    or a stream's `TextOffsets`, which goes on from chunk to chunk. Each `top_logprobs` dict holds
    the sampled token under its text as `tokens` gives it (OpenAI's reference: "the API will always
    return the logprob of the sampled token, so there may be up to logprobs+1 elements"); other
    tokens with the same text keep the first's logprob."""
    offsets = text_offset if isinstance(text_offset, TextOffsets) else TextOffsets(text_offset)
    tops = []
    for e in entries:
        top = {}
        for t in e["top_logprobs"]:
            top.setdefault(t["token"], t["logprob"])
        top[e["token"]] = e["logprob"]  # the sampled one, whatever shares its text (byte tokens) or
        tops.append(top)  # whatever its piece is here (a first token without its space, a cut at a stop)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": [offsets.take(e) for e in entries]}


def _chat_logprobs(entries: list[dict] | None) -> dict | None:
    return None if entries is None else {"content": list(entries), "refusal": None}


def _head(id: str, obj: str, created: int, model: str) -> dict:
    return {"id": id, "object": obj, "created": created, "model": model, "system_fingerprint": None}


def _usage_only(chunk: dict, usage: dict, leftovers: tuple) -> dict:
    """The last chunk of a stream with include_usage: choices [] and the usage."""
    if any(x not in (None, "", {}) for x in leftovers):
        raise ValueError("a usage chunk carries no choice: send the delta / finish_reason in the chunk before")
    return {**chunk, "choices": [], "usage": usage}


def chat_response(*, id: str, created: int, model: str, text: str, finish_reason: str, usage: dict,
                  logprobs: list[dict] | None = None) -> dict:
    """A chat.completion; `logprobs`: `token_logprob` dicts (None when not requested)."""
    return {**_head(id, "chat.completion", created, model),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": _chat_logprobs(logprobs), "finish_reason": _finish(finish_reason)}],
            "usage": usage}


def chat_chunk(*, id: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               logprobs: list[dict] | None = None, usage: dict | None = None) -> dict:
    """A chat.completion.chunk. With `usage`: the usage-only final chunk (choices []), and then `delta`
    must be {} and finish_reason / logprobs None (ValueError otherwise)."""
    chunk = _head(id, "chat.completion.chunk", created, model)
    if usage is not None:
        return _usage_only(chunk, usage, (delta, finish_reason, logprobs))
    reason = None if finish_reason is None else _finish(finish_reason)
    return {**chunk, "choices": [{"index": 0, "delta": dict(delta), "logprobs": _chat_logprobs(logprobs),
                                  "finish_reason": reason}]}


def completion_response(*, id: str, created: int, model: str, text: str, finish_reason: str, usage: dict,
                        logprobs: dict | None = None) -> dict:
    """A text_completion; `logprobs`: the legacy dict (`completion_logprobs`), None when not requested."""
    return {**_head(id, "text_completion", created, model),
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": _finish(finish_reason)}],
            "usage": usage}


def completion_chunk(*, id: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None, usage: dict | None = None) -> dict:
    """A streamed text_completion (same object as the response; finish_reason null until the last).
    With `usage`: the usage-only final chunk (choices []), and then `text` must be ""."""
    chunk = _head(id, "text_completion", created, model)
    if usage is not None:
        return _usage_only(chunk, usage, (text, finish_reason, logprobs))
    reason = None if finish_reason is None else _finish(finish_reason)
    return {**chunk, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}]}


def model_card(model_id: str, created: int) -> dict:
    """GET /v1/models/{id}: one model's object."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}


def models_list(model_id: str, created: int) -> dict:
    """GET /v1/models: the one served model."""
    return {"object": "list", "data": [model_card(model_id, created)]}


__all__ = ["LogprobGate", "TextOffsets", "chat_chunk", "chat_response", "completion_chunk", "completion_logprobs",
           "completion_response", "finish_reason", "model_card", "models_list", "token_logprob", "usage"]

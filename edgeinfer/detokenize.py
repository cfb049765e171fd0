"""Text out of tokens, as they come: `Detokenizer` (incremental decode) and `StopFilter` (stop strings).

Both own their state for one request and take one piece at a time; neither allocates per token
beyond the text it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from edgeinfer.tokenizer import Tokenizer


class Detokenizer:
    """Incremental decode of generated tokens, seeded with the prompt's last ids as left context.

    Contract: the texts `add` returns, joined, are exactly what the generated ids add after the
    context: decode(context + ids) minus its prefix decode(context). So the first token keeps its
    leading space (decoders drop a leading space at the start of a decode: "▁time" alone is "time",
    after "Once upon a" it is " time"). With no context, they join to decode(ids). Each call decodes
    the new tokens with a little left context (the last emitted tokens), and holds text back while
    it ends in an incomplete UTF-8 character. A context that ends inside a character (a prompt of
    ids cut mid-character) has that character's text come with the first token that completes it.
    """

    CONTEXT = 8  # prompt ids kept as left context: enough for a leading space or a split character

    def __init__(self, tok: Tokenizer, context: Sequence[int] = ()):
        self.tok = tok
        # the context window (prompt tail, later the last emitted tokens) + tokens not yet turned into text
        self.ids: list[int] = [int(t) for t in context[-self.CONTEXT:]]
        self.read = len(self.ids)  # how many of `ids` are already text
        for _ in range(3):  # a character split across the end of the context is decoded with the new tokens
            if not self.read or not tok.decode(self.ids[:self.read]).endswith("\ufffd"):
                break
            self.read -= 1

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[:self.read])
        after = self.tok.decode(self.ids)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        del self.ids[:self.read]  # the new tokens become the next call's left context
        self.read = len(self.ids)
        return after[len(before):]


class StopFilter:
    """Emits text as it comes, except a tail that could still become one of the stop strings."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""  # everything generated (cut at a stop string once found)
        self.emitted = 0
        self.stopped = False

    def feed(self, new: str) -> str:
        if self.stopped:
            return ""
        self.text += new
        if not self.stops:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        longest = max(map(len, self.stops))
        start = max(0, self.emitted - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out

"""Text out of tokens, as they come: `Detokenizer` (incremental decode) and `StopFilter` (stop strings).

Both own their state for one request and take one piece at a time; neither allocates per token
beyond the text it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from edgeinfer.tokenizer import Tokenizer


class Detokenizer:
    """Incremental decode of generated tokens, seeded with the prompt's last ids as left context.

    Contract: the texts `add` returns, then `flush`'s, joined, are exactly what the generated ids add
    after the context: decode(context + ids) minus its prefix decode(context). So the first token keeps
    its leading space (decoders drop a leading space at the start of a decode: "▁time" alone is "time",
    after "Once upon a" it is " time"). With no context, they join to decode(ids). Each call decodes
    the new tokens with a little left context (the last emitted tokens), and holds text back while
    it ends in an incomplete UTF-8 character. A context that ends inside a character (a prompt of
    ids cut mid-character: its last tokens are bytes that begin one) has that character's text come
    with the first token that completes it.

    A token that decode drops is never held. One it drops before decoding (`Tokenizer.drops`: an id
    past the vocabulary, a special token of `tokenizers`) is passed over, as if it had not come.
    SentencePiece's control pieces end a run of byte pieces: with bytes held, what is held is let out
    as final; with none, the piece changes no text and is passed over.

    What is held is bounded, so that each token costs a bounded decode (held whole, a run of bytes
    that never made a character, which only `logit_bias` forces, was re-decoded at every token:
    quadratic, 10 s for 16,000 tokens). Past HOLD_TOKENS held tokens, the text up to a split among
    the last SPLIT_TRIES tokens is let out when its decode is a prefix of the whole decode short of
    its last three U+FFFD: decoders show an incomplete character at the end (at most 3 bytes, which
    more bytes may complete) as one U+FFFD (`tokenizers`) or one per byte (SentencePiece), and
    invalid bytes before it as U+FFFD that a later byte does not change. Past FORCE_TOKENS (no such
    split: a safety net), what is held is let out as it decodes now.

    Where the contract does not hold: Hugging Face's ByteFallback decoder shows a whole run of byte
    tokens as U+FFFD once any byte in it is invalid, so a character already let out (its bytes
    complete) can show as U+FFFD in a later whole decode. `Tokenizer` decodes the Llama-style
    tokenizer.json (ours from a GGUF, Hugging Face's Llama ones) by bytes instead, as SentencePiece
    does; only a decoder of another shape around ByteFallback is left to the library.
    """

    CONTEXT = 8  # prompt ids kept as left context: enough for a leading space or a split character
    HOLD_TOKENS = 16  # a character is at most 4 bytes: more tokens held than this are not one character
    SPLIT_TRIES = 8  # splits tried before the held tokens' incomplete end
    FORCE_TOKENS = 64  # held past this, with no split found: let out as they decode

    def __init__(self, tok: Tokenizer, context: Sequence[int] = ()):
        self.tok = tok
        # the context window (prompt tail, later the last emitted tokens) + tokens not yet turned into text
        self.ids: list[int] = [int(t) for t in context[-self.CONTEXT:]]
        self.read = len(self.ids) - self._incomplete_tail()  # how many of `ids` are already text

    def _incomplete_tail(self) -> int:
        """How many of `ids`' last tokens carry the start of a character whose other bytes have not
        come, with the tokens decode drops among them (0 when the text ends whole: a literal U+FFFD is
        a whole character). Read from the tokens' own bytes (`Tokenizer.token_text`)."""
        tok, ids = self.tok, self.ids
        pieces: list[bytes] = []
        for back, t in enumerate(reversed(ids), 1):
            if tok.drops(t):
                continue
            text = tok.token_text(t) if t not in tok.special_ids else ""  # a control piece ends a byte run
            if not isinstance(text, bytes) or len(pieces) == 3:  # a character's start lies in its last 3 pieces
                break
            pieces.insert(0, text)
            try:
                b"".join(pieces).decode("utf-8")
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data" and e.start < len(pieces[0]):  # it starts in this token
                    return back
        return 0

    def add(self, token: int) -> str:
        if self.tok.drops(token):
            return ""  # as if it had not come
        if token in self.tok.special_ids:  # SentencePiece's control piece
            if self.read == len(self.ids):
                return ""  # no text, and none it changes
            self.ids.append(token)  # SentencePiece: the bytes held are final now
            before, after = self.tok.decode(self.ids[:self.read]), self.tok.decode(self.ids)
            return self._take(len(self.ids), before, after)
        self.ids.append(token)
        before = self.tok.decode(self.ids[:self.read])
        after = self.tok.decode(self.ids)
        if not after.endswith("\ufffd") and len(after) > len(before):
            return self._take(len(self.ids), before, after)
        held = len(self.ids) - self.read
        if held <= self.HOLD_TOKENS:
            return ""
        # the text short of its incomplete end (at most 3 bytes, which more bytes may complete) is final
        final = after
        for _ in range(3):
            final = final[:-1] if final.endswith("\ufffd") else final
        for split in range(len(self.ids) - 1, max(self.read, len(self.ids) - 1 - self.SPLIT_TRIES), -1):
            head = self.tok.decode(self.ids[:split])
            if len(head) > len(before) and final.startswith(head):
                return self._take(split, before, head)
        if held > self.FORCE_TOKENS:
            return self._take(len(self.ids), before, after)
        return ""

    def flush(self) -> str:
        """The text held back at the end (an incomplete character shows as U+FFFD, as decode shows it)."""
        before, after = self.tok.decode(self.ids[:self.read]), self.tok.decode(self.ids)
        return self._take(len(self.ids), before, after) if len(after) > len(before) else ""

    def _take(self, split: int, before: str, text: str) -> str:
        """`text` (the decode of ids[:split]) past `before` is out; the ids turned into text become the
        next call's left context."""
        done, self.read = self.read, split - self.read
        del self.ids[:done]
        return text[len(before):]


class StopFilter:
    """Emits text as it comes, except a tail that could still become one of the stop strings.

    Each call costs in proportion to the new piece and the held tail (at most the longest stop
    string), not to the text so far: the text is kept in pieces, joined only when read (`text`)."""

    JOIN_EVERY = 1024  # pieces joined into one string at a time: few objects, no copy of the whole text

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._chunks: list[str] = []  # emitted text, joined JOIN_EVERY pieces at a time
        self._recent: list[str] = []  # emitted pieces not yet joined
        self._held = ""  # not yet emitted: a tail that could still become a stop string
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything generated so far (cut at a stop string once found)."""
        return "".join(self._chunks) + "".join(self._recent) + self._held

    def _emit(self, out: str) -> str:
        if out:
            self._recent.append(out)
            if len(self._recent) >= self.JOIN_EVERY:
                self._chunks.append("".join(self._recent))
                self._recent.clear()
        return out

    def feed(self, new: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return self._emit(new)
        # a stop string that is found never begins in emitted text: a tail that could begin one is held.
        # The reply ends at the stop that ends first (the longest of those ending there), as if the text
        # came a character at a time: the earliest start made the cut depend on how the tokens split it,
        # a later-ending stop found in the same piece winning (a hostile round)
        pending = self._held + new
        hits = [(i + len(s), i) for s, i in ((s, pending.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self._held, self.stopped = "", True
            return self._emit(pending[:min(hits)[1]])
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:n]):
                    hold = n
                    break
        self._held = pending[len(pending) - hold:] if hold else ""
        return self._emit(pending[:len(pending) - hold])

    def flush(self) -> str:
        out, self._held = self._held, ""
        return self._emit(out)

"""`edgeinfer generate` and `edgeinfer chat` on the bundled model: output, JSON, errors, Ctrl-C."""

from __future__ import annotations

import builtins
import json

import pytest

from edgeinfer.cli import main


def test_generate_text_and_json(capsys):
    assert main(["generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert main(["generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["text"] + "\n" == text and len(r["token_ids"]) == 12 and r["finish_reason"] == "length"
    assert main(["generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0", "--stream"]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("argv,needle", [
    (["generate", ""], "prompt is empty"),
    (["generate", "Hi", "--max-tokens", "0"], "max_new_tokens must be a positive integer, got 0 (here: --max-tokens)"),
    (["generate", "Hi", "--top-p", "2"], "top_p"),
    (["generate", "Hi", "--capacity", "1"], "capacity_tokens must be an integer >= 2, got 1 (here: --capacity)"),
    (["generate", "Hi", "--capacity", "3"], "fewer sinks (here: --capacity; the CLI keeps the model's default "),
    (["chat", "--capacity", "3"], "fewer sinks (here: --capacity; the CLI keeps the model's default "),
    (["generate", "Hi", "-m", "/nonexistent/model"], "model folder not found"),
])
def test_generate_errors_are_one_line(capsys, argv, needle):
    """One line each; where a library argument's name is not the flag's, the flag is named too (--max-tokens 0
    was refused as max_new_tokens; --capacity 3 was told to use fewer sinks, which no flag sets)."""
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgeinfer: error: ") and needle in err and len(err.splitlines()) == 1


class _Terminal:
    """A standard input that says it is a terminal (a Ctrl-C then stops a reply, not the chat)."""

    def isatty(self) -> bool:
        return True


def test_chat_reset_and_ctrl_c(capsys, monkeypatch):
    import sys

    from edgeinfer.conversation import Conversation

    monkeypatch.setattr(sys, "stdin", _Terminal())

    lines = iter(["Hello there", "/reset", KeyboardInterrupt(), "Tell me more", "Again", "/quit"])

    def fake_input(prompt=""):
        item = next(lines)
        if isinstance(item, BaseException):
            raise item
        return item

    real = Conversation._turn
    calls = {"n": 0}
    seen = {}

    def turn(self, messages, content, opts):
        calls["n"] += 1
        gen = real(self, messages, content, opts)

        def cut():  # Ctrl-C in the middle of the second reply (inside the generation, which then ends)
            try:
                yield next(gen)
                raise KeyboardInterrupt
            finally:
                gen.close()

        class Watched:  # the Generation, its history recorded once it ends
            completion = property(lambda _: gen.completion)

            def __iter__(self):
                yield from gen
                seen["history_after"] = list(self_conv.messages)

            def close(self):
                gen.close()

        self_conv = self
        return cut() if calls["n"] == 2 else Watched()

    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(Conversation, "_turn", turn)
    assert main(["chat", "--max-tokens", "5", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "(context cleared)" in err and "(reply stopped; that turn is forgotten)" in err
    # /reset emptied the history and the cut turn left no trace in it: the last turn's history is its own
    assert [m["content"] for m in seen["history_after"] if m["role"] == "user"] == ["Again"]
    assert calls["n"] == 3  # the program went on after the interrupted reply


def test_chat_takes_a_block_between_triple_quotes_as_one_message(capsys, monkeypatch):
    """A text of several lines pasted into `chat` was one turn per line (a hostile round). Between a
    line starting with \"\"\" and a line of \"\"\" alone it is one message, pasted Python's indented
    docstrings included; `\"\"\"Hi\"\"\"` is one line's message; the end of input ends a block; Ctrl-C
    inside one drops it and chat goes on; a line that is not UTF-8 inside one is skipped, the block going
    on (a review: the message was dropped and its other lines came as turns); an indented \"\"\" is text."""
    from edgeinfer.conversation import Conversation

    bad = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    script = ['"""', "def f():", '    """Doc."""', '    """', "", bad, "    return 1", '"""',
              '"""One line."""', "plain", '    """ indented: not a block', '""" starts here', "and goes on",
              KeyboardInterrupt(), "after", '"""', "cut by the end of input"]
    lines = iter(script)

    def fake_input(prompt=""):
        try:
            item = next(lines)
        except StopIteration:
            raise EOFError from None
        if isinstance(item, BaseException):
            raise item
        return item

    said = []
    real = Conversation.stream_say

    def stream_say(self, content, opts=None):
        said.append(content)
        return real(self, content, opts)

    import sys

    monkeypatch.setattr(sys, "stdin", _Terminal())
    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(Conversation, "stream_say", stream_say)
    assert main(["chat", "--max-tokens", "2", "--seed", "1"]) == 1  # the skipped line: a refusal
    assert said == ['def f():\n    """Doc."""\n    """\n\n    return 1', "One line.", "plain",
                    '    """ indented: not a block', "after", "cut by the end of input"]
    err = capsys.readouterr().err
    assert "(message dropped)" in err and "not valid UTF-8 (invalid start byte); line skipped" in err


def test_generate_takes_power_off_as_serve_and_load_do(capsys):
    """A hostile round: `serve --power off` and `load(power="off")` were taken, `generate --power off` refused."""
    assert main(["generate", "Once upon a time", "--max-tokens", "3", "--temperature", "0", "--power", "off"]) == 0
    assert capsys.readouterr().out.strip()

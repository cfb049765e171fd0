"""`edgeinfer generate` and `edgeinfer chat`: their flags (the generation options' defaults come from
`edgeinfer.options`, declared once) and their handlers. Errors and exit codes are `cli.main`'s."""

from __future__ import annotations

import argparse
import codecs
import json
import sys

from edgeinfer.cli_args import path_arg
from edgeinfer.errors import EdgeInferError
from edgeinfer.overflow import OVERFLOW_POLICIES, ContextOverflowError
from edgeinfer.terminal import printable


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="complete a prompt (no -m: the bundled stories260K model)")
    g.add_argument("prompt", help="the prompt text; - reads it from standard input (a file piped in, up to 1 MiB)")
    _model_args(g)
    _sampling_args(g)
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--json", action="store_true", help="print the completion as JSON")
    g.set_defaults(func=_cmd_generate)


def add_chat_parser(sub) -> None:
    ch = sub.add_parser("chat", help='interactive chat (/reset clears the context, Ctrl-C stops a reply, '
                                     '""" begins and ends a message of several lines); piped, a reply per message, '
                                     'exit status 1 if any input was refused')
    _model_args(ch)
    _sampling_args(ch)
    ch.set_defaults(func=_cmd_chat)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=path_arg, default=None, help="edgeinfer model folder (default: bundled)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: the device profile's)")
    p.add_argument("--capacity", type=int, default=None, help="KV ring capacity in tokens")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default=OVERFLOW_POLICIES[0],
                   help="when the context is full: shift (forget the oldest, go on), truncate, error")
    p.add_argument("-v", "--verbose", action="store_true", help="print load details (KV memory) to stderr")
    p.add_argument("--power", choices=("off", "performance", "balanced", "battery", "thermal-guard"), default=None,
                   help="pace decoding by this device's sensors (default: off, as `serve --power off` says it)")


# generation flags: (flag, option name, type, help); defaults come from edgeinfer.options, declared once
GENERATION_FLAGS = (
    ("--max-tokens", "max_new_tokens", int, "tokens to generate at most"),
    ("--temperature", "temperature", float, "0 is greedy"),
    ("--top-k", "top_k", int, "0 switches it off"),
    ("--top-p", "top_p", float, "1 switches it off"),
    ("--min-p", "min_p", float, "0 switches it off"),
    ("--typical-p", "typical_p", float, "1 switches it off"),
    ("--repetition-penalty", "repetition_penalty", float, "1 switches it off"),
    ("--frequency-penalty", "frequency_penalty", float, "0 switches it off"),
    ("--presence-penalty", "presence_penalty", float, "0 switches it off"),
    ("--penalty-last-n", "penalty_last_n", int, "how many recent tokens the penalties look at"),
    ("--seed", "seed", int, "random when not given"),
)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    from edgeinfer.options import default

    for flag, name, kind, help_text in GENERATION_FLAGS:
        d = default(name)
        p.add_argument(flag, type=kind, default=d, help=f"{help_text} (default: {d})")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def _options(args: argparse.Namespace):
    from edgeinfer.options import GenerationOptions

    flat = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _ in GENERATION_FLAGS}
    try:
        return GenerationOptions.from_kwargs(**flat, stop=args.stop, ignore_eos=args.ignore_eos)
    except EdgeInferError as e:
        raise _in_flag_words(e) from None


def _load(args: argparse.Namespace):
    import edgeinfer

    try:
        return edgeinfer.load(args.model, threads=args.threads, capacity_tokens=args.capacity,
                              overflow=args.overflow, verbose=args.verbose, power=args.power)
    except EdgeInferError as e:
        raise _in_flag_words(e) from None


FLAG_OF = {"max_new_tokens": "--max-tokens", "capacity_tokens": "--capacity", "n_sink": "--capacity"}  # library names


def _in_flag_words(e: EdgeInferError) -> EdgeInferError:
    """A refusal whose words begin with (or, for the attention sinks, which no flag sets, end with) a library
    argument that a flag of another name gives, with that flag named: `max_new_tokens must be ...` was
    a puzzle after --max-tokens 0. Others as they are."""
    text = str(e)
    name = next((n for n in FLAG_OF if text.startswith(n) or f"({n})" in text), None)
    if name is None:
        return e
    sinks = "; the CLI keeps the model's default attention sinks" if name == "n_sink" else ""
    return EdgeInferError(f"{text} (here: {FLAG_OF[name]}{sinks})")


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.stream and args.json:
        raise EdgeInferError("--json prints the whole completion as one object: it does not go with --stream")
    opts = _options(args)  # a bad option fails before the model loads
    prompt = _stdin_text() if args.prompt == "-" else args.prompt
    if not prompt:  # (the library's refusal offers [bos_id], which a command line cannot give)
        raise EdgeInferError("the prompt is empty: give text" + (" on standard input" if args.prompt == "-" else ""))
    model = _load(args)
    note = _long_prompt_note(model, prompt, args.overflow)
    if note:
        print(f"edgeinfer: note: {note}", file=sys.stderr, flush=True)
    try:
        if args.stream:
            g = model.stream(prompt, opts)
            try:
                for chunk in g:
                    print(chunk.text, end="", flush=True)
            except KeyboardInterrupt:  # on a terminal, "interrupted" on a line of its own (as chat does it),
                _end_line_on_terminal()  # not glued to the reply's last word
                raise
            print()
            c = g.completion
        else:
            c = model.generate(prompt, opts)
    except ContextOverflowError as e:  # the library's words name its own arguments (as chat says it)
        raise EdgeInferError(f"{e} (here: --overflow, --capacity)") from None
    if not args.stream:
        if args.json:
            from dataclasses import asdict

            print(json.dumps({**asdict(c), "token_ids": list(c.token_ids)}))
        else:
            print(c.text)
    for note in _context_notes(c, opts.max_new_tokens, model.capacity_tokens, args.overflow):
        print(f"edgeinfer: note: {note}", file=sys.stderr)
    return 0


def _end_line_on_terminal() -> None:
    """Ends the reply's line when standard output is a terminal (a pipe or a file keeps the text as
    it was generated); a terminal that cannot be written any more is left as it is."""
    try:
        if sys.stdout is not None and sys.stdout.isatty():
            print(flush=True)
    except (OSError, ValueError):
        pass


MAX_STDIN_PROMPT_BYTES = 1 << 20  # the tokenizer takes ~200 bytes of memory a byte at once (an 8 MB prompt: 1.6 GB,
# an abort with no word under a 1.5 GB limit); 1 MiB is ~250,000 tokens, past any context here


def _stdin_text() -> str:
    """The prompt `-` stands for: all of standard input (at most MAX_STDIN_PROMPT_BYTES), as UTF-8, a
    leading byte-order mark dropped (a command line holds 128 KiB at most)."""
    if sys.stdin is None:
        raise EdgeInferError("the prompt is - (standard input), but standard input is closed")
    if sys.stdin.isatty():
        print("edgeinfer: reading the prompt from standard input; end it with Ctrl-D", file=sys.stderr)
    data = sys.stdin.buffer.read(MAX_STDIN_PROMPT_BYTES + 1)
    if len(data) > MAX_STDIN_PROMPT_BYTES:
        raise EdgeInferError(f"standard input holds more than {MAX_STDIN_PROMPT_BYTES >> 20} MiB: a prompt is at most "
                             "that (tokenizing it takes about 200 bytes of memory a byte; a context holds far less)")
    try:  # a byte-order mark (a file saved by Notepad) is no part of the prompt: it was 3 byte tokens, as eval
        return data.decode("utf-8").removeprefix("\ufeff")  # drops it too
    except UnicodeDecodeError as e:
        raise EdgeInferError(f"standard input is not valid UTF-8 (byte {e.start}): the prompt must be text") from None


LONG_PROMPT_RINGS = 2  # a prompt this many contexts long, or more, is said to take its time under shift


def _long_prompt_note(model, prompt: str, overflow: str) -> str | None:
    """Before the work: a prompt of LONG_PROMPT_RINGS contexts or more under --overflow shift runs whole
    through the context, for a time in proportion to its length, though what follows sees only its
    last tokens (a 1 MiB stdin prompt took 2 min 25 s on the bundled model with no word, 1.1 s under
    truncate; a docs round). (Tokens are counted only for a prompt of that many bytes: a token is at
    least a byte.)"""
    capacity = model.capacity_tokens
    if overflow != "shift" or len(prompt.encode("utf-8", "surrogatepass")) < LONG_PROMPT_RINGS * capacity:
        return None
    try:
        n = len(model.tokenizer.encode(prompt))
    except (EdgeInferError, UnicodeError):  # (not text the model takes: its refusal comes next, in its words)
        return None
    if n < LONG_PROMPT_RINGS * capacity:
        return None
    return (f"the prompt is {n:,} tokens, {n / capacity:.0f} times the {capacity}-token context: under --overflow "
            "shift all of it runs through the context first (its time grows with its length), though the reply "
            "sees only its last tokens; --overflow truncate keeps those and starts at once")


def _context_notes(c, max_new_tokens: int, capacity: int, overflow: str) -> list[str]:
    """What the text alone does not show: tokens the context dropped (`usage.dropped_tokens`), and a
    reply cut short because the context filled (finish "length" before max_new_tokens)."""
    notes = []
    if c.usage.dropped_tokens:
        notes.append(f"{c.usage.dropped_tokens} tokens were dropped from the {capacity}-token context (the prompt's "
                     f"oldest, or the reply's own as it went on): what came after did not see them (--overflow "
                     f"{overflow}; a larger --capacity keeps more)")
    if c.finish_reason == "length" and c.usage.completion_tokens < max_new_tokens:
        notes.append(f"the reply stopped after {c.usage.completion_tokens} tokens because the {capacity}-token "
                     f"context is full (--overflow {overflow}; shift goes on, forgetting the oldest tokens)")
    return notes


BLOCK = '"""'
MAX_MESSAGE_BYTES = MAX_STDIN_PROMPT_BYTES  # a chat message, as a prompt on standard input (a 32 MB piped line was
# a MemoryError traceback under a 1.5 GB limit: a hostile round)


class _TooLong(Exception):
    """A line or message of more than MAX_MESSAGE_BYTES; its bytes were read and dropped. `opens`: the
    line begins a block (starts with \"\"\" and does not end with it), whose lines are to be skipped too;
    `closes`: it is \"\"\" alone with padding past the limit, which ends a block as \"\"\" does."""

    def __init__(self, opens: bool = False, closes: bool = False):
        super().__init__(f"the message is longer than {MAX_MESSAGE_BYTES >> 20} MiB (a message is at most that, "
                         "as a prompt on standard input is)")
        self.opens, self.closes = opens, closes


HELP = ('/reset clears the context, /quit or Ctrl-D leaves, Ctrl-C stops a reply; a line starting with """ '
        'begins a message of several lines, ended by a line of """.')


def _block(line: str, read_line) -> str:
    """The message a line begins: the line itself; for a line starting with \"\"\", the rest of it
    and the lines after it up to one that is \"\"\" alone (`read_line()` gives the next; the end of
    the input ends the message too), or just the rest if it ends with \"\"\" (`\"\"\"Hi\"\"\"`).
    A text pasted into `chat` is then one turn, not one per line. Only an unindented \"\"\" opens
    and closes, so pasted Python keeps its docstrings. A block of more than MAX_MESSAGE_BYTES is read
    to its end and refused whole (_TooLong)."""
    if not line.startswith(BLOCK):
        return line
    rest = line[len(BLOCK):]
    if rest.rstrip().endswith(BLOCK):
        return rest.rstrip()[:-len(BLOCK)]
    lines = [rest] if rest.strip() else []
    size_bytes, too_long = sum(len(t.encode("utf-8", "surrogatepass")) for t in lines), False  # of "\n".join(lines)
    while True:
        try:
            text = read_line()
        except EOFError:
            break
        except _TooLong as e:
            if e.closes:
                break
            too_long = True
            continue
        except UnicodeDecodeError as e:  # that line alone: the block goes on (dropping the message left its
            print(f"edgeinfer: error: {_not_decoded(e)}; line skipped", file=sys.stderr)
            continue  # other lines to arrive as turns of their own, and its closing \"\"\" to open a block)
        if text.rstrip() == BLOCK:
            break
        size_bytes += len(text.encode("utf-8", "surrogatepass")) + (1 if lines else 0)
        too_long = too_long or size_bytes > MAX_MESSAGE_BYTES
        if not too_long:
            lines.append(text)
    if too_long:
        raise _TooLong()
    return "\n".join(lines)


def _not_decoded(e: UnicodeDecodeError) -> str:
    """What was wrong with a line of input that could not be decoded. Piped lines are read as UTF-8; a
    terminal's by its encoding, which PYTHONIOENCODING or the locale may make ASCII: then valid UTF-8
    text ("café") is refused, and the message names the encoding, not the text, as the cause."""
    if codecs.lookup(e.encoding).name == "utf-8":
        return f"the input is not valid UTF-8 ({e.reason})"
    return (f"the input cannot be read as {e.encoding} ({e.reason}): the terminal's encoding, from "
            f"PYTHONIOENCODING or the locale; set it to UTF-8, or pipe the messages in")


def _read_line(prompt: str | None) -> str:
    """A line of input: from a terminal (`prompt` shown) by `input`, with its line editing; piped (`prompt`
    None) read as bytes and decoded line by line, so that a bad byte loses that line alone (UnicodeDecodeError;
    Python's strict stdin decoder dropped all it had buffered, up to 8 KB of later lines, and its
    default one let the bytes through as surrogates). A CRLF file's carriage return is dropped (it
    reached the model as part of the message). EOFError at the end; _TooLong for a piped line of more
    than MAX_MESSAGE_BYTES, read to its end and dropped (a terminal's lines are typed)."""
    if prompt is not None:
        return input(prompt).removesuffix("\r")
    sys.stdout.flush()  # as input() does: the last reply's newline reaches a script waiting for it
    stream = getattr(sys.stdin, "buffer", sys.stdin)  # (a text stream that has no bytes under it: as it is)
    raw = stream.readline(MAX_MESSAGE_BYTES + 2)  # (room for a CRLF)
    if not raw:
        raise EOFError
    newline, cr = (b"\n", b"\r") if isinstance(raw, bytes) else ("\n", "\r")
    content = raw.removesuffix(newline).removesuffix(cr)  # (a line cut by the limit has no newline)
    if len(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass")) > MAX_MESSAGE_BYTES:
        _drop_rest_of_line(stream, raw)  # (a text stream's limit counts characters: its bytes are counted here)
    line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    return line.removesuffix("\n").removesuffix("\r").removeprefix("\ufeff")  # a BOM, as `generate -` drops it


def _drop_rest_of_line(stream, head) -> None:
    """Reads a too long line to its end, a MiB at a time, and raises _TooLong saying whether the line,
    as `_block` reads it, opens a block (starts with \"\"\" and does not end with another after it) or
    closes one (is \"\"\" alone, its padding aside). Only its last non-blank bytes are kept."""
    newline, block, bom = (b"\n", BLOCK.encode(), "\ufeff".encode()) if isinstance(head, bytes) else ("\n", BLOCK, "\ufeff")
    head = head.removeprefix(bom)
    # the line's last bytes up to its last non-blank one; where that one ends; the bytes read, and their last ones
    end, stripped, size, last = head[:0], 0, 0, head[:0]
    chunk = head
    while True:
        kept = chunk.rstrip()
        if kept:
            end, stripped = (last + kept)[-len(block):], size + len(kept)
        size, last = size + len(chunk), (last + chunk)[-len(block):]
        if not chunk or chunk.endswith(newline):
            break
        chunk = stream.readline(1 << 20)
    starts = head.startswith(block)
    raise _TooLong(opens=starts and not (stripped >= 2 * len(block) and end == block),
                   closes=starts and stripped == len(block))


def _cmd_chat(args: argparse.Namespace) -> int:
    """The chat loop. A refused message (bad UTF-8, a reply that does not fit) says why on stderr and the
    chat goes on; the exit status is then 1. Ctrl-C stops a reply (a terminal) or the whole chat (piped:
    a script's interrupt, exit 130 as `generate`)."""
    opts = _options(args)
    if sys.stdin is None:
        raise EdgeInferError("chat reads its messages from standard input, which is closed")
    interactive = sys.stdin.isatty()
    refused = 0
    model = _load(args)
    conv = model.conversation()
    if interactive:
        try:  # line editing and history; without it the terminal's own line buffer cuts a line at 4,095 bytes
            import readline  # noqa: F401
        except ImportError:  # Windows, or a Python built without it
            pass
    print(f"edgeinfer chat: {HELP}", file=sys.stderr)

    def more() -> str:  # a block's next line (`_block` says a bad one is skipped; counted here)
        nonlocal refused
        try:
            return _read_line("... " if interactive else None)
        except UnicodeDecodeError:
            refused += 1
            raise

    while True:
        try:
            line = _read_line("> " if interactive else None)  # piped: no prompts mixed into the replies
        except EOFError:
            if interactive:
                print()
            return _chat_status(refused)
        except KeyboardInterrupt:
            if not interactive:
                raise
            print()
            continue
        except UnicodeDecodeError as e:  # a bad byte (piped; a terminal's under a strict UTF-8 locale): that line
            raw = e.object if isinstance(e.object, bytes) else b""
            opens = raw.startswith(BLOCK.encode()) and not raw[len(BLOCK):].rstrip().endswith(BLOCK.encode())
            skipped = "the message it begins (to its closing \"\"\") skipped" if opens else "line skipped"
            print(f"edgeinfer: error: {_not_decoded(e)}; {skipped}", file=sys.stderr)
            refused += 1
            if opens:  # its lines were turns of their own, and its closing \"\"\" opened a block (a review)
                _skip_block(more, interactive)
            continue
        except _TooLong as e:
            print(f"edgeinfer: error: {e}; skipped", file=sys.stderr)
            refused += 1
            if e.opens:
                _skip_block(more, interactive)
            continue
        command = line.strip().lower()
        if command in ("/quit", "/exit"):
            return _chat_status(refused)
        if command == "/reset":
            conv.reset()
            print("(context cleared)", file=sys.stderr)
            continue
        if command in ("/help", "/?"):  # not a message to the model
            print(HELP, file=sys.stderr)
            continue
        try:
            message = _block(line, more)
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n(message dropped)", file=sys.stderr)
            continue
        except _TooLong as e:
            print(f"edgeinfer: error: {e}; skipped", file=sys.stderr)
            refused += 1
            continue
        if not message.strip():
            continue
        reply = None
        try:
            reply = conv.stream_say(message, opts)
            for chunk in reply:
                print(chunk.text, end="", flush=True)
        except KeyboardInterrupt:
            if reply is not None:
                reply.close()  # the conversation rolls the cut turn back: history and cache agree
            if not interactive:
                raise
            print("\n(reply stopped; that turn is forgotten)", file=sys.stderr)
            continue
        except EdgeInferError as e:  # e.g. the reply does not fit (--overflow error): say so, keep chatting
            hint = ""
            if isinstance(e, ContextOverflowError):  # the library's words name its own arguments
                held = "; /reset clears the context" if conv.cache.n_valid else ""
                hint = f" (here: --overflow, --capacity{held})"
            print(f"edgeinfer: error: {printable(str(e))}{hint}", file=sys.stderr)  # (a template's own words)
            refused += 1
            continue
        print()
        for note in _context_notes(reply.completion, opts.max_new_tokens, model.capacity_tokens, args.overflow):
            print(f"edgeinfer: note: {note}", file=sys.stderr)  # as generate says them: a turn's dropped tokens, a
            # reply cut by a full context


def _skip_block(read_line, interactive: bool) -> None:
    """Reads a refused message's block to its closing \"\"\" and drops it (Ctrl-C ends that at a terminal)."""
    try:
        _block(BLOCK, read_line)
    except _TooLong:
        pass
    except KeyboardInterrupt:
        if not interactive:
            raise


def _chat_status(refused: int) -> int:
    """The chat's exit status: 1 when an input was refused (a line skipped, a message that did not fit;
    each said why as it happened)."""
    if refused:
        print(f"edgeinfer: {refused} input{'s were' if refused > 1 else ' was'} refused (said above)", file=sys.stderr)
    return 1 if refused else 0

"""The `edgeinfer` command line: convert, eval, inspect, generate, chat, bench, serve, power.

User errors (`EdgeInferError`: bad arguments, a missing model, a prompt that does not fit or is
not valid UTF-8) print one line `edgeinfer: error: ...` and exit 1; Ctrl-C prints
`edgeinfer: interrupted` and exits 130; a reader that closes the output early
(`edgeinfer generate ... | head`) ends the program quietly with 141 (128 + SIGPIPE, as a shell
reports a command killed by SIGPIPE). None of them prints a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import sys
import warnings

from edgeinfer import progress
from edgeinfer.cli_args import OUTPUT_FULL, path_arg
from edgeinfer.interrupts import interrupts_held
from edgeinfer.errors import EdgeInferError
from edgeinfer.terminal import printable


def _cmd_eval(args: argparse.Namespace) -> int:
    from edgeinfer.evaluate import perplexity, stream_perplexity
    from edgeinfer.model import default_model_path

    if args.model is None:  # as generate, chat and bench: the bundled model
        args.model = str(default_model_path())
    if args.stream:
        if args.path is not None:
            raise EdgeInferError("--stream scores each story through the ring (chunks, then one token at a time): "
                                 "--path applies to window scoring")
        if args.capacity is None:
            raise EdgeInferError("--stream needs --capacity N (the ring size)")
        if args.window is not None:
            raise EdgeInferError("--window cuts stories into windows; --stream runs each story through the ring "
                                 "whole: drop one of them")
        r = stream_perplexity(args.model, args.text, capacity=args.capacity,
                              sinks=args.sinks, threads=args.threads, progress=progress.on_terminal("edgeinfer eval"))
    else:
        if args.capacity is not None or args.sinks is not None:
            raise EdgeInferError("--capacity and --sinks set the ring of --stream scoring: add --stream, or drop them")
        r = perplexity(args.model, args.text, window=args.window, threads=args.threads, path=args.path,
                       progress=progress.on_terminal("edgeinfer eval"))
    progress.clear()
    if args.json:  # which model, text and versions (paths absolute), so that a saved result says what it measured
        from edgeinfer.bench import versions
        print(json.dumps({"model": os.path.abspath(args.model), "text": os.path.abspath(args.text),
                          "versions": versions(), **r.to_json()}))
    else:
        how = f"{r.n_windows} windows of at most {r.window} tokens, {r.path} path" if r.window else \
            "each a stream through the ring"  # stream scoring has no windows
        print(f"perplexity {r.perplexity:.4f} over {r.scored_tokens} tokens "
              f"({r.n_stories} stories, {how}, {r.eval_s:.1f} s)")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from edgeinfer.inspect import run  # --platform: the device profile (edgeinfer.platform_report)
    return run(args.model, args.json, args.verify, args.platform, args.root, out=lambda line: print(line, flush=True))


def _cmd_bench(args: argparse.Namespace) -> int:
    from edgeinfer.bench import BenchConfig, run_bench

    cfg = BenchConfig(args.model, args.prompt_tokens, args.gen_tokens, args.threads, args.runs, args.capacity)
    shown = progress.Progress("edgeinfer bench")
    r = run_bench(cfg, lambda i, n: shown(i + 1, n, "runs"))  # bad settings: InvalidArgumentErrors; else a bug
    progress.clear()
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['model']} ({r['quantization']}, {r['threads']} threads, {r['prompt_tokens']}-token prompt, "
              f"{r['gen_tokens']} new tokens, median of {r['runs']})\n"
              f"  load {r['load_s']:.2f} s, time to first token {r['ttft_ms']['median']:.1f} ms, "
              f"prefill {r['prefill_tok_s']['median']:.0f} tok/s, decode {r['decode_tok_s']['median']:.1f} tok/s\n"
              f"  peak RSS {r['peak_rss_mb']:.0f} MiB, {r['cpu_s_per_token']['median'] * 1e3:.1f} CPU ms per token")
        job = r["prompt_tokens"] + r["gen_tokens"]
        if job > r["capacity_tokens"]:  # the model's own ring: its oldest tokens were shifted out on the way
            why = (f"--capacity {args.capacity}: a larger ring, or fewer --prompt-tokens / --gen-tokens"
                   if args.capacity is not None else
                   "the most this model holds without re-basing often; fewer --prompt-tokens / --gen-tokens "
                   "to keep them all")
            print(f"  the KV ring holds {r['capacity_tokens']} tokens, fewer than the job's {job}: the oldest were "
                  f"shifted out as it ran ({why})")
    return 0


def _cmd_power(args: argparse.Namespace) -> int:
    import math
    import time

    from edgeinfer.power.report import format_report, report, watch
    from edgeinfer.power.sensors import Sensors, sensors_from_fixture

    if args.interval_s is not None and not args.watch:  # (it was ignored: one reading, at once)
        raise EdgeInferError("--interval-s goes with --watch (without it, power prints one reading)")
    interval_s = 1.0 if args.interval_s is None else args.interval_s
    if args.watch and not (math.isfinite(interval_s) and 0.1 <= interval_s <= 86400):
        raise EdgeInferError(f"--interval-s must be a number of seconds in [0.1, 86400], got {interval_s}")
    if args.root is not None and not (args.root / "root").is_dir() and not (args.root / "platform.txt").is_file():
        raise EdgeInferError(f"{args.root} is not a recorded device (a folder with root/ and platform.txt)")
    sensors = sensors_from_fixture(args.root) if args.root is not None else Sensors()
    if not args.watch:
        data = report(sensors.read())
        print(json.dumps(data) if args.json else format_report(data), flush=True)
        return 0
    for i, data in enumerate(watch(sensors, interval_s)):
        if i and not args.json:
            print()
        print(json.dumps(data) if args.json else format_report(data), flush=True)
        time.sleep(interval_s)


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that help and --version that cannot be written to standard output (a
    full disk, a closed pipe) raise as a command's output does, rather than exit 0 with nothing
    written (argparse drops the error)."""

    def _print_message(self, message, file=None):
        if file is None and sys.stdout is None and sys.stderr is not None:  # help or --version for a closed
            # standard output (argparse passes sys.stdout, None there; its errors go to sys.stderr, set):
            # `main` says so and exits 1, as any command's output would (it had gone to stderr, exit 0)
            raise OSError(errno.EBADF, "standard output is closed")
        if not message or file is None:  # (a closed standard stream: nothing to say it on)
            return
        try:
            file.write(message)
            if file is sys.stdout:
                file.flush()
        except OSError:
            if file is sys.stdout:  # `main` says so (a full disk: exit 1; a closed pipe: 141)
                raise


def build_parser() -> argparse.ArgumentParser:
    from edgeinfer import __version__

    ap = Parser(prog="edgeinfer", description="Run small quantized language models on device.")
    ap.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser = _numbers_as_values(sub.add_parser)

    from edgeinfer.cli_convert import add_convert_parser

    add_convert_parser(sub)

    e = sub.add_parser("eval", help="perplexity of a model on a text file (one story per line; no -m: bundled model)")
    e.add_argument("-m", "--model", type=path_arg, default=None, help="edgeinfer model folder (default: bundled)")
    e.add_argument("--text", type=path_arg, required=True, help="UTF-8 text to score, one story or document per line")
    e.add_argument("--window", type=int, default=None, help="tokens per scored window (default 512, or the "
                   "model's context or a portable model's ring if shorter)")
    e.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: the device profile's)")
    e.add_argument("--path", choices=("prefill", "decode"), default=None,
                   help="prefill (default): each window in calls of up to 256 tokens (as a prompt is prefilled); "
                   "decode: one call per token (as generation feeds tokens back; what generation computes at accuracy level 4; a "
                   "portable model's only path)")
    e.add_argument("--stream", action="store_true", help="each story as one stream through the KV ring")
    e.add_argument("--capacity", type=int, default=None, help="ring capacity in tokens (with --stream)")
    e.add_argument("--sinks", type=int, default=None, help="attention sinks kept by the ring (with --stream; default 4, or 0 "
                   "for a sliding-window model)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=_cmd_eval)

    from edgeinfer.cli_generate import add_chat_parser, add_generate_parser

    add_generate_parser(sub)

    b = sub.add_parser("bench", help="load time, time to first token, tok/s, memory (no -m: bundled model)")
    b.add_argument("-m", "--model", type=path_arg, default=None, help="edgeinfer model folder (default: bundled)")
    b.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    b.add_argument("--gen-tokens", type=int, default=128, help="tokens to generate per run (default 128)")
    b.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (default 2)")
    b.add_argument("--runs", type=int, default=3, help="timed runs, at most 1000; medians are reported (default 3)")
    b.add_argument("--capacity", type=int, default=None, help="KV ring capacity (default: prompt + gen + 8, or the most the model holds without re-basing "
                   "often if that is less)")
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.set_defaults(func=_cmd_bench)

    from edgeinfer.cli_serve import add_serve_parser

    add_serve_parser(sub)

    add_chat_parser(sub)

    pw = sub.add_parser("power", help="what this device's sensors read and the plan each power policy would choose")
    pw.add_argument("--watch", action="store_true", help="print again every --interval-s until Ctrl-C")
    pw.add_argument("--interval-s", type=float, default=None, help="seconds between readings with --watch (default 1)")
    pw.add_argument("--json", action="store_true", help="one JSON object per reading")
    pw.add_argument("--root", type=path_arg, default=None, help="read a recorded device folder instead (tests/fixtures/power/...)")
    pw.set_defaults(func=_cmd_power, imports=())

    i = sub.add_parser("inspect", help="describe an edgeinfer model folder, or with --platform this device")
    i.add_argument("model", type=path_arg, nargs="?", help="the model folder (none with --platform)")
    i.add_argument("--platform", action="store_true", help="the device profile detected here: its fields and why")
    i.add_argument("--root", type=path_arg, help="with --platform: a recorded device folder (tests/fixtures/platforms/*)")
    mode = i.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print the description as JSON")
    mode.add_argument("--verify", action="store_true", help="hash every file against edgeinfer.json; exit 1 on a mismatch")
    i.set_defaults(func=_cmd_inspect)
    return ap


MODEL_IMPORTS = ("edgeinfer.model",)  # what a command imports unless it sets `imports` (`main` holds a Ctrl-C over it)

# argparse takes "-1e6" for a flag (its own test knows "-5" and "-0.5" only): a value as the README writes it
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _numbers_as_values(add_parser):
    def add(*args, **kwargs):
        p = add_parser(*args, **kwargs)
        p._negative_number_matcher = NEGATIVE_NUMBER  # argparse's own (private) hook for this test
        return p
    return add


MEMORY_HINTS = {"serve": "a smaller --capacity or fewer --slots needs less",
                "convert": "convert on a machine with more memory and copy the folder over",
                **dict.fromkeys(("generate", "chat", "bench", "eval"), "a smaller --capacity or a smaller model needs less"),
                None: "other programs hold the memory, or the model is too large for this device"}


def main(argv: list[str] | None = None) -> int:
    args = None
    _standard_streams()
    # (each put back at the end only by the call that set it: a main() in another thread meanwhile
    # left the wrapper, or the devnull stdout, in place for good; a review)
    show = warnings.showwarning if warnings.showwarning is not _show_warning else None
    warnings.showwarning = _show_warning
    err = sys.stderr if not isinstance(sys.stderr, Diagnostics) else None
    no_stdout = False
    try:
        if err is not None:
            sys.stderr = Diagnostics(err)
        # The imports run from here on, inside the handlers, with a Ctrl-C held until they are whole
        # (`edgeinfer.interrupts`: met inside one it could become numpy's ImportError, or be lost and the
        # command run on). So an import that hangs cannot be interrupted; none is known to.
        with interrupts_held():
            args = build_parser().parse_args(argv)  # (--help and --version that cannot be written: `Parser`)
            # the command's compiled libraries (numpy, ONNX Runtime; convert's onnx): a model's unless it sets `imports`
            for module in getattr(args, "imports", MODEL_IMPORTS):
                importlib.import_module(module)
        if sys.stdout is None:  # started with its standard output closed (`>&-`)
            if getattr(args, "writes_stdout", lambda a: True)(args):
                print("edgeinfer: error: cannot write the output: standard output is closed", file=sys.stderr)
                return 1
            sys.stdout, no_stdout = open(os.devnull, "w"), True  # (a command that prints nothing there: convert
            # -q, serve)
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return rc
    except EdgeInferError as e:
        progress.clear()
        print(f"edgeinfer: error: {printable(str(e))}", file=sys.stderr)  # (it may quote a model folder's strings)
        return 1
    except (KeyboardInterrupt, ImportError) as e:  # a Ctrl-C inside a compiled module's import (ONNX
        cause = _interrupt_cause(e)  # Runtime's) comes out as "ImportError: initialization failed"
        if cause is None:
            raise
        progress.clear()
        if isinstance(cause, SystemExit):  # convert's SIGTERM / SIGHUP, met inside that import
            return cause.code if isinstance(cause.code, int) else 1
        print("edgeinfer: interrupted", file=sys.stderr)
        return 130
    except MemoryError as e:  # an allocation past a memory limit (ulimit -v, a cgroup): numpy says how much
        progress.clear()
        hint = MEMORY_HINTS.get(getattr(args, "command", None), MEMORY_HINTS[None])
        print(f"edgeinfer: error: not enough memory: {str(e)[:200] or 'an allocation failed'} ({hint})",
              file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away: Python's docs (signal, "Note on SIGPIPE") advise pointing stdout at
        # devnull, so that flushing it again at exit does not raise, and leaving quietly.
        _drop_stdout()
        return 141
    except OSError as e:
        # > /dev/full, a full disk; EBADF: standard output opened for reading only (`1</dev/null`); EIO: a
        # terminal that went away (closed with SIGHUP ignored: nohup, `trap '' HUP`, a supervisor)
        if e.errno == errno.EIO and _terminal_gone(sys.stdout):
            problem = "write the output: its terminal has gone"
        elif e.errno == errno.EIO and _terminal_gone(sys.stdin):
            problem = "read the input: its terminal has gone"
        elif e.errno in OUTPUT_FULL:
            problem = f"write the output: {e.strerror}"
        else:
            raise  # anything else is not expected here: a traceback says where
        print(f"edgeinfer: error: cannot {problem}", file=sys.stderr)
        _drop_stdout()  # what is still buffered would fail again at exit, with a traceback
        return 1
    finally:
        if show is not None:
            warnings.showwarning = show
        if err is not None:
            if isinstance(sys.stderr, Diagnostics):  # (a Ctrl-C may come before it was set)
                sys.stderr.settle()
            sys.stderr = err
        if no_stdout:
            sys.stdout.close()
            sys.stdout = None


def _terminal_gone(stream) -> bool:
    """Whether `stream` is a terminal that has hung up: a pseudo-terminal whose other end closed (an
    ssh session or a terminal window gone). Its writes, reads and ioctls then fail with EIO, where a
    failing disk's do too: only the ioctl tells them apart (a file answers ENOTTY)."""
    try:
        import termios
    except ImportError:  # Windows
        return False
    try:
        termios.tcgetattr(stream.fileno())
    except termios.error as e:
        return bool(e.args) and e.args[0] == errno.EIO
    except (OSError, ValueError, AttributeError):  # closed, None, or no descriptor
        return False
    return False


class Diagnostics:
    """Standard error while a command runs: its progress lines, notes and errors. A write that fails
    (standard error on a full disk, a pipe whose reader has gone) is dropped rather than raised into
    the command: convert's first progress line ended a conversion with no folder, blaming "disk full
    while writing" on the destination; chat died on its banner; generate's note after a whole reply
    turned its exit into 1 (a hostile round). Each write is tried (a disk freed again, a log rotated:
    serve's log lines go on), and at the command's end (`settle`) what a failed write left buffered
    goes to os.devnull, not into a failed flush at exit. Everything else is the stream's own."""

    def __init__(self, stream):
        self.stream, self.failed = stream, False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):  # (ValueError: closed, or a character its encoding lacks)
            self.failed = True
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self.failed = True

    def settle(self) -> None:
        if not self.failed:
            return
        try:
            self.stream.flush()
            return
        except (OSError, ValueError):
            pass
        try:
            _to_devnull(self.stream.fileno())
        except (OSError, ValueError, AttributeError):  # no descriptor of its own (io.UnsupportedOperation is both)
            pass

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _interrupt_cause(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit (convert's SIGTERM handler) that `e` is or was raised from
    (`raise ... from`, as pybind11 turns one inside a compiled module's initialisation into
    "ImportError: initialization failed"); None when neither."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        seen.add(id(e))
        e = e.__cause__
    return None


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the CLI's other diagnostics read: one line, no source file or code (a library
    caller keeps Python's own form). One that cannot be written (standard error on a full disk, a
    pipe whose reader has gone) is dropped, as Python's own `showwarning` drops it: raised inside a
    load, it became the load's error ("cannot load model.onnx: No space left on device"), and a daemon
    whose log could not be written died at start (a review). Escape sequences in it (a model folder's
    strings that it quotes) are written escaped (`terminal.printable`)."""
    try:
        print(f"edgeinfer: warning: {printable(str(message))}", file=sys.stderr if file is None else file)
    except OSError:
        pass


def _standard_streams() -> None:
    """Text the terminal's encoding lacks (a Latin-1 or ASCII locale, PYTHONIOENCODING=ascii) prints
    as "?" rather than ending the program; a closed standard error (`2>&-`) drops diagnostics rather
    than print them into standard output (Python's print falls back to it)."""
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):  # a stream already detached or closed: leave it
                pass


def _drop_stdout() -> None:
    if sys.stdout is None:  # (closed from the start: nothing buffered)
        return
    _to_devnull(sys.stdout.fileno())


def _to_devnull(fd: int) -> None:
    """Point descriptor `fd` at /dev/null, keeping no other descriptor open (one leaked per in-process
    call before)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != fd:  # (with fd closed, open may hand back fd itself: that one stays, on devnull)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())

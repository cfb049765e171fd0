"""CLI errors a user can cause: each prints exactly one line `edgeinfer: error: ...` and exits 1,
never a traceback; a reader closing the pipe early ends the program quietly."""

from __future__ import annotations

import json
import signal
import os
import subprocess
import sys
import threading
import time

import pytest

from edgeinfer.cli import main

ONE_LINE = [
    (["generate", "hi", "--top-k", "99999999999999999999"], "top_k"),
    (["generate", "hi", "--capacity", "1000000000000"], "trained length of 512"),
    (["generate", "hi", "--threads", "-1"], "threads"),
    (["generate", "hi", "--threads", "0"], "threads"),
    (["generate", "hi", "--max-tokens", "0"], "max_new_tokens"),
    (["generate", "hi", "--temperature", "nan"], "temperature"),
    (["generate", "hi", "--top-p", "2"], "top_p"),
    (["generate", "hi", "--stream", "--top-k", "99999999999999999999"], "top_k"),
    (["generate", "Once upon a time there was a little girl named Lily", "--capacity", "8", "--overflow", "error"],
     "or a larger capacity_tokens) (here: --overflow, --capacity)"),  # the flags, as chat says them
    (["generate", "Once upon a time there was a little girl named Lily", "--capacity", "8", "--overflow", "error",
      "--stream"], "(here: --overflow, --capacity)"),
    (["chat", "--threads", "-1"], "threads"),
    (["chat", "--capacity", "1000000000000"], "trained length of 512"),
]


def _one_error_line(err: str, needle: str) -> None:
    err = err.strip()
    assert err.startswith("edgeinfer: error: ") and needle in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv,needle", ONE_LINE, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_user_errors_print_one_line(capsys, argv, needle):
    assert main(argv) == 1
    _one_error_line(capsys.readouterr().err, needle)


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999999"])
def test_any_integer_seed_is_accepted(capsys, seed):
    """Seeds are masked to 64 bits (rng.resolve_seed): any integer is a valid, reproducible seed."""
    assert main(["generate", "Once", "--max-tokens", "5", "--seed", seed]) == 0
    first = capsys.readouterr()
    assert first.err == "" and first.out.strip()
    assert main(["generate", "Once", "--max-tokens", "5", "--seed", seed]) == 0
    assert capsys.readouterr().out == first.out


@pytest.mark.parametrize("prompt", [b"Once \xff", b"Once \xff" + b" a b" * 300])  # (the second: long enough for
def test_non_utf8_prompt_is_one_line(prompt):  # the long-prompt note's count, which raised on it)
    """A byte that is not UTF-8 on the command line reaches Python as a lone surrogate."""
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "generate", prompt, "--max-tokens", "3",
                        "--capacity", "64"], capture_output=True, timeout=120)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1 and "Traceback" not in err
    _one_error_line(err, "not valid UTF-8")


def test_chat_reports_bad_input_and_goes_on(capsys, monkeypatch):
    import io

    text = b"caf\xe9\nOnce upon a time there was a little girl named Lily who\n/quit\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))  # piped: read line by line as bytes
    assert main(["chat", "--max-tokens", "3", "--seed", "1", "--capacity", "8", "--overflow", "error"]) == 1
    lines = capsys.readouterr().err.splitlines()
    err = [x for x in lines if x.startswith("edgeinfer: error: ")]
    assert len(err) == 2 and "not valid UTF-8" in err[0] and "does not fit" in err[1]
    assert lines[-1] == "edgeinfer: 2 inputs were refused (said above)"  # and the exit status says so (it was 0)


def test_chat_says_what_a_full_context_did_as_generate_does():
    """A hostile round: `chat --capacity 64` forgot earlier turns (shift) or cut a reply (error) with no
    word, where `generate` prints a note; a turn refused under --overflow error named the Python
    argument capacity_tokens and not /reset, which recovers. A bad byte's position was its place in
    the rendered template (105), not in the line typed (2)."""
    def chat(*flags: str, text: bytes, rc: int = 0) -> list[str]:
        r = subprocess.run([sys.executable, "-m", "edgeinfer", "chat", "--capacity", "64", "--temperature", "0",
                            *flags], input=text, capture_output=True, timeout=120, env={**os.environ, "LC_ALL": "C"})
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == rc and "Traceback" not in err, err
        return [x for x in err.splitlines() if x.startswith("edgeinfer: ")]

    story = b"Tell me a long story about a dog.\n"
    shift = chat("--max-tokens", "40", text=story + b"And then what happened next?\n")
    assert len(shift) == 2 and all("tokens were dropped from the 64-token context" in x for x in shift), shift
    full = chat("--max-tokens", "60", "--overflow", "error", text=story + b"And then?\nab\xff\xfe hi\n", rc=1)
    assert "the reply stopped after" in full[0] and "64-token context is full" in full[0], full
    assert "does not fit" in full[1] and full[1].endswith("(here: --overflow, --capacity; /reset clears the context)")
    assert "the input is not valid UTF-8 (invalid start byte); line skipped" in full[2], full  # (piped input is
    # decoded line by line: the line is refused before it becomes a message)


def test_a_prompt_many_contexts_long_under_shift_is_said_to_take_its_time_before_the_work(capsys):
    """`cat doc.txt | edgeinfer generate -` of 1 MiB ran 2 min 25 s on the bundled model with no word
    until its end (a docs round): the whole prompt runs through the ring under shift. A prompt of two
    contexts or more now gets a note first, naming truncate; a shorter one, or truncate, gets none."""
    from edgeinfer.cli import main

    long_prompt = "a b " * 200  # 400 tokens and more: over twice the 64-token context
    assert main(["generate", long_prompt, "--capacity", "64", "--max-tokens", "1", "--temperature", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("edgeinfer: note: the prompt is ") and "times the 64-token context" in err[0], err
    assert "--overflow truncate keeps those and starts at once" in err[0] and "tokens were dropped" in err[1]
    for prompt, flags in ((long_prompt, ["--overflow", "truncate"]), ("a b " * 20, [])):
        assert main(["generate", prompt, "--capacity", "64", "--max-tokens", "1", *flags]) == 0
        assert "the prompt is" not in capsys.readouterr().err


def test_chat_stdin_that_is_not_utf8():
    """Under a strict UTF-8 stdin, a bad byte skips that input with one error line."""
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "chat", "--max-tokens", "3"], input=b"hi\xff\n",
                       capture_output=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1 and "Traceback" not in err  # the chat went on; its status says a line was refused
    assert [x for x in err.splitlines() if "edgeinfer: error:" in x] == [
        "edgeinfer: error: the input is not valid UTF-8 (invalid start byte); line skipped"]
    assert err.splitlines()[-1] == "edgeinfer: 1 input was refused (said above)"


def test_closed_pipe_ends_quietly():
    """`edgeinfer generate --stream "Once" | head -c 5`: no BrokenPipeError traceback."""
    argv = [sys.executable, "-m", "edgeinfer", "generate", "--stream", "Once", "--max-tokens", "400", "--seed", "1"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(p.stdout.read(5)) == 5
    p.stdout.close()  # the reader goes away while the writer still has output
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err
    assert rc == 141  # the writer did meet the closed pipe (128 + SIGPIPE)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("extra", [["generate", "Once", "--max-tokens", "20"],
                                   ["generate", "Once", "--max-tokens", "20", "--stream"],
                                   ["--help"], ["--version"], ["inspect", "--help"]])
def test_output_to_a_full_disk_is_one_line(extra):
    """`edgeinfer generate ... > /dev/full`: an OSError traceback (twice: again at exit) before. --help
    and --version exited 0 with nothing written (a hostile round)."""
    argv = [sys.executable, "-m", "edgeinfer", *extra]
    with open("/dev/full", "w") as full:
        r = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.strip().splitlines() == [
        "edgeinfer: error: cannot write the output: No space left on device"], err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_conversion_whose_summary_meets_a_full_disk_says_the_model_is_complete(tmp_path):
    """`convert --force ... > /dev/full` replaced the model and then said only 'cannot write the output'
    with exit 1, which reads as a failed conversion (a hostile round)."""
    from conftest import STORIES_SRC

    dst = tmp_path / "model"
    argv = [sys.executable, "-m", "edgeinfer", "convert", str(STORIES_SRC), "-o", str(dst), "--quant", "fp32"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, timeout=300)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and err[-1] == (
        f"edgeinfer: error: cannot write the output: No space left on device (the model in {dst} is converted "
        "and complete; only this summary was not written)"), err
    assert "Traceback" not in r.stderr.decode() and (dst / "edgeinfer.json").is_file()
    assert subprocess.run([sys.executable, "-m", "edgeinfer", "inspect", str(dst), "--verify"],
                          capture_output=True, timeout=120).returncode == 0


def test_power_limits_past_any_float_and_a_watch_interval_past_a_day_are_one_line_errors(capsys):
    from edgeinfer.errors import InvalidArgumentError
    from edgeinfer.power.policy import Policy

    with pytest.raises(InvalidArgumentError, match="max_tokens_per_s must be a number"):
        Policy("balanced", max_tokens_per_s=10 ** 400)
    assert main(["power", "--watch", "--interval-s", "1e10"]) == 1
    assert "--interval-s must be a number of seconds in [0.1, 86400]" in capsys.readouterr().err
    assert main(["power", "--interval-s", "5"]) == 1  # ignored before: one reading, at once
    assert "--interval-s goes with --watch" in capsys.readouterr().err


def test_chat_help_is_not_a_message_and_json_does_not_go_with_stream(capsys):
    """/help (and /RESET in capitals) were sent to the model as prompts; --json with --stream was
    ignored (hostile review). power="off" loads as serve --power off does."""
    import edgeinfer

    argv = [sys.executable, "-m", "edgeinfer", "chat", "--max-tokens", "3"]
    r = subprocess.run(argv, input=b"/help\n/RESET\n/quit\n", capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0 and r.stdout.decode().replace("> ", "").strip() == "", (r.stdout, err)
    assert "/reset clears the context" in err.splitlines()[-2] and "(context cleared)" in err
    assert main(["generate", "Once", "--stream", "--json"]) == 1
    assert "does not go with --stream" in capsys.readouterr().err
    assert edgeinfer.load(power="off").power is None


def test_text_the_terminal_cannot_encode_prints_as_question_marks():
    """Under an ASCII or Latin-1 locale a reply holding U+2019 ended in a UnicodeEncodeError
    traceback, mid-reply with --stream, and ended `chat` (hostile CLI test)."""
    argv = [sys.executable, "-m", "edgeinfer", "generate", "Tom said", "--max-tokens", "40", "--seed", "3"]
    reply = subprocess.run(argv, capture_output=True, timeout=120).stdout.decode()
    assert any(ord(ch) > 127 for ch in reply)  # the reply does hold characters ASCII lacks
    for extra in ([], ["--stream"]):
        r = subprocess.run(argv + extra, capture_output=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "ascii"})
        assert r.returncode == 0 and r.stderr == b"", r.stderr
        assert r.stdout.decode("ascii") == reply.encode("ascii", "replace").decode()


@pytest.mark.parametrize("redirect", [">&-", "1</dev/null"])
def test_a_closed_or_read_only_standard_output_is_one_line(redirect):
    """`edgeinfer generate ... >&-` (Python's sys.stdout is None) and `1</dev/null` (EBADF) ended in
    tracebacks, with exit 1 either way (hostile CLI test)."""
    cmd = f'exec "{sys.executable}" -m edgeinfer generate Once --max-tokens 3 {redirect}'
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    _one_error_line(err, "cannot write the output")


@pytest.mark.parametrize("args", ["--version", "--help", "convert --help"])
@pytest.mark.parametrize("redirect", [">&-", "1</dev/null"])
def test_help_and_version_for_a_closed_standard_output_say_so_as_commands_do(args, redirect):
    """With `>&-` help and --version went to standard error and exited 0 (argparse hands its printer
    sys.stdout, None there; a hostile round); with `1</dev/null` they said so and exited 1, as a command
    does; and a closed `2>&-` keeps them where they belong."""
    r = subprocess.run(["sh", "-c", f'exec "{sys.executable}" -m edgeinfer {args} {redirect}'], capture_output=True,
                       timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    _one_error_line(err, "cannot write the output")
    r = subprocess.run(["sh", "-c", f'exec "{sys.executable}" -m edgeinfer {args} 2>&-'], capture_output=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.decode().startswith("edgeinfer 0." if args == "--version" else "usage:")


def test_dropping_a_standard_output_whose_descriptor_is_closed_leaves_it_on_devnull():
    """`_drop_stdout` closes the /dev/null descriptor it opened (one leaked per in-process call); with
    descriptor 1 already closed, the open hands back 1 itself, which must stay (a review)."""
    code = ("import os; from edgeinfer.cli import _drop_stdout; os.close(1); _drop_stdout(); "
            "import stat, sys; sys.stderr.write(str(stat.S_ISCHR(os.fstat(1).st_mode)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stderr.decode().endswith("True"), r.stderr


def test_a_closed_standard_error_keeps_errors_out_of_the_output():
    """With `2>&-`, Python's print(file=sys.stderr) falls back to standard output: the error line
    landed in the data a pipeline reads (hostile CLI test)."""
    cmd = f'exec "{sys.executable}" -m edgeinfer generate Once --max-tokens 0 2>&-'
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, timeout=120)
    assert r.returncode == 1 and r.stdout == b"", r.stdout


def _unreadable_pipe() -> int:
    """The write end of a pipe whose reader has gone (writes fail with EPIPE)."""
    r, w = os.pipe()
    os.close(r)
    return w


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="/dev/full, as Linux has")
def test_standard_error_that_cannot_be_written_does_not_end_the_command(tmp_path):
    """Standard error on a full disk, or a pipe whose reader has gone: convert's first progress line
    ended the conversion with no folder (its message blamed the destination's disk), chat died on its
    banner, and generate's note after a whole reply made its exit 1 (a hostile round). Diagnostics
    that cannot be written are dropped; the command does its work and exits 0."""
    from conftest import STORIES_SRC

    edgeinfer = [sys.executable, "-m", "edgeinfer"]
    for name, make_err in (("full", lambda: open("/dev/full", "w")), ("gone", _unreadable_pipe)):
        err = make_err()
        dst = tmp_path / name
        r = subprocess.run(edgeinfer + ["convert", str(STORIES_SRC), "-o", str(dst), "--quant", "int8"],
                           stdout=subprocess.PIPE, stderr=err, timeout=300)
        assert r.returncode == 0 and (dst / "edgeinfer.json").is_file() and r.stdout.startswith(str(dst).encode())
        r = subprocess.run(edgeinfer + ["generate", "Once", "--capacity", "8", "--max-tokens", "20", "--seed", "1"],
                           stdout=subprocess.PIPE, stderr=err, timeout=120)  # the note: the 8-token context filled
        assert r.returncode == 0 and len(r.stdout.split()) >= 4, r.stdout
        r = subprocess.run(edgeinfer + ["chat", "--max-tokens", "4", "--seed", "1"], input=b"Hello\nHi\n",
                           stdout=subprocess.PIPE, stderr=err, timeout=120)
        assert r.returncode == 0 and r.stdout.count(b"\n") == 2, r.stdout
        os.close(err) if isinstance(err, int) else err.close()


def test_a_failed_diagnostic_is_dropped_and_the_next_is_tried():
    """Standard error that fails once (a full disk freed again, a log rotated) goes on taking lines:
    a first version pointed it at /dev/null for good after one failure, and serve's log stayed empty
    for the rest of its life (a review). `settle` sends what is still buffered to /dev/null only when
    it cannot be written at the end."""
    from edgeinfer.cli import Diagnostics

    class Flaky:
        def __init__(self):
            self.lines, self.fail = [], True

        def write(self, text):
            if self.fail:
                raise OSError(28, "No space left on device")
            self.lines.append(text)
            return len(text)

        def flush(self):
            pass

    s = Flaky()
    d = Diagnostics(s)
    assert d.write("lost\n") == 5 and d.failed and s.lines == []
    s.fail = False
    d.write("kept\n")
    d.settle()  # flushes: nothing to send elsewhere
    assert s.lines == ["kept\n"]


def test_main_puts_back_only_what_it_changed(monkeypatch):
    """Called in process: a main() that finds the wrapper already there (another thread's main()) leaves
    it for that call to take away; a stdout it opened on /dev/null (started without one) is closed and
    None again, so that the next command that needs it is refused (a review)."""
    from edgeinfer.cli import Diagnostics

    outer = Diagnostics(sys.stderr)
    monkeypatch.setattr(sys, "stderr", outer)
    assert main(["power", "--interval-s", "5"]) == 1  # (refused: it goes with --watch)
    assert sys.stderr is outer
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["serve", "--port", "1", "--slots", "0"]) == 1  # refused before it listens: needs no stdout
    assert sys.stdout is None
    assert main(["power"]) == 1  # prints to stdout: refused, as before


def test_a_command_that_prints_nothing_runs_with_standard_output_closed(tmp_path):
    """`convert -q >&-` was refused ("standard output is closed") though -q prints nothing there (a
    hostile round); convert without -q still is: its summary would be lost."""
    from conftest import STORIES_SRC

    base = f'exec "{sys.executable}" -m edgeinfer convert "{STORIES_SRC}" --quant int8'
    r = subprocess.run(["sh", "-c", f'{base} -o "{tmp_path / "q"}" -q >&-'], capture_output=True, timeout=300)
    assert r.returncode == 0 and r.stderr == b"" and (tmp_path / "q" / "edgeinfer.json").is_file(), r.stderr
    r = subprocess.run(["sh", "-c", f'{base} -o "{tmp_path / "loud"}" >&-'], capture_output=True, timeout=300)
    assert r.returncode == 1 and not (tmp_path / "loud").exists()
    _one_error_line(r.stderr.decode(), "standard output is closed")


def test_generate_says_when_tokens_were_dropped_or_the_context_filled(capsys):
    """A prompt cut to fit the ring, or a reply that stopped because the ring filled (overflow error
    or truncate), printed the text and exit 0 with nothing to say so; only --json showed
    dropped_tokens (hostile CLI test). Now a note on standard error; none when nothing happened."""
    long = "Once upon a time there was a little girl named Lily. " * 20
    assert main(["generate", long, "--capacity", "32", "--overflow", "truncate", "--max-tokens", "4", "--seed", "1"]) == 0
    notes = [x for x in capsys.readouterr().err.splitlines() if x.startswith("edgeinfer: note: ")]
    assert len(notes) == 1 and "were dropped from the 32-token context" in notes[0], notes
    for extra in ([], ["--stream"]):
        assert main(["generate", "Once", "--capacity", "16", "--overflow", "error", "--max-tokens", "600",
                     "--ignore-eos", "--seed", "1", *extra]) == 0
        err = capsys.readouterr().err
        assert "edgeinfer: note: the reply stopped after" in err and "16-token context is full" in err, err
    assert main(["generate", "Once", "--max-tokens", "3", "--seed", "1"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal, as Linux has")
def test_chat_on_a_terminal_takes_a_line_longer_than_the_terminal_buffer(tmp_path):
    """Without readline, input() reads in the terminal's canonical mode, whose line buffer holds 4,095
    bytes: a pasted 10,000-character line was cut there without a word (hostile CLI test). The
    ring is too small for the line on purpose: the error states the whole line's token count."""
    import pty
    import select

    import edgeinfer

    line = "the cat sat on the mat and " * 370  # 9,990 characters
    n_line = len(edgeinfer.load().tokenizer.encode(line, add_bos=False))
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "chat", "--capacity", "64", "--overflow", "error"],
                            stdin=slave, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    try:
        seen = b""
        deadline = time.monotonic() + 60
        while b"> " not in seen:  # the prompt: readline reads from now on
            assert time.monotonic() < deadline, seen
            if select.select([master], [], [], 1)[0]:
                seen += os.read(master, 4096)
        for i in range(0, len(line), 1000):
            os.write(master, line[i:i + 1000].encode())
            time.sleep(0.01)
        os.write(master, b"\r")
        err = b""
        while b"does not fit" not in err:
            assert time.monotonic() < deadline, err
            if select.select([proc.stderr], [], [], 1)[0]:
                err += os.read(proc.stderr.fileno(), 4096)
        n = int(err.decode().split("prompt of ")[1].split()[0])
        assert n >= n_line, (n, n_line)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
        os.close(master)


def test_a_prompt_of_dash_is_read_from_standard_input_and_piped_chat_prints_no_prompts():
    """Hostile CLI test: `generate -` took "-" as the prompt, so a document could not be piped in
    (a command line holds 128 KiB at most); piped `chat` wrote its "> " prompts into the replies."""
    argv = [sys.executable, "-m", "edgeinfer", "generate", "-", "--max-tokens", "8", "--temperature", "0"]
    piped = subprocess.run(argv, input="Once upon a time".encode(), capture_output=True, timeout=120)
    given = subprocess.run(argv[:4] + ["Once upon a time"] + argv[5:], capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout == given.stdout and piped.stdout.strip(), piped.stderr
    bom = subprocess.run(argv + ["--json"], input="\ufeffOnce upon a time".encode(), capture_output=True, timeout=120)
    plain = subprocess.run(argv + ["--json"], input=b"Once upon a time", capture_output=True, timeout=120)
    assert bom.returncode == 0, bom.stderr
    (bom, plain) = ({k: v for k, v in json.loads(r.stdout).items() if k != "timings"} for r in (bom, plain))
    assert bom == plain and bom["usage"]["prompt_tokens"] == 5  # a BOM was 3 byte tokens of prompt
    bad = subprocess.run(argv, input=b"Once \xff", capture_output=True, timeout=120)
    assert bad.returncode == 1
    _one_error_line(bad.stderr.decode(), "standard input is not valid UTF-8")
    chat = subprocess.run([sys.executable, "-m", "edgeinfer", "chat", "--max-tokens", "3", "--seed", "1"],
                          input=b"hello\n/quit\n", capture_output=True, timeout=120)
    assert chat.returncode == 0 and b"> " not in chat.stdout and chat.stdout.strip(), chat.stdout


def test_negative_numbers_in_exponent_form_are_values(capsys):
    """A helper found `--presence-penalty -1e6` (the README's bound as written) refused: argparse took
    "-1e6" for a flag; "-5" and "-0.5" it knew."""
    for value in ("-1e6", "-2.5E+1", "-.5e-3"):
        assert main(["generate", "Once", "--presence-penalty", value, "--max-tokens", "2", "--seed", "1"]) == 0
        assert capsys.readouterr().err == ""


def test_a_warning_reads_as_one_cli_line(capsys):
    """The CLI printed Python's raw warning form, its source file and code line included (hostile
    round: `bench --capacity 500`); it is one `edgeinfer: warning:` line now, and library callers keep
    Python's form after main returns."""
    import warnings

    before = warnings.showwarning
    assert main(["bench", "--capacity", "500", "--runs", "1", "--prompt-tokens", "8", "--gen-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "edgeinfer: warning: capacity_tokens=500 leaves 12" in err
    assert "UserWarning" not in err and ".py:" not in err
    assert warnings.showwarning is before


def _sigint_default() -> None:
    """In the child: SIGINT as a terminal's program gets it. Tests started in the background (`cmd &`
    in a script) inherit it ignored, and Python keeps it so: the child then ran its 100,000 tokens."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_at_start_is_one_line_not_a_traceback():
    """Ctrl-C in the first ~0.4 s (while numpy and ONNX Runtime were imported, before main's handler
    was in place) printed a traceback (hostile round, 3 of 3 at 0.15-0.35 s); `import edgeinfer`
    and the CLI module now import neither, and main catches it from the parser on."""
    import signal

    light = subprocess.run([sys.executable, "-c", "import sys, edgeinfer, edgeinfer.cli; "
                            "print('numpy' in sys.modules, 'onnxruntime' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert light.stdout.split() == ["False", "False"], light.stderr
    for delay_s in (0.15, 0.25, 0.35):
        proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "generate", "Once upon a time", "--max-tokens",
                                 "100000", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # seconds
                                preexec_fn=_sigint_default)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert b"Traceback" not in err, (delay_s, err.decode())
        # 130 with its one line, or killed before Python's own handler was in place (-2)
        assert proc.returncode in (130, -signal.SIGINT), (delay_s, proc.returncode, err.decode())


def test_every_public_name_resolves_when_first_used():
    import edgeinfer

    assert all(getattr(edgeinfer, name) is not None for name in edgeinfer.__all__) and "load" in dir(edgeinfer)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        edgeinfer.nope  # noqa: B018


@pytest.mark.parametrize("cause,rc,says", [(KeyboardInterrupt(), 130, "edgeinfer: interrupted"),
                                          (SystemExit(143), 143, "")], ids=["ctrl_c", "sigterm"])
def test_an_interrupt_inside_a_compiled_import_is_a_quiet_exit(capsys, monkeypatch, cause, rc, says):
    """pybind11 turns an exception raised inside a compiled module's initialisation (ONNX Runtime's)
    into "ImportError: initialization failed" raised from it. A Ctrl-C was recognised; convert's SIGTERM
    handler's SystemExit was not (a hostile round): a 30-line traceback and rc 1, not 143."""
    import edgeinfer.cli_convert as cc

    def run(args):
        raise ImportError("initialization failed") from cause
    monkeypatch.setattr(cc, "run", run)
    assert main(["convert", "x", "-o", "y"]) == rc
    assert capsys.readouterr().err.strip() == says
    monkeypatch.setattr(cc, "run", lambda args: (_ for _ in ()).throw(ImportError("no module named x")))
    with pytest.raises(ImportError):
        main(["convert", "x", "-o", "y"])


@pytest.mark.parametrize("argv", [["eval", "-m", "", "--text", "t.txt"], ["eval", "-m", "m", "--text", ""],
                                  ["generate", "-m", "", "hi"], ["bench", "-m", ""], ["inspect", ""],
                                  ["serve", "-m", ""], ["convert", "", "-o", "out"], ["convert", "src", "-o", ""]])
def test_an_empty_path_is_a_usage_error(argv, capsys):
    """Path("") is "." (the current folder): `-m ""` was read as it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "an empty path" in capsys.readouterr().err


def test_every_public_name_states_its_contract():
    """help(edgeinfer.Model) stated nothing (no docstring), nor Conversation.say/reply/reset; the
    GenerationCancelled that cancel() raises was not exported (a hostile round)."""
    import inspect

    import edgeinfer
    assert edgeinfer.GenerationCancelled.__module__ == "edgeinfer.generation"
    for name in edgeinfer.__all__:
        obj = getattr(edgeinfer, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__doc__ or "").strip() and not obj.__doc__.startswith(f"{name}("), name
    for method in ("say", "stream_say", "reply", "reset"):
        assert getattr(edgeinfer.Conversation, method).__doc__, method


def _piped_chat(text: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeinfer", "chat", "--temperature", "0", "--max-tokens", "8"],
                          input=text, capture_output=True, timeout=120)


def test_piped_chat_takes_a_crlf_line_as_the_same_line():
    """A CRLF file's carriage return reached the model as part of each message: another reply (a
    hostile round: " Annabyaled" against " Anna, I'm")."""
    crlf, lf = _piped_chat(b"Hi there\r\nTell me more\r\n"), _piped_chat(b"Hi there\nTell me more\n")
    assert crlf.returncode == lf.returncode == 0 and crlf.stdout == lf.stdout and lf.stdout.strip(), crlf.stderr


def test_a_block_line_that_is_not_utf8_counts_as_refused():
    """Under a strict UTF-8 stdin a bad line inside a block is skipped, the block going on: that is a
    refusal too (the exit status said nothing of it)."""
    r = subprocess.run([sys.executable, "-m", "edgeinfer", "chat", "--temperature", "0", "--max-tokens", "8"],
                       input=b'"""\nOnce upon\nab\xff\n"""\n', capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})
    err = r.stderr.decode()
    assert r.returncode == 1 and "line skipped" in err and err.splitlines()[-1] == "edgeinfer: 1 input was refused (said above)"
    assert r.stdout.strip()  # the block's other lines were still answered (the strict decoder dropped them all)


def test_piped_chat_stops_on_ctrl_c_with_130_and_nothing_on_stdout():
    """Piped, Ctrl-C while chat waited for input wrote an empty line into the replies and the chat went
    on, exiting 0 (a hostile round); a script's interrupt now ends it as it ends `generate`."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "edgeinfer", "chat", "--max-tokens", "4"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    assert p.stderr.readline().startswith(b"edgeinfer chat: ")  # loaded; now waiting for a line
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and out == b"" and b"edgeinfer: interrupted" in err, (out, err)


def test_a_prompt_of_more_than_a_mib_on_stdin_is_refused_before_it_is_tokenized():
    """An 8 MB piped prompt took the tokenizer 1.6 GB, and under a memory limit the process aborted
    with no edgeinfer error line (a hostile round)."""
    argv = [sys.executable, "-m", "edgeinfer", "generate", "-", "--max-tokens", "2"]
    r = subprocess.run(argv, input=b"a b " * (1 << 18) + b"c", capture_output=True, timeout=120)
    assert r.returncode == 1
    _one_error_line(r.stderr.decode(), "standard input holds more than 1 MiB")


def test_piped_chat_flushes_each_reply_before_it_waits_for_the_next_line():
    """Read as bytes, the next line no longer went through input(), which flushes stdout: a script
    talking to chat over pipes waited for a reply's newline for ever (a review; hidden when
    PYTHONUNBUFFERED is set, so it is unset here)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.Popen([sys.executable, "-m", "edgeinfer", "chat", "--max-tokens", "4", "--seed", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        p.stdin.write(b"Hi\n")
        p.stdin.flush()
        done = threading.Event()
        threading.Timer(60, lambda: done.is_set() or p.kill()).start()
        line = p.stdout.readline()  # the whole reply line, while chat waits for more input
        done.set()
        assert line.endswith(b"\n") and line.strip(), line
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def test_piped_chat_drops_a_byte_order_mark_as_generate_does():
    """`\\ufeff/quit` was not /quit, and the BOM reached the model as part of the first message."""
    r = _piped_chat("\ufeff/quit\nnot seen\n".encode())
    assert r.returncode == 0 and r.stdout == b"", r.stdout
    bom, plain = _piped_chat("\ufeffOnce upon a time\n".encode()), _piped_chat(b"Once upon a time\n")
    assert bom.stdout == plain.stdout and plain.stdout.strip()


def test_a_block_whose_opening_line_is_not_utf8_is_skipped_whole():
    """A bad byte on a block's opening \"\"\" line skipped that line alone: the block's lines came as
    turns of their own and its closing \"\"\" opened a block that swallowed the next messages (a review)."""
    text = b'"""\xff intro\nline1\nline2\n"""\nOnce upon a time\n'
    r, alone = _piped_chat(text), _piped_chat(b"Once upon a time\n")
    err = r.stderr.decode()
    assert r.returncode == 1 and "the message it begins (to its closing \"\"\") skipped" in err, err
    assert r.stdout == alone.stdout and alone.stdout.strip()  # one reply: to the message after the block


def test_piped_chat_refuses_a_line_of_more_than_a_mib_and_answers_the_next():
    """Piped chat read a line whole however long it was: a 32 MB line was a MemoryError traceback under
    a 1.5 GB limit (a hostile round). A line over 1 MiB is read to its end in pieces and refused, as
    `generate -` refuses such a prompt; the next message is answered as if it came alone."""
    r, alone = _piped_chat(b"a b " * (1 << 19) + b"\nOnce upon a time\n"), _piped_chat(b"Once upon a time\n")
    err = r.stderr.decode()
    assert r.returncode == 1 and "the message is longer than 1 MiB" in err and "Traceback" not in err, err
    assert r.stdout == alone.stdout and alone.stdout.strip()


def _chat_said(monkeypatch, data: bytes, limit: int) -> tuple[int, list[str], str]:
    """Piped chat over `data` with messages of at most `limit` bytes: its status, the messages the
    conversation was given, and stderr."""
    import io

    from edgeinfer import cli_generate
    from edgeinfer.conversation import Conversation

    said = []
    real = Conversation.stream_say

    def stream_say(self, content, opts=None):
        said.append(content)
        return real(self, content, opts)

    monkeypatch.setattr(cli_generate, "MAX_MESSAGE_BYTES", limit)
    monkeypatch.setattr(Conversation, "stream_say", stream_say)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    return main(["chat", "--max-tokens", "1", "--seed", "1"]), said, err.getvalue()


def test_piped_chat_limits_a_line_and_a_block_to_the_message_size_exactly(monkeypatch):
    """At the limit a line or a block is a message; one byte over it is refused whole (read to its end:
    a block's lines, and a too long line that opens a block, are not taken as turns of their own)."""
    data = (b"x" * 16 + b"\r\n"                 # 16 bytes and a CRLF: taken
            + b"y" * 17 + b"\n"                 # 17: refused
            + b'"""\n' + b"z" * 7 + b"\n" + b"w" * 8 + b'\n"""\n'   # 7 + 1 + 8 = 16: taken
            + b'"""\n' + b"z" * 8 + b"\n" + b"w" * 8 + b'\n"""\n'   # 17: refused whole
            + b'"""' + b"v" * 20 + b"\nsecond line\n\"\"\"\n"      # an opening line over the limit: the block skipped
            + b'"""' + b"u" * 20 + b'"""\n'     # too long, but closed on its line: that line alone
            + b"after\n")
    status, said, err = _chat_said(monkeypatch, data, 16)
    assert said == ["x" * 16, "z" * 7 + "\n" + "w" * 8, "after"], said
    assert status == 1 and err.count("the message is longer than 0 MiB") == 4, err
    assert err.splitlines()[-1] == "edgeinfer: 4 inputs were refused (said above)"


@pytest.mark.parametrize("argv,stdin,needle", [(["generate", ""], b"", "the prompt is empty: give text"),
                                               (["generate", "-"], b"", "the prompt is empty: give text on standard input")])
def test_an_empty_prompt_is_refused_in_the_cli_s_words(argv, stdin, needle):
    """The library's refusal offered `[bos_id]`, a list of ids no command line can give (noticed in a hostile round)."""
    r = subprocess.run([sys.executable, "-m", "edgeinfer", *argv], input=stdin, capture_output=True, timeout=120)
    assert r.returncode == 1 and "bos_id" not in r.stderr.decode()
    _one_error_line(r.stderr.decode(), needle)


def test_a_padded_one_line_block_or_closing_line_over_the_limit_is_read_as_its_quotes_say(monkeypatch):
    """A review: a too long `\"\"\"...\"\"\"` line with more than 64 bytes of trailing blanks was taken as
    opening a block (only its last bytes were kept), which then swallowed the next turns unsaid; a
    closing `\"\"\"` padded past the limit did not close its block. A text stream's limit counted
    characters, not bytes."""
    data = (b'"""' + b"v" * 20 + b'"""' + b" " * 100 + b"\nturn1\n"
            + b'"""\nhi\n"""' + b" " * 40 + b"\nturn2\n"
            + "\u00e9".encode() * 9 + b"\n"     # 9 characters, 18 bytes: refused
            + "\u00e9".encode() * 8 + b"\n")    # 16 bytes: taken
    status, said, err = _chat_said(monkeypatch, data, 16)
    assert said == ["turn1", "hi", "turn2", "\u00e9" * 8], said
    assert status == 1 and err.count("the message is longer than") == 2, err


@pytest.mark.parametrize("swallowed", [False, True], ids=["numpy_import_error", "optional_import"])
def test_a_ctrl_c_during_the_imports_is_held_until_they_are_whole(monkeypatch, capsys, swallowed):
    """A hostile round's Ctrl-C 0.1-0.2 s after start landed inside numpy's compiled initialisation:
    numpy printed the KeyboardInterrupt's traceback and raised "ImportError: numpy._core.multiarray
    failed to import" without a cause (rc 1, 40 lines); one met in a library's optional import
    (`try: import x / except ImportError`) would be swallowed the same way. The imports now run with
    the interrupt held, raised once they are whole."""
    import signal

    import edgeinfer.cli as cli

    real = cli.build_parser

    def build_parser():
        try:
            signal.raise_signal(signal.SIGINT)  # the Ctrl-C, as a compiled module initialises
        except KeyboardInterrupt:
            if not swallowed:
                raise ImportError("numpy._core.multiarray failed to import") from None  # numpy drops the cause
        return real()

    monkeypatch.setattr(cli, "build_parser", build_parser)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored in tests started in the background)
    try:
        ran = []
        monkeypatch.setattr(cli, "_cmd_power", lambda args: ran.append(args) or 0)
        assert main(["power"]) == 130 and not ran
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr().err == "edgeinfer: interrupted\n"


def test_a_ctrl_c_lost_inside_the_clis_import_is_held_and_raised():
    """A Ctrl-C that lands in a weak reference's callback (the import machinery runs some) is printed
    as "Exception ignored" and lost, and `generate` runs on. The entry point now holds it over the
    CLI's import; simulated here by a finder that runs such a callback as edgeinfer.cli is imported."""
    code = """if True:
        import signal, sys, weakref

        class Finder:
            def find_spec(self, name, path=None, target=None):
                if name == "edgeinfer.cli":
                    class Lock: pass
                    lock = Lock()
                    ref = weakref.ref(lock, lambda r: signal.raise_signal(signal.SIGINT))
                    del lock  # the callback runs here: the Ctrl-C
                return None

        sys.meta_path.insert(0, Finder())
        from edgeinfer.__main__ import run
        sys.exit(run())
    """
    out = subprocess.run([sys.executable, "-c", code, "generate", "Once", "--max-tokens", "3"], capture_output=True,
                         text=True, timeout=60, preexec_fn=_sigint_default)
    assert (out.returncode, out.stderr.splitlines()[-1:]) == (130, ["edgeinfer: interrupted"]), out.stderr
    assert out.stdout == ""


def test_a_ctrl_c_as_the_finished_command_exits_changes_nothing():
    """A hostile round: a Ctrl-C in the last milliseconds (the interpreter's atexit handlers, weak
    references' callbacks) printed "Exception ignored ... KeyboardInterrupt" after a complete output,
    and could make the exit status -2. Once main has returned, the exit is the command's."""
    code = """if True:
        import atexit, signal, sys
        atexit.register(lambda: signal.raise_signal(signal.SIGINT))  # the Ctrl-C, as the interpreter exits
        from edgeinfer.__main__ import run
        sys.exit(run())
    """
    out = subprocess.run([sys.executable, "-c", code, "generate", "Once", "--max-tokens", "3", "--seed", "1"],
                         capture_output=True, text=True, timeout=60, preexec_fn=_sigint_default)
    assert out.returncode == 0 and out.stdout.strip() and "Traceback" not in out.stderr, out.stderr


def test_a_ctrl_c_as_the_interpreter_tears_its_modules_down_changes_nothing():
    """A hostile round: Python's finalization puts SIGINT's default handler back before it tears the
    modules down (~0.1 s after a `generate`), and a Ctrl-C then killed the process by the signal
    after a complete output (12 of 30 timed tries). The Ctrl-C here comes from an object freed in
    that teardown."""
    code = """if True:
        import os, signal, sys

        class KillAtTeardown:
            def __init__(self):
                self.kill, self.pid, self.sig = os.kill, os.getpid(), signal.SIGINT

            def __del__(self):
                self.kill(self.pid, self.sig)

        keep = KillAtTeardown()  # freed as the __main__ module is torn down
        from edgeinfer.__main__ import run
        sys.exit(run())
    """
    out = subprocess.run([sys.executable, "-c", code, "generate", "Once", "--max-tokens", "3", "--seed", "1"],
                         capture_output=True, text=True, timeout=60, preexec_fn=_sigint_default)
    assert out.returncode == 0 and out.stdout.strip() and "Traceback" not in out.stderr, (out.returncode, out.stderr)


def _ctrl_c_while_exiting(code: str, marker: str) -> tuple[int, float, str]:
    """Runs `code` (a program around `run`, a `generate`), waits for the line `marker` it prints as its
    exit waits, sends SIGINT; (exit status, seconds from the signal to the end, stderr)."""
    p = subprocess.Popen([sys.executable, "-c", code, "generate", "Once", "--max-tokens", "3", "--seed", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    assert p.stdout.readline()  # the completion
    assert p.stdout.readline() == marker + "\n"
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    err = p.communicate(timeout=20)[1]
    return p.returncode, time.monotonic() - t0, err


def test_a_ctrl_c_in_an_exit_hook_registered_after_the_cli_was_imported_ends_the_process_at_once():
    """A review: the teardown's fix ignored SIGINT from the first exit hook on, so a Ctrl-C while ONNX
    Runtime's exit hook waited for a graph call in flight (up to 10 s), or a program's own hook, did
    nothing. Only the teardown after the exit hooks ignores it now."""
    rc, seconds, err = _ctrl_c_while_exiting("""if True:
        import atexit, sys, time
        from edgeinfer.__main__ import run
        atexit.register(lambda: (print("hook", flush=True), time.sleep(30)))
        sys.exit(run())
    """, "hook")
    assert rc == 0 and seconds < 5, (rc, err)


def test_a_ctrl_c_while_the_exit_waits_for_a_worker_thread_ends_it_at_once():
    """A review: with SIGINT ignored after main, `serve`'s exit, which waits for its worker threads to
    finish their step, could not be cut short by Ctrl-C. It now ends the process at once, with main's
    exit status."""
    rc, seconds, err = _ctrl_c_while_exiting("""if True:
        import sys, threading, time
        from edgeinfer.__main__ import run
        rc = run()
        threading.Thread(target=time.sleep, args=(30,)).start()  # a worker the exit waits for
        print("waiting", flush=True)
        sys.exit(rc)
    """, "waiting")
    assert seconds < 5 and rc == 0 and "Traceback" not in err, (rc, err)


def test_running_out_of_memory_is_one_error_line(capsys, monkeypatch):
    """An allocation past a memory limit (the KV ring under `ulimit -v`, a hostile round) was numpy's
    40-line traceback; it is one line naming the size, exit 1."""
    from edgeinfer.kv_cache import RingKVCache

    def allocate(self, *args, **kwargs):  # numpy's own error (raised, not provoked: with memory over-committed
        raise MemoryError("Unable to allocate 4.00 TiB for an array with shape (4398046511104,) and data type "
                          "uint8")  # np.empty(2**42) succeeds)

    monkeypatch.setattr(RingKVCache, "__init__", allocate)
    assert main(["generate", "Once upon a time", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgeinfer: error: not enough memory: Unable to allocate 4.00 TiB"), err
    assert err[0].endswith("(a smaller --capacity or a smaller model needs less)"), err


@pytest.mark.parametrize("tty", [True, False])
def test_a_streamed_reply_cut_by_ctrl_c_ends_its_line_on_a_terminal_only(monkeypatch, capsys, tty):
    """A hostile round: Ctrl-C in `generate --stream` left "...little bo^Cedgeinfer: interrupted" on one
    line (chat ends the line first). A pipe or a file keeps the text as it was generated."""
    from edgeinfer import generation

    real, calls = generation.Generation.__next__, []

    def cut(self):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(generation.Generation, "__next__", cut)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    assert main(["generate", "Once upon a time", "--stream", "--max-tokens", "20", "--seed", "1"]) == 130
    out, err = capsys.readouterr()
    assert out.strip() and out.endswith("\n") == tty, out
    assert err == "edgeinfer: interrupted\n", err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal, as Linux has")
def test_a_terminal_that_goes_away_mid_reply_is_one_line_not_a_traceback():
    """A hostile round: with SIGHUP ignored (nohup, `trap '' HUP`, a supervisor) and stderr to a log, a
    closed terminal made the next write fail with EIO, which the CLI raised: a traceback in the log."""
    import pty
    import select
    import signal

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "generate", "Once upon a time", "--stream",
                             "--max-tokens", "100000", "--ignore-eos", "--seed", "1"],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    os.close(slave)
    try:
        seen, deadline = b"", time.monotonic() + 60
        while len(seen) < 200:  # the reply is streaming
            assert time.monotonic() < deadline and proc.poll() is None, seen
            if select.select([master], [], [], 1)[0]:
                seen += os.read(master, 4096)
    finally:
        os.close(master)  # the terminal goes away
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 1 and err.splitlines() == ["edgeinfer: error: cannot write the output: its terminal has gone"], err


def test_a_line_the_terminal_s_encoding_cannot_read_blames_the_encoding_not_the_text():
    """A hostile round: under PYTHONIOENCODING=ascii, "café" typed at chat's prompt was refused as "not
    valid UTF-8" (it is), while the same bytes piped in were taken."""
    from edgeinfer.cli_generate import _not_decoded

    with pytest.raises(UnicodeDecodeError) as typed:
        "café".encode().decode("ascii")
    assert _not_decoded(typed.value).startswith("the input cannot be read as ascii (ordinal not in range(128)): "
                                                "the terminal's encoding, from PYTHONIOENCODING or the locale")
    with pytest.raises(UnicodeDecodeError) as piped:
        b"caf\xe9!".decode("utf-8")
    assert _not_decoded(piped.value) == "the input is not valid UTF-8 (invalid continuation byte)"

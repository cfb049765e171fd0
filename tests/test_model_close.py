"""`Model.close()` and `with edgeinfer.load(...) as model:`: the model's memory goes at once (its
sessions, checked by weak references to ONNX Runtime's own objects, and its default ring), a stream
open at that moment stops at its next call, and everything that would run the model refuses with
ModelClosedError. References: plain generation's tokens before the close; the objects' lifetimes."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest

import edgeinfer
from conftest import STORIES_SRC
from edgeinfer.errors import EdgeInferError, ModelClosedError
from edgeinfer.model import default_model_path

PROMPT = "Once upon a time"


def freed(*refs: weakref.ref) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


REFUSALS = {
    "generate": lambda m: m.generate(PROMPT, max_new_tokens=2),
    "stream": lambda m: m.stream(PROMPT),
    "chat": lambda m: m.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2),
    "conversation": lambda m: m.conversation(),
    "snapshot": lambda m: m.snapshot(PROMPT),
    "restore": lambda m: m.restore("no-such-file.snapshot"),
    "set_draft": lambda m: m.set_draft(None),
}


def test_close_frees_the_sessions_and_the_default_ring_and_everything_then_refuses():
    m = edgeinfer.load()
    want = m.generate(PROMPT, max_new_tokens=8).text
    assert want
    refs = weakref.ref(m.session.session), weakref.ref(m.cache)
    m.close()
    m.close()  # idempotent
    assert m.closed and freed(*refs)
    for name, call in REFUSALS.items():
        with pytest.raises(ModelClosedError, match="closed"):
            call(m)
    assert m.encode_prompt(PROMPT) == edgeinfer.load().encode_prompt(PROMPT)  # tokenizing needs no session
    assert issubclass(ModelClosedError, EdgeInferError) and issubclass(ModelClosedError, RuntimeError)
    assert edgeinfer.ModelClosedError is ModelClosedError


def test_a_with_block_closes_the_model_even_when_it_raises():
    with pytest.raises(KeyError):
        with edgeinfer.load() as m:
            ref = weakref.ref(m.session.session)
            assert m.generate(PROMPT, max_new_tokens=2).usage.completion_tokens == 2
            raise KeyError("the caller's own error")
    assert m.closed and freed(ref)


def test_a_stream_open_at_close_stops_at_its_next_call_and_its_ring_goes_when_it_does():
    m = edgeinfer.load()
    plain = [c.token_id for c in m.stream(PROMPT, max_new_tokens=12, temperature=0)]
    g = m.stream(PROMPT, max_new_tokens=12, temperature=0)
    got = [next(g).token_id for _ in range(5)]
    assert got == plain[:5]
    ring = weakref.ref(g._request.cache)
    m.close()
    for _ in range(2):  # and again: the same error, not StopIteration
        with pytest.raises(ModelClosedError):
            next(g)
    assert ring() is not None  # the stream still holds it
    del g
    assert freed(ring)


def test_close_from_another_thread_stops_a_generation_in_flight():
    m = edgeinfer.load()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            m.generate(PROMPT, max_new_tokens=100_000, ignore_eos=True)  # through many ring re-bases
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while m.engine.calls < 50 and time.monotonic() < deadline:
        time.sleep(0.005)
    session = weakref.ref(m.session.session)
    m.close()
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ModelClosedError), errors
    assert freed(session)


def test_close_wakes_the_calls_waiting_for_a_context_that_a_paused_stream_holds():
    """Waiting for another thread's turn on the default context (generate, snapshot) or a
    conversation's (say) ends with ModelClosedError soon after close, not when the holder's paused
    stream is next advanced, which may be never (a hostile round: they waited until it was)."""
    m = edgeinfer.load()
    conv = m.conversation()
    held = {}

    def holder() -> None:  # another thread opens two streams and pauses them, as an app may keep one
        held["stream"] = m.stream(PROMPT, max_new_tokens=50)
        next(held["stream"])
        held["turn"] = conv.stream_say("Hi", max_new_tokens=50)
        next(held["turn"])

    t = threading.Thread(target=holder)
    t.start()
    t.join(30)
    results: dict[str, BaseException | str] = {}

    def call(name, f) -> None:
        try:
            f()
            results[name] = "returned"
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            results[name] = e

    waiters = [threading.Thread(target=call, args=(name, f), daemon=True) for name, f in (
        ("generate", lambda: m.generate("Lily", max_new_tokens=4)), ("snapshot", lambda: m.snapshot("Lily")),
        ("say", lambda: conv.say("And then?", max_new_tokens=4)))]
    for w in waiters:
        w.start()
    time.sleep(0.3)
    assert results == {}  # they wait their turn while the model is open
    m.close()
    for w in waiters:
        w.join(10)
    try:
        assert set(results) == {"generate", "snapshot", "say"}, results
        assert all(isinstance(e, ModelClosedError) for e in results.values()), results
        # but a reset, which a closed model allows (the ring is the conversation's), waits its turn and runs
        resetting = threading.Thread(target=call, args=("reset", conv.reset), daemon=True)
        resetting.start()
        time.sleep(0.3)
        assert "reset" not in results
    finally:
        held["stream"].close()
        held["turn"].close()
    resetting.join(10)
    assert results["reset"] == "returned" and conv.messages == []


def test_a_conversation_refuses_after_close_and_keeps_its_history():
    m = edgeinfer.load()
    c = m.conversation()
    c.say("Hi", max_new_tokens=4)
    history = [dict(x) for x in c.messages]
    m.close()
    with pytest.raises(ModelClosedError):
        c.say("And then?", max_new_tokens=4)
    with pytest.raises(ModelClosedError):
        c.reply(history + [{"role": "user", "content": "More"}], max_new_tokens=4)
    assert c.messages == history
    c.reset()  # its own ring: still its own to empty
    assert c.messages == []


def test_close_detaches_a_draft_and_stops_power_control(converted):
    m = edgeinfer.load(converted(STORIES_SRC, "fp32"), power="balanced")
    draft = m.set_draft(default_model_path())
    draft_session = weakref.ref(draft.session.session)
    del draft  # held by the target's engine alone
    thread = m.power._thread
    assert thread.is_alive()
    m.close()
    assert freed(draft_session) and not thread.is_alive()
    assert m.session.provider == "cpu"  # the description stays (the daemon's /health reads it)


def test_a_closed_draft_is_refused_and_one_closed_while_attached_is_named(converted):
    """A closed draft was taken, and every request of the open target then said "the model was
    closed" (a hostile round)."""
    m = edgeinfer.load(converted(STORIES_SRC, "fp32"))
    closed = edgeinfer.load(default_model_path())
    closed.close()
    with pytest.raises(edgeinfer.InvalidArgumentError, match="draft model was closed"):
        m.set_draft(closed)
    draft = m.set_draft(default_model_path())
    assert m.generate(PROMPT, max_new_tokens=8, temperature=0, speculative="draft").usage.completion_tokens == 8
    draft.close()
    with pytest.raises(edgeinfer.InvalidArgumentError, match="the draft model was closed"):  # (not ModelClosedError:
        m.generate(PROMPT, max_new_tokens=8, temperature=0, speculative="draft")  # the target is open)
    assert not m.closed
    m.set_draft(None)
    assert m.generate(PROMPT, max_new_tokens=8, temperature=0).usage.completion_tokens == 8


def test_a_draft_attached_as_the_target_closes_is_refused(converted, monkeypatch):
    """set_draft checked for a close only at its start, then attached the draft it had loaded to the
    closed model, keeping its session alive (a hostile round, 10 of 10). The attaching is under the
    engine's lock now."""
    from edgeinfer import model as model_module

    m = edgeinfer.load(converted(STORIES_SRC, "fp32"))
    sessions = []

    def close_meanwhile(target, draft):  # as a close from another thread lands while set_draft loads the draft
        sessions.append(weakref.ref(draft.session.session))
        m.close()
        check(target, draft)

    check = model_module.check_pair
    monkeypatch.setattr(model_module, "check_pair", close_meanwhile)
    with pytest.raises(ModelClosedError):
        m.set_draft(default_model_path())
    assert m.engine.draft is None and freed(*sessions)


def test_dropping_the_last_reference_still_frees_the_model_at_once():
    """The close machinery's per-thread mark once held the engine back (a cycle): a dropped Model's
    sessions then waited for the cycle collector (a review). Checked with the collector off."""
    gc.disable()
    try:
        m = edgeinfer.load()
        m.generate(PROMPT, max_new_tokens=4, speculative="ngram")
        refs = weakref.ref(m.session.session), weakref.ref(m.engine), weakref.ref(m.cache)
        del m
        assert all(r() is None for r in refs)
        with edgeinfer.load() as m:
            ref = weakref.ref(m.session.session)
        assert ref() is None
    finally:
        gc.enable()


def test_a_request_of_a_closed_target_says_closed_not_that_it_lacks_a_draft(converted):
    """Closing detaches the draft, and a draft request then said "needs a draft model" (400 in the
    daemon) instead of that the model was closed (a review)."""
    m = edgeinfer.load(converted(STORIES_SRC, "fp32"))
    m.set_draft(default_model_path())
    g = m.stream(PROMPT, max_new_tokens=8, temperature=0, speculative="draft")
    m.close()
    with pytest.raises(ModelClosedError, match="the model was closed"):
        next(g)


def test_a_ctrl_c_while_close_waits_leaves_it_whole():
    """A Ctrl-C while close() waited for a graph call left the model half closed: it said closed,
    but its session lived and the other thread's stream went on to its end (a hostile round, 3 of 4).
    Now the Ctrl-C is raised once close has finished."""
    m = edgeinfer.load()
    session = weakref.ref(m.session.session)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored in tests started in the background)
    try:
        m.engine.lock.acquire()  # a graph call in flight, as close sees it
        threading.Timer(0.2, signal.raise_signal, (signal.SIGINT,)).start()
        threading.Timer(0.6, m.engine.lock.release).start()
        with pytest.raises(KeyboardInterrupt):
            m.close()
    finally:
        signal.signal(signal.SIGINT, before)
    assert m.closed and freed(session)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
def test_close_from_a_signal_handler_in_the_generating_thread_does_not_hang():
    """The handler runs in the thread whose graph call holds the engine's lock: close() waited for that
    lock for ever (a hostile round: SIGTERM's handler, 9 of 10 runs hung). The close now completes as the
    call ends, and the generation raises ModelClosedError at its next call."""
    script = textwrap.dedent("""
        import gc, signal, sys, weakref
        import edgeinfer
        m = edgeinfer.load()
        session = weakref.ref(m.session.session)
        signal.signal(signal.SIGALRM, lambda *a: m.close())
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.0003)  # again and again: one lands inside a call
        try:
            m.generate("Once upon a time", max_new_tokens=100_000, ignore_eos=True)
        except edgeinfer.ModelClosedError:
            signal.setitimer(signal.ITIMER_REAL, 0)
            gc.collect()
            print("closed", session() is None)
            sys.exit(0)
        sys.exit(3)
    """)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split() == ["closed", "True"], (r.stdout, r.stderr)


def test_close_frees_both_sessions_of_a_portable_model(tmp_path):
    from edgeinfer.converters import convert

    convert(STORIES_SRC, tmp_path / "p", target="coreml", quant="fp32", capacity_tokens=64, prefill_tokens=16)
    m = edgeinfer.load(tmp_path / "p")
    assert m.generate(PROMPT, max_new_tokens=4).usage.completion_tokens == 4
    refs = weakref.ref(m.engine.session.session), weakref.ref(m.engine.prefill_session), weakref.ref(m.cache)
    m.close()
    assert freed(*refs)
    with pytest.raises(ModelClosedError):
        m.generate(PROMPT, max_new_tokens=2)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork() here")
def test_a_forked_child_closes_a_model_whose_engine_was_busy_at_the_fork():
    """In the child the engine's lock refuses (`fork_safety`: the thread that held it is not there);
    close() must not refuse with it, and the child must still exit."""
    script = textwrap.dedent("""
        import os, sys
        import edgeinfer
        m = edgeinfer.load()
        m.engine.lock.acquire()  # as a graph call in another thread holds it
        pid = os.fork()
        if pid == 0:
            m.close()
            try:
                m.generate("Once", max_new_tokens=2)
            except edgeinfer.ModelClosedError:
                sys.exit(0)
            sys.exit(3)
        m.engine.lock.release()
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), m.generate("Once", max_new_tokens=2).usage.completion_tokens)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "2"], (r.stdout, r.stderr)

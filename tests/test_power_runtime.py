"""Power control in the runtime: configuration errors, pacing caps the decode rate and is reported,
a core-count change mid-generation applies at the next token with identical greedy output."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest

import edgeinfer
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.power.policy import Policy
from edgeinfer.power.readings import Readings


class Switch:
    def __init__(self, readings: Readings):
        self.now = readings

    def read(self) -> Readings:
        return self.now


AC = Readings(battery_pct=80.0, on_ac=True)
BATTERY = Readings(battery_pct=80.0, on_ac=False)


@pytest.mark.parametrize("bad", ["turbo", "", 3, ["battery"], {"name": "battery"}])
def test_unknown_power_settings_are_refused_at_load(bad):
    with pytest.raises(InvalidArgumentError):
        edgeinfer.load(power=bad)


def test_no_power_control_by_default():
    m = edgeinfer.load()
    assert m.power is None and m.power_state() is None
    assert m.generate("Once", max_new_tokens=4).timings.paced_ms == 0.0


def test_pacing_caps_the_decode_rate_and_reports_the_time():
    m = edgeinfer.load(power=Policy("performance", max_tokens_per_s=100.0))
    c = m.generate("Once upon a time", max_new_tokens=25, temperature=0, ignore_eos=True)
    assert c.timings.decode_tok_s <= 100.0 * 1.02  # the schedule never releases faster than the cap
    assert c.timings.paced_ms > 0  # stories260K decodes far faster than 100 tok/s here
    free = edgeinfer.load().generate("Once upon a time", max_new_tokens=25, temperature=0, ignore_eos=True)
    assert c.token_ids == free.token_ids  # pacing changes when, never what
    st = m.power_state()
    assert st.plan.max_tokens_per_s == 100.0 and st.paced_s_total > 0


def test_cancelling_a_paced_stream_is_prompt():
    m = edgeinfer.load(power=Policy("performance", max_tokens_per_s=2.0))
    ev = threading.Event()
    gen = edgeinfer.Generation(m.engine, m.tokenizer, m.new_cache(), edgeinfer.GenerationOptions(),
                               "shift", begin=lambda req: m.encode_prompt("Once"), power=m.power, cancelled=ev)
    next(gen)  # first token: no wait yet
    threading.Timer(0.1, ev.set).start()
    import time
    t0 = time.monotonic()
    with pytest.raises(edgeinfer.generation.GenerationCancelled):
        for _ in gen:
            pass
    assert time.monotonic() - t0 < 0.45  # the 0.5 s pacing sleep was cut short


def test_a_model_stream_is_cancelled_from_another_thread():
    """Model.stream had no way to stop it from another thread (close() there is refused by Python
    while the generator runs; hostile review: a 1 tok/s stream ran on for 47 s). cancel() stops it
    at the next token, from inside the pacing sleep too, and the model is usable after."""
    import time

    m = edgeinfer.load(power=Policy("performance", max_tokens_per_s=2.0))
    gen = m.stream("Once", max_new_tokens=100, ignore_eos=True)
    next(gen)
    threading.Timer(0.1, gen.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(edgeinfer.generation.GenerationCancelled):
        for _ in gen:
            pass
    assert time.monotonic() - t0 < 0.45
    assert m.generate("Once", max_new_tokens=2, ignore_eos=True).usage.completion_tokens == 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and two cores")
def test_core_change_mid_generation_applies_at_the_next_token_and_keeps_the_output():
    m = edgeinfer.load(power=Policy("battery", hold_s=0.0))
    sensors = Switch(AC)
    m.power.sensors = sensors
    m.power.tick()
    n_all = m.power.cores.max_threads
    want = m.generate("Once upon a time", max_new_tokens=60, temperature=0, ignore_eos=True).token_ids
    cores_seen, ids = [], []
    gen = m.stream("Once upon a time", max_new_tokens=60, temperature=0, ignore_eos=True)
    try:
        for i, chunk in enumerate(gen):
            if chunk.token_id is None:
                continue
            ids.append(chunk.token_id)
            cores_seen.append(len(os.sched_getaffinity(0)))
            if i == 19:
                sensors.now = BATTERY  # the battery policy halves the cores on battery
                m.power.tick()
            elif i == 39:
                sensors.now = AC
                m.power.tick()
    finally:
        m.power.stop()
    assert tuple(ids) == want
    assert cores_seen[19] == n_all and cores_seen[20] == max(1, n_all // 2) and cores_seen[39] == max(1, n_all // 2)
    assert cores_seen[40] == n_all and cores_seen[-1] == n_all
    assert len(os.sched_getaffinity(0)) == n_all


def test_a_broken_sensor_mid_run_keeps_generating():
    m = edgeinfer.load(power=Policy("balanced", hold_s=0.0))

    class Dies:
        calls = 0

        def read(self):
            self.calls += 1
            if self.calls > 1:
                raise FileNotFoundError("/sys/class/thermal/thermal_zone0/temp vanished")
            return replace(AC, temp_c=50.0)

    m.power.sensors = Dies()
    m.power.tick()
    gen = m.stream("Once", max_new_tokens=30, temperature=0, ignore_eos=True)
    out = []
    for i, chunk in enumerate(gen):
        out.append(chunk)
        if i == 5:
            m.power.tick()  # the sensor is gone now: a warning and the safe plan
    assert gen.completion.usage.completion_tokens == 30
    assert "failed" in m.power.plan.reason
    m.power.stop()
    assert len(os.sched_getaffinity(0)) == m.power.cores.max_threads


def test_a_hot_plan_prefills_in_small_calls_only_where_the_reply_cannot_change():
    """A hot plan prefills in calls of 32 tokens. A prompt longer than the ring shifts it as it enters,
    and rows then attend to what the ring holds at their call, so other-sized calls give another reply
    (18 of 30 differed on fp32 at a 128-token ring, hostile round): such a prompt keeps the model's own
    calls, and a hot device replies as a cool one does. A prompt that fits takes the small calls."""
    from pathlib import Path

    from edgeinfer.power.policy import HOT_PREFILL_CHUNK

    text = (Path(__file__).resolve().parent / "fixtures" / "stories260K" / "eval.txt").read_text().split("\n")
    cool = edgeinfer.load(capacity_tokens=128)
    hot = edgeinfer.load(capacity_tokens=128, power=Policy("balanced", hold_s=0.0))
    hot.power.sensors = Switch(Readings(temp_c=90.0))
    hot.power.tick()  # hot and idle: the floor's 1 tok/s cap, which would only slow the test (138 s), so
    hot.power.stop()  # the plan is kept (no later tick) less its cap: this test is about prefill calls
    hot.power.plan = replace(hot.power.plan, max_tokens_per_s=None)
    try:
        assert hot.power_state().plan.prefill_chunk == HOT_PREFILL_CHUNK
        calls = []
        real = hot.engine.forward
        hot.engine.forward = lambda cache, ids, *a, **k: (calls.append(len(ids)), real(cache, ids, *a, **k))[1]
        stories = [ids[:300] for ids in map(cool.tokenizer.encode, text) if len(ids) >= 300][:6]
        assert len(stories) == 6
        for ids in stories:
            want = cool.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
            calls.clear()
            assert hot.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True).token_ids == want
            assert max(calls) > HOT_PREFILL_CHUNK  # the ring shifted: the model's own calls
        calls.clear()
        hot.generate(ids[:100], max_new_tokens=2, temperature=0, ignore_eos=True)
        assert max(calls) == HOT_PREFILL_CHUNK and sum(calls[:-1]) == 100  # it fits: calls of 32
    finally:
        hot.engine.__dict__.pop("forward", None)  # no cycle through the engine left for a later fork's child
        hot.power.stop()


def _in_a_child(child, seconds: float = 60.0) -> int:
    """Run `child()` (True: success) in a forked child; its exit code, or -1 when it had to be killed
    (a hang fails the test instead of blocking the suite). Garbage is collected first: an ONNX Runtime
    session freed in a child waits for the parent's threads for ever."""
    import gc
    import signal
    import time

    gc.collect()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_samples_its_sensors_again():
    """fork() copies only the calling thread: the child's controller had no sampling thread and kept
    the plan of the fork's moment (hot and paced in a child long cooled; hostile round). It samples
    again in the child once a generation there uses it, and the parent's goes on."""
    import time

    m = edgeinfer.load(power=Policy("balanced", hold_s=0.0))
    sensors = Switch(Readings(temp_c=95.0))
    m.power.sensors = sensors
    m.power.tick()
    assert m.power_state().plan.level == "hot"

    def child() -> bool:
        sensors.now = Readings(temp_c=40.0)
        if m.generate("Once", max_new_tokens=2).usage.completion_tokens != 2:  # its first use here
            return False
        deadline = time.monotonic() + 10
        while m.power_state().plan.level != "cool" and time.monotonic() < deadline:
            time.sleep(0.05)
        return m.power_state().plan.level == "cool"

    try:
        assert _in_a_child(child) == 0
        assert m.power._thread.is_alive() and m.power_state().plan.level == "hot"  # the parent's, unchanged
    finally:
        m.power.stop()


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(os, "sched_setaffinity"), reason="needs fork, affinity")
@pytest.mark.parametrize("then", ["generate", "set_policy", "stop", "new_model"])
def test_a_forked_child_is_not_held_by_a_lock_the_lost_thread_held(then):
    """A thread that held the controller's lock and the core limit's mid-apply (applied = -1) at the
    fork does not exist in the child: a generation, a policy change, stop() and a new Model under
    power control there waited on those locks for ever (review). They are reset in the child."""
    m = edgeinfer.load(power=Policy("balanced", hold_s=0.0))
    held, release = threading.Event(), threading.Event()

    def hold():
        with m.power._lock, m.power.cores._lock, type(m.power.cores)._shared_lock:
            m.power.cores.applied = -1  # as `apply` leaves it while it moves the threads
            held.set()
            release.wait()

    def child() -> bool:
        if then == "generate":
            return m.generate("Once", max_new_tokens=3).usage.completion_tokens == 3
        if then == "set_policy":
            return m.power.set_policy(Policy("battery")).threads >= 1
        if then == "stop":
            m.power.stop()
            return True
        other = edgeinfer.load(power=Policy("balanced"))
        return other.generate("Once", max_new_tokens=2).usage.completion_tokens == 2

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    try:
        assert _in_a_child(child, 30) == 0
    finally:
        release.set()
        t.join()
        m.power.stop()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_stream_opened_before_a_fork_follows_the_childs_sensors():
    """A stream the forking thread had open goes on in the child (tests/test_concurrency.py); its
    pacer was made in the parent, and it kept the fork's plan (review). Its steps sample again."""
    import time

    m = edgeinfer.load(power=Policy("balanced", hold_s=0.0))
    sensors = Switch(Readings(temp_c=95.0))
    m.power.sensors = sensors
    m.power.tick()
    gen = m.stream("Once upon a time", max_new_tokens=400, temperature=0, ignore_eos=True)
    next(gen)

    def child() -> bool:
        sensors.now = Readings(temp_c=40.0)
        deadline = time.monotonic() + 10
        for _ in gen:
            if m.power.plan.level == "cool" or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return m.power.plan.level == "cool"

    try:
        assert _in_a_child(child) == 0
    finally:
        gen.close()
        m.power.stop()

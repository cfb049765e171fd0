"""`PowerController`: samples the sensors off the token path, decides, and applies the plan between
tokens; `Pacer`: one generation's side of it.

Lifetimes: a controller lives as long as its Model. Its sampling thread (a daemon, 2 Hz by
default) reads the sensors, calls `decide` and stores the Plan; the token path only reads that one
attribute. A Pacer lives for one generation and runs once before each decode step:
1. Apply the plan's core count if it differs from the one in force (`CoreLimit.apply`: effective
   from this step).
2. Sleep until this step's release time under the plan's cap (release_k >= release_(k-1) + 1/cap,
   release 0 being the first call, right after the first token), at most 1 s, waking at once if
   the request is cancelled. A wait under `MIN_SLEEP_S` is not slept but carried: the schedule
   stays exact and a later step sleeps it, since a short sleep overshoots by as much as it lasts.
   The schedule restarts from now only after a step later than a period and `LATE_S` (a stall:
   no burst makes up for it).
3. Report the previous step's compute time (release to this call, sleeps excluded), from which the
   controller knows the unpaced rate that `decide` needs.

Failure: a sensor read or a policy that raises gives `safe_plan` and one logged warning per distinct
message; nothing on the token path can raise from here.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import re
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace

from edgeinfer.errors import InvalidArgumentTypeError, ModelClosedError
from edgeinfer.power.policy import MIN_TOKENS_PER_S, Load, Plan, Policy, decide, safe_plan
from edgeinfer.power.readings import Readings
from edgeinfer.power.threads import CoreLimit

log = logging.getLogger("edgeinfer.power")

DEFAULT_INTERVAL_S = 0.5
TEMP_MEDIAN_OF = 5  # readings a temperature is the median of (2 s at the default interval)
UNENFORCED_AFTER = 3  # readings without a field before its limit is said to be unenforced
MAX_SLEEP_S = 1.0 / MIN_TOKENS_PER_S
MIN_SLEEP_S = 0.001  # the pacer sleeps only when this far ahead of its schedule (sleeps wake ~0.1-0.3 ms late)
_TRAILING_REPR = re.compile(r"""(?<= )(['"]).*\1$""")  # what a sensor file or command said, as a reader quotes it
MAX_WARNING_KINDS = 100  # logged once each, for the sensors' warnings and, apart, for the controller's own
_WARN_LOCK = threading.Lock()  # a kind counted and added at once (a controller's `warned` may be shared)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
FIRST_READ_S = 10.0  # `start` waits this long for the first plan (a Jetson's nvpmodel may take its 5 s timeout)
STALE_PLAN_S = 60.0  # a plan this old while sampling runs: a sensor read is stuck (`PowerController.state`)
LATE_S = 0.005  # a step later than this (or a period, if longer) restarts the schedule instead of catching up


@dataclass(frozen=True)
class PowerState:
    """`Model.power_state()`: the last readings and plan, the policy, and what is in force."""
    policy: Policy
    readings: Readings | None
    plan: Plan | None
    threads_applied: int
    paced_s_total: float  # seconds the pacers have slept, all generations together
    plan_age_s: float | None = None  # since the plan (and its readings) was made; None before the first

    def as_dict(self) -> dict:
        return {"policy": self.policy.name, "readings": self.readings.as_dict() if self.readings else None,
                "plan": self.plan.as_dict() if self.plan else None, "threads_applied": self.threads_applied,
                "paced_s_total": round(self.paced_s_total, 3),
                "plan_age_s": None if self.plan_age_s is None else round(self.plan_age_s, 1)}


RECENT_STEPS = 8  # steps a sparse window's rates are read from
RECENT_STEPS_S = 60.0  # and how old they may be
DENSE_STEPS = 4  # a window with this many steps gives its own rates


def _rates(steps: int, compute_s: float, span: float, recent: list, now: float, interval_s: float,
           previous: tuple) -> tuple[float | None, float | None]:
    """(paced, unpaced) decode tok/s for a plan, or (None, None) when idle. A window of DENSE_STEPS
    or more steps gives its own; a sparser one (slow decoding: paced under a few tok/s, or seconds of
    compute per token on a big model) reads the last steps' spacing and compute instead: one step in a
    0.5 s window read as 2 tok/s at 0.33, and a window with none read as idle between two steps (a
    review). Idle: no step for three of the last gaps between steps, and at least the slowest pace
    plus two sampling intervals."""
    if steps >= DENSE_STEPS:
        return steps / span, steps / compute_s if compute_s > 0 else None
    if not recent:
        return None, None
    gap = recent[-1][0] - recent[-2][0] if len(recent) >= 2 else 0.0
    if now - recent[-1][0] > max(MAX_SLEEP_S + 2 * interval_s, 3 * gap):
        return None, None
    if len(recent) < 2:  # the first step of a generation: this window's rate, or the last one's
        return (steps / span, steps / compute_s if compute_s > 0 else None) if steps else previous
    total = sum(c for _, c in recent)
    return (len(recent) - 1) / max(recent[-1][0] - recent[0][0], 1e-9), (len(recent) / total if total > 0 else None)


class PowerController:
    def __init__(self, policy: Policy, sensors, cores: CoreLimit | None = None, *,
                 interval_s: float = DEFAULT_INTERVAL_S, clock=time.monotonic, sleep=time.sleep,
                 warned: set[str] | None = None):
        """sensors: anything with `read() -> Readings` (`power.sensors.Sensors`, or a simulation's).
        warned: the kinds of warning already logged, shared by controllers reading one set of sensors
        (`power --watch`'s, one per policy, logged each sensor warning four times)."""
        self.policy, self.sensors = policy, sensors
        self.cores = cores if cores is not None else CoreLimit.shared()
        self.interval_s, self.clock, self.sleep = float(interval_s), clock, sleep
        self.readings: Readings | None = None
        self._temps: deque = deque(maxlen=TEMP_MEDIAN_OF)  # the last temperatures read, for `_smoothed`
        self._reads, self._seen = 0, set()  # readings taken, and which fields were ever read (`_say_unenforced`)
        self.plan: Plan | None = None
        self._planned_at: float | None = None  # clock() of the last tick's plan
        self.paced_s_total = 0.0
        self._lock = threading.Lock()  # the step statistics
        self._steps, self._compute_s, self._window_start = 0, 0.0, clock()
        self._recent: deque = deque(maxlen=RECENT_STEPS)  # (clock(), compute s) of the last steps
        self._rates: tuple[float | None, float | None] = (None, None)  # (paced, unpaced) tok/s in force
        self._warned: set[str] = warned if warned is not None else set()
        self._stop = threading.Event()
        self.stopped = False  # `stop` was called (the Model closed): no core limit is applied again
        self._stop_lock = threading.Lock()  # `stopped` and the limit it forbids, set together
        self._thread: threading.Thread | None = None
        self._forks_seen = _FORKS[0]  # the forks its sampling thread belongs to (`_own_process`)
        _CONTROLLERS.add(self)

    # --- the sampling side (off the token path) ---
    def tick(self) -> Plan:
        """Read the sensors, decide, store and apply the plan; return it. Never raises."""
        now = self.clock()
        with self._lock:
            steps, compute_s, span = self._steps, self._compute_s, max(now - self._window_start, 1e-9)
            self._steps, self._compute_s, self._window_start = 0, 0.0, now
            recent = [(t, c) for t, c in self._recent if now - t <= RECENT_STEPS_S]
        self._rates = _rates(steps, compute_s, span, recent, now, self.interval_s, self._rates)
        load = Load(max_threads=self.cores.max_threads, tokens_per_s=self._rates[0],
                    unpaced_tokens_per_s=self._rates[1])
        try:
            readings = replace(self.sensors.read(), time_s=now)  # one clock for plans and pacing
            for w in readings.warnings:
                self._warn(f"sensor: {w}", sensor=True)
            self._say_unenforced(readings)
            plan = decide(self._smoothed(readings), self.policy, load, self.plan)
        except Exception as e:  # a reader or the policy failed: run safe, say it once
            self._warn(f"power control failed ({type(e).__name__}: {e}); running the safe plan",
                       kind=f"power control failed ({type(e).__name__})")  # (its text may change each time)
            readings, plan = self.readings, safe_plan(load, f"power control failed: {type(e).__name__}",
                                                       self.policy, self.plan)
        self.readings, self.plan, self._planned_at = readings, plan, now
        if plan.threads != self.cores.applied:
            self._apply(plan.threads)
        return plan

    def _apply(self, threads: int) -> None:
        """Confine the process to `threads` cores, unless stopped: after `stop` (the Model closed) a
        limit set by a tick, a policy change or an open stream's next step stayed on the whole process
        for good, nothing ticking to lift it (a model loaded later ran on one core: a hostile round)."""
        with self._stop_lock:  # (checked and applied under the lock `stop` takes: a tick between its check and
            if not self.stopped:  # its apply could set a limit after `stop` gave the cores back; a review)
                self.cores.apply(threads)

    def _smoothed(self, r: Readings) -> Readings:
        """What a plan decides on: temp_c the median of the last TEMP_MEDIAN_OF temperatures read (a
        missed read or a NaN skipped, not a reset), so that a sensor glitch (52 -> 100 -> 52 °C in half
        a second; a real die does not jump 68 °C) does not throttle decoding to 1 token/s for the
        plan's hold time; a real rise shows after TEMP_MEDIAN_OF // 2 + 1 samples. Samples older than
        2 * TEMP_MEDIAN_OF intervals are left out (after a minute of unreadable values a plan's reason
        quoted a temperature read 40 s before: a hostile round). A reading at or past the device's
        critical point acts at once: there, a false alarm costs less than a late one."""
        t = r.temp_c
        if t is None or not math.isfinite(t):
            return replace(r, temp_c=None)
        self._temps.append((r.time_s, t))
        if r.critical_temp_c is not None and t >= r.critical_temp_c:
            return r
        fresh = sorted(x for at, x in self._temps if 0 <= r.time_s - at <= TEMP_MEDIAN_OF * 2 * self.interval_s)
        return replace(r, temp_c=fresh[len(fresh) // 2])

    def _say_unenforced(self, r: Readings) -> None:
        """Say once a limit that no sensor of this device can enforce: one that has never been read in
        the first UNENFORCED_AFTER readings (a missed read now and then is not a missing sensor)."""
        self._reads += 1
        for limit, reading, what in (("max_temp_c", "temp_c", "temperature"), ("power_budget_w", "power_w", "power draw"),
                                     ("min_battery_pct", "battery_pct", "battery level")):
            if getattr(r, reading) is not None:
                self._seen.add(reading)
            elif (getattr(self.policy, limit) is not None and reading not in self._seen
                  and self._reads >= UNENFORCED_AFTER):
                self._warn(f"{limit} is not enforced: no {what} can be read on this device")
        if self.policy.max_temp_c is None and "temp_c" not in self._seen and self._reads >= UNENFORCED_AFTER:
            self._warn(f"the {self.policy.name} policy paces nothing for heat: no temperature can be read on this device")

    def set_policy(self, policy: Policy) -> Plan:
        """Switch policy now (e.g. the user changed a limit); the next plan is decided at once.
        ModelClosedError once stopped (its Model closed)."""
        if self.stopped:
            raise ModelClosedError("the model was closed, and its power control stopped with it")
        self._own_process()
        if not isinstance(policy, Policy):
            raise InvalidArgumentTypeError(f"set_policy takes a Policy, got {type(policy).__name__}")  # (a TypeError)
        self.policy, self.plan = policy, None
        return self.tick()

    def _warn(self, message: str, sensor: bool = False, kind: str | None = None) -> None:
        """Log `message` once per kind, up to MAX_WARNING_KINDS kinds of the sensors' warnings and as many
        of the controller's own: a sensor's cannot crowd out "power control failed" (hostile rounds: a
        reading of 151.000, 151.001, ... °C, then garbage text that changed at every read, filled the
        kinds, and the controller's own failure was never said). Numbers make no other kind, nor does
        the text a sensor's warning quotes at its end (`kind`: the caller's, for a message whose text may
        change). Thread-safe: the sampling thread, `start`, a pacer and /health warn."""
        if kind is None:
            kind = _NUMBER.sub("#", message)
            if sensor:
                kind = _TRAILING_REPR.sub("'…'", kind)
        with _WARN_LOCK:
            if kind in self._warned or sum(k.startswith("sensor: ") == sensor
                                           for k in self._warned) >= MAX_WARNING_KINDS:
                return
            self._warned.add(kind)
        log.warning("edgeinfer power: %s", message)

    def start(self) -> "PowerController":
        """Sample now and every interval_s on a daemon thread (started again in a forked child when a
        generation there first uses it: `_own_process`), waiting for the first plan up to FIRST_READ_S:
        a read that blocks longer (a hung sensor file) leaves the safe plan in force until it returns,
        said once (it hung `load` and `serve` for good: a hostile round). ModelClosedError once stopped."""
        if self.stopped:
            raise ModelClosedError("the model was closed, and its power control stopped with it")
        first = threading.Event()
        self._spawn(first_wait=False, first_done=first)
        if not first.wait(FIRST_READ_S):
            self._warn(f"the first sensor reading has not returned in {FIRST_READ_S:g} s: running the safe plan "
                       "until it does")
            load = Load(max_threads=self.cores.max_threads, tokens_per_s=None, unpaced_tokens_per_s=None)
            plan = safe_plan(load, "no sensor reading yet", self.policy, None)
            with self._lock:
                if self.plan is None:  # (the reading may have come meanwhile)
                    self.plan, self._planned_at = plan, self.clock()
                    self._apply(plan.threads)
        return self

    def _own_process(self) -> None:
        """fork() copies only the thread that called it: in a child the sampling thread is gone, and the
        plan of the fork's moment would stay (a child forked while hot stayed paced when cool; hostile
        round). The first use after a fork (a generation's pacer or step, a state query, a policy
        change) samples again; the locks that thread may have held were reset by `_reset_locks_in_child`
        inside fork() itself, which starts no thread (one started there let the collector free an ONNX
        Runtime session, which hangs: review). Each check compares a counter, no system call."""
        if self._forks_seen == _FORKS[0]:
            return
        with _RESPAWN:  # two threads of the child: one starts the thread; the count is set last
            if self._forks_seen != _FORKS[0]:
                if self._thread is not None and not self._stop.is_set():
                    self._stop = threading.Event()
                    self._planned_at = self.clock()  # the parent's plan, from now: not "stuck" before a tick
                    self._spawn(first_wait=False)
                self._forks_seen = _FORKS[0]

    def _spawn(self, first_wait: bool, first_done: threading.Event | None = None) -> None:
        ref, stop, interval = weakref.ref(self), self._stop, self.interval_s

        def loop() -> None:  # holds the controller only while ticking, so a dropped Model ends it
            wait = first_wait
            while not (stop.wait(interval) if wait else stop.is_set()):
                wait = True
                c = ref()
                if c is None:
                    return
                c.tick()
                del c
                if first_done is not None:
                    first_done.set()

        self._thread = threading.Thread(target=loop, name="edgeinfer-power", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._stop_lock:
            self.stopped = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._stop_lock:
            self.cores.apply(self.cores.max_threads)

    def __del__(self):  # a dropped Model: stop sampling, give the process its cores back
        self._stop.set()
        try:
            self.cores.apply(self.cores.max_threads)
        except Exception:
            pass

    def state(self) -> PowerState:
        """The last readings and plan, and how old they are. A plan older than STALE_PLAN_S while sampling
        runs means a sensor read is stuck (a wedged i2c or hwmon read blocks the sampling thread, and
        no file read can time out): the plan in force stays as it was, and the log says so once."""
        self._own_process()
        return PowerState(self.policy, self.readings, self.plan, self.cores.applied, self.paced_s_total,
                          self._plan_age_s())

    def _plan_age_s(self) -> float | None:
        """Seconds since the plan in force was made (None before the first); past STALE_PLAN_S while the
        sampling thread runs, the log says once that a read is stuck. Checked where a state is read
        and where a generation begins (`pacer`), so a CLI chat that never reads a state says it too."""
        age = None if self._planned_at is None else self.clock() - self._planned_at
        if age is not None and age > max(STALE_PLAN_S, 20 * self.interval_s) and self._thread is not None \
                and self._thread.is_alive():
            self._warn("the sensors have not answered for over a minute (a read is stuck?): the plan in force is "
                       "that old; /health's power.plan_age_s says how old")
        return age

    def admits_background(self) -> bool:
        self._own_process()
        plan = self.plan
        return plan is None or plan.admit_background

    # --- the token side ---
    def record_step(self, compute_s: float) -> None:
        with self._lock:
            self._steps += 1
            self._compute_s += compute_s
            self._recent.append((self.clock(), compute_s))

    def pacer(self, cancelled: threading.Event | None = None) -> "Pacer":
        self._own_process()
        self._plan_age_s()
        return Pacer(self, cancelled)


class Pacer:
    """One generation's pacing (see the module doc). `paced_s`: the seconds it slept."""

    def __init__(self, controller: PowerController, cancelled: threading.Event | None = None):
        self.c, self.cancelled = controller, cancelled
        self.paced_s = 0.0
        self._release: float | None = None  # when the previous step was released (the schedule)
        self._started: float | None = None  # when it actually started

    @property
    def prefill_chunk(self) -> int | None:
        plan = self.c.plan
        return plan.prefill_chunk if plan is not None else None

    def pace(self) -> None:
        """Run right before each decode step."""
        c = self.c
        c._own_process()  # a stream opened before a fork and continued in the child
        plan = c.plan
        if plan is not None and plan.threads != c.cores.applied:
            c._apply(plan.threads)
        clock = c.clock
        now = clock()
        if self._started is not None:
            c.record_step(now - self._started)
        cap = plan.max_tokens_per_s if plan is not None else None
        if self._release is None:  # the first decode step: the token before it (prefill's) is release 0
            self._release = now
        if cap:
            period = 1.0 / cap
            target = self._release + period
            wait = min(target - now, MAX_SLEEP_S)
            if wait >= MIN_SLEEP_S:  # a shorter wait is carried to later steps: a short sleep overshoots as much
                if self.cancelled is not None and c.sleep is time.sleep:  # cancel() wakes it at once
                    self.cancelled.wait(wait)
                else:  # a simulation's clock (or no cancel event): its own sleep, as given
                    c.sleep(wait)
                after = clock()
                self.paced_s += after - now
                with c._lock:
                    c.paced_s_total += after - now
                now = after
            # on schedule, or late by less than a sleep's overshoot: keep it (the next steps catch up); later
            # (a stall): restart it from now, so that no burst makes up for the stall
            self._release = target if now - target < max(period, LATE_S) else now
        else:
            self._release = now
        self._started = now

    def finish(self) -> None:
        """Run after the last decode step: it counts as the others do at the next `pace` (a request of
        two tokens, one step, gave no rate, and a plan waiting for one held its cap for good: a review)."""
        if self._started is not None:
            self.c.record_step(self.c.clock() - self._started)
            self._started = None


_CONTROLLERS: "weakref.WeakSet[PowerController]" = weakref.WeakSet()
_RESPAWN = threading.Lock()  # `_own_process`: one thread of a child starts the sampling thread
_FORKS = [0]  # forks this process descends from (a list: the hook changes it in place)


def _reset_locks_in_child() -> None:
    """Inside fork(), in the child: the locks the parent's other threads may have held (a sampling
    thread inside `tick`, a core limit mid-`apply`) are reset in place and the fork counted. Nothing
    is allocated and the collector is held off: what runs inside fork() must not free an ONNX Runtime
    session (that waits for the parent's threads for ever). `_own_process` does the rest later. The
    child gets the cores its parent's plan held back (an app's worker process kept one core for good;
    a hostile round): a controller it uses applies its plan again at its next reading."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        _FORKS[0] += 1
        _RESPAWN._at_fork_reinit()
        _WARN_LOCK._at_fork_reinit()
        CoreLimit._shared_lock._at_fork_reinit()
        for ref in _CONTROLLERS.data:
            c = ref()
            if c is not None:
                c._lock._at_fork_reinit()
                c._stop_lock._at_fork_reinit()
                c._stop._at_fork_reinit()  # its condition's lock: the lost thread waited on it
                c.cores._lock._at_fork_reinit()
        shared = CoreLimit._shared
        if shared is not None and shared.supported and shared.applied != len(shared.cores):
            try:
                os.sched_setaffinity(0, shared.cores)  # (the child's one thread: the process's all)
                shared.applied = len(shared.cores)
            except OSError:
                pass
    finally:
        if enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_locks_in_child)

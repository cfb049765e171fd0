"""Policies and the pure `decide(readings, policy, load, previous) -> Plan`.

A `Plan` says how the runtime should run until the next one: how many cores, a cap on decode
tokens/s (pacing), the prefill chunk, whether background work is admitted, and why. `decide` is a
pure function of its four arguments (no clock, no sensors, no globals), so every policy is tested
as a table over recorded devices and scripted timelines.

The steps of `decide`:
1. Heat: the thermal level, "cool" | "warm" | "hot", from the hottest temperature against the
   policy's limit (`temperature_limit_c`), with hysteresis: a level is entered when the temperature
   reaches its threshold and left only when it falls `hysteresis_c` below it. A device that says it
   is throttling (Pi firmware flags, Android thermal status >= severe, macOS CPU speed limit < 100)
   counts as hot whatever the temperature, and so does a Pi reporting under-voltage (less load,
   less current: it also halves the cores). A temperature that cannot be read keeps the previous
   level (never relaxes on a missing sensor).
2. Pace: near the policy's limit a PI controller holds the temperature TARGET_BELOW_C under it by
   the token cap (log cap = I + KP * error; I integrates the error, so the plan remembers the rate
   that held the target instead of cycling between flat out and over-cut); performance only guards
   the critical point; past the target while idle and not engaged (no rate to start from), the cap
   is the floor until a busy plan measures one. With `power_budget_w` and a power reading the cap
   also follows the budget (cap *= sqrt(budget / watts) per plan); the lower cap wins; the user's
   `max_tokens_per_s` always applies on top.
3. Threads, prefill and admission from the policy's table (docs/power.md):
   battery halves the cores on battery; hot runs prefill in small chunks (performance: only while its
   critical guard paces); background work is refused
   when hot (thermal-guard: warm too) or on battery under `min_battery_pct`.
4. Hold: a plan differs from `previous` at most once per `hold_s`, except a change that makes it
   safer because the device is hot (or, already hot and paced, at or past its critical point), a
   first cap for the power budget, or the heat cap replacing the idle floor of step 2, which apply
   at once.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from edgeinfer.errors import InvalidArgumentError
from edgeinfer.power.readings import ANDROID_THERMAL_STATUS, Readings

POLICY_NAMES = ("performance", "balanced", "battery", "thermal-guard")
LEVELS = ("cool", "warm", "hot")  # the thermal levels, coolest first
DEFAULT_LIMIT_C = 80.0  # when neither the policy nor the device gives a throttle point
MIN_TOKENS_PER_S = 1.0  # the lowest cap a plan sets: pacing never sleeps more than 1 s a token
HOT_PREFILL_CHUNK = 32
# the temperature controller (step 2): PI on log(cap); tuned on the simulated Pi (tau 120 s) for a
# damped response (no overshoot past the throttle point) at 80 % duty (scripts/thermal_sim.py, docs/power.md)
TARGET_BELOW_C = 0.5  # hold this far under the policy's limit
ENGAGE_C = 3.0  # engage within this of the target
KP_PER_C = 0.3
KI_PER_C_S = 0.005
CRITICAL_GUARD_C = 5.0
LOG_MAX_CAP = math.log(1e6)
REQUIRED = ("hysteresis_c", "hold_s", "warm_band_c")  # the Policy fields that have no None (no "the default")


@dataclass(frozen=True)
class Policy:
    """A named policy and the user's limits. Build with `Policy(name, ...)` or `resolve_policy`."""
    name: str = "balanced"
    max_temp_c: float | None = None  # stay under this (default: the device's throttle point less margin_c);
    # never above CRITICAL_GUARD_C under the device's critical point (`temperature_limit_c`)
    min_battery_pct: float | None = None  # on battery below this, refuse background work (default 20; battery: 50)
    power_budget_w: float | None = None  # hold the device's draw (power_w) at or under this
    max_tokens_per_s: float | None = None  # never decode faster than this
    margin_c: float | None = None  # below the device's throttle point (default: balanced 1, thermal-guard 2)
    hysteresis_c: float = 3.0
    hold_s: float = 5.0  # a plan changes at most once per hold_s (except to get safer when hot)
    warm_band_c: float = 8.0  # "warm" starts this far below the limit

    def __post_init__(self):
        if self.name not in POLICY_NAMES:
            raise InvalidArgumentError(f"unknown power policy {self.name!r} (choose from {', '.join(POLICY_NAMES)})")
        for field, lo, hi in (("max_temp_c", 30.0, 125.0), ("min_battery_pct", 0.0, 100.0),
                              ("power_budget_w", 0.1, 1000.0), ("max_tokens_per_s", MIN_TOKENS_PER_S, 1e6),
                              ("margin_c", 0.0, 30.0), ("hysteresis_c", 0.0, 20.0), ("hold_s", 0.0, 3600.0),
                              ("warm_band_c", 0.5, 40.0)):
            v = getattr(self, field)
            if v is None and field not in REQUIRED:  # (hold_s=None was taken, and the first plan change then
                continue  # failed for good: the safe plan, and no heat pacing at 95 °C; a hostile round)
            try:  # a numpy number (np.float32 was refused) as a plain float, judged as one (np.float16(0.1) passed as
                x = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None  # 0.1, kept as 0.09998)
            except OverflowError:  # an int past a float's range (10**400): out of range, as it was before the float
                x = None
            if x is None or not lo <= x <= hi or not math.isfinite(x):
                raise InvalidArgumentError(f"power policy {field} must be a number in [{lo:g}, {hi:g}], got {v!r:.40}")
            object.__setattr__(self, field, x)
        if self.hysteresis_c >= self.warm_band_c:
            raise InvalidArgumentError(f"hysteresis_c ({self.hysteresis_c}) must be less than warm_band_c "
                                       f"({self.warm_band_c}): the warm level would never be left")
        if self.name == "performance":
            given = [f for f in ("min_battery_pct", "max_temp_c", "margin_c") if getattr(self, f) is not None]
            if given:
                raise InvalidArgumentError(f"{', '.join(given)} contradicts the performance policy (it never paces "
                                           "for heat nor refuses work); use balanced, battery or thermal-guard (where no policy is "
                                           "given, the device profile's applies: `edgeinfer inspect --platform`)")

    def temperature_limit_c(self, readings: Readings) -> float:
        """The temperature to stay under: max_temp_c, else the device's throttle point less the margin;
        never above the critical guard (CRITICAL_GUARD_C under the device's critical point, what even
        performance holds): a max_temp_c past it would have run flat out to the shutdown point."""
        if self.max_temp_c is not None:
            limit = float(self.max_temp_c)
        else:
            margin = self.margin_c if self.margin_c is not None else (2.0 if self.name == "thermal-guard" else 1.0)
            limit = (readings.throttle_temp_c if readings.throttle_temp_c is not None else DEFAULT_LIMIT_C) - margin
        if readings.critical_temp_c is not None:
            limit = min(limit, readings.critical_temp_c - CRITICAL_GUARD_C)
        return limit

    def battery_floor_pct(self) -> float:
        if self.min_battery_pct is not None:
            return float(self.min_battery_pct)
        return 50.0 if self.name == "battery" else 20.0


def resolve_policy(power) -> Policy | None:
    """`load(power=...)`: None or "off" (off, as `serve --power off`), a policy name, or a Policy;
    anything else is refused."""
    if power is None or isinstance(power, Policy):
        return power
    if isinstance(power, str):
        return None if power == "off" else Policy(power)
    raise InvalidArgumentError(f"power must be None, one of {', '.join(POLICY_NAMES)}, or a Policy, got {power!r}")


@dataclass(frozen=True)
class Load:
    """What the runtime is doing: the inputs `decide` takes besides the sensors."""
    max_threads: int = 1  # cores the runtime may use at most
    tokens_per_s: float | None = None  # the decode rate delivered lately (paced), None when idle
    unpaced_tokens_per_s: float | None = None  # what it would be without pacing (1 / compute time per step)


@dataclass(frozen=True)
class Plan:
    threads: int  # cores to run on
    max_tokens_per_s: float | None  # the pacing cap; None: unpaced
    prefill_chunk: int | None  # tokens per prefill call; None: as loaded
    admit_background: bool
    reason: str
    level: str = "cool"  # the thermal level the plan was made at (for hysteresis)
    heat_cap: float | None = None  # the part of the cap that heat or the power budget set (before the user's)
    since_s: float = 0.0  # readings.time_s when this plan took effect
    thermal_cap: float | None = None  # the temperature controller's cap, and its integral (log tok/s)
    thermal_i: float | None = None
    budget_cap: float | None = None  # the power budget's cap

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def safe_plan(load: Load, reason: str, policy: Policy | None = None, previous: Plan | None = None) -> Plan:
    """What to run when sensors or the policy fail: one core, small prefill chunks, no background
    work, the user's token cap; the thermal level stays what it was (a failure is not a reading)."""
    return Plan(threads=1, max_tokens_per_s=policy.max_tokens_per_s if policy is not None else None,
                prefill_chunk=HOT_PREFILL_CHUNK, admit_background=False, reason=reason,
                level=previous.level if previous is not None else "cool",
                since_s=previous.since_s if previous is not None else 0.0)


def _device_says_hot(r: Readings) -> str | None:
    if r.pi_throttle is not None and r.pi_throttle.under_voltage:
        return "Pi under-voltage: the supply cannot keep up, load reduced"
    if r.pi_throttle is not None and r.pi_throttle.limited_now:
        return "the Pi firmware is throttling"
    if r.thermal_status in ANDROID_THERMAL_STATUS and \
            ANDROID_THERMAL_STATUS.index(r.thermal_status) >= ANDROID_THERMAL_STATUS.index("severe"):
        return f"Android thermal status {r.thermal_status}"
    if r.cpu_speed_limit_pct is not None and r.cpu_speed_limit_pct < 100:
        return f"macOS CPU speed limit {r.cpu_speed_limit_pct:g}%"
    return None


def thermal_level(r: Readings, policy: Policy, previous: Plan | None) -> tuple[str, str]:
    """Step 1: ("cool" | "warm" | "hot", why)."""
    forced = _device_says_hot(r)
    if forced:
        if policy.name == "performance":  # it reduces nothing for the device's own report (a Pi review)
            forced = forced.removesuffix(", load reduced") + "; performance reduces no load for it"
        return "hot", forced
    level, why = _temperature_level(r, policy, previous)
    if policy.name == "performance" and level != "cool" and r.temp_c is not None:  # the limit named is the
        guard = _thermal_target_c(r, policy)  # device's, which performance does not hold (a hostile round)
        why += (f"; performance holds only {guard:.1f} °C ({CRITICAL_GUARD_C:g} °C under the critical point)"
                if guard is not None else "; performance holds no temperature (the device gives no critical point)")
    return level, why


def _temperature_level(r: Readings, policy: Policy, previous: Plan | None) -> tuple[str, str]:
    before = previous.level if previous is not None else "cool"
    if r.temp_c is None:
        return before, "no temperature reading"
    limit = policy.temperature_limit_c(r)
    warm_at = limit - policy.warm_band_c
    h = policy.hysteresis_c
    t = r.temp_c
    if t >= limit or (before == "hot" and t > limit - h):
        return "hot", f"{t:.1f} °C >= {limit:.1f} °C" if t >= limit else f"{t:.1f} °C, hot until {limit - h:.1f} °C"
    if t >= warm_at or (before in ("warm", "hot") and t > warm_at - h):
        return "warm", f"{t:.1f} °C, limit {limit:.1f} °C"
    return "cool", f"{t:.1f} °C"


def _budget_cap(r: Readings, policy: Policy, load: Load, previous: Plan | None) -> tuple[float | None, str]:
    """With power_budget_w and a power reading: the cap moves by sqrt(budget / watts) per plan
    (half the correction in log space: damped), lifted once it is far above the unpaced rate."""
    prev = previous.budget_cap if previous is not None else None
    if policy.power_budget_w is None:
        return None, ""
    if r.power_w is None:
        return prev, "power budget set but no power reading: cap kept" if prev else "power budget: no power reading"
    rate = load.unpaced_tokens_per_s or load.tokens_per_s
    if rate is None:  # idle: the power says nothing about the cap (moving it would wind it up)
        return prev, f"power {r.power_w:.2f} W, budget {policy.power_budget_w:g} W (idle)"
    base = prev or rate
    cap = base * min(max((policy.power_budget_w / max(r.power_w, 0.01)) ** 0.5, 0.5), 1.5)
    if cap >= rate * 1.5 and r.power_w < policy.power_budget_w:
        return None, f"power {r.power_w:.2f} W under budget {policy.power_budget_w:g} W"
    cap = min(max(cap, MIN_TOKENS_PER_S), rate * 1.5)
    return cap, f"power {r.power_w:.2f} W, budget {policy.power_budget_w:g} W"


def _thermal_target_c(r: Readings, policy: Policy) -> float | None:
    """The temperature the pacing holds: TARGET_BELOW_C under the policy's limit; performance only
    guards the critical point (CRITICAL_GUARD_C under it), when the device reports one."""
    if policy.name == "performance":
        return None if r.critical_temp_c is None else r.critical_temp_c - CRITICAL_GUARD_C
    return policy.temperature_limit_c(r) - TARGET_BELOW_C


def _thermal_cap(r: Readings, policy: Policy, load: Load, previous: Plan | None
                 ) -> tuple[float | None, float | None, str]:
    """PI control of log(cap) on the error e = target - temperature: log cap = I + KP * e, with
    I += KI * e * dt per plan. It engages when the temperature comes within ENGAGE_C of the target
    (I starting at the rate it runs at now), keeps I (the rate that held the target) while it runs,
    and lets go once the cap is well above the unpaced rate and the device is cool again.
    Returns (cap, I, why)."""
    prev_i = previous.thermal_i if previous is not None else None
    prev_cap = previous.thermal_cap if previous is not None else None
    target, t = _thermal_target_c(r, policy), r.temp_c
    if target is None or t is None:
        return prev_cap, prev_i, ""
    rate = load.unpaced_tokens_per_s or load.tokens_per_s
    e = target - t
    if prev_i is None:
        if rate is None and e < 0:  # past the target, idle, never engaged: no rate to start I from, so the
            # first tokens run at the floor, not flat out (they did, ~0.6 s: a hostile round), until a busy
            # plan starts I from the rate they measure (`_hold` lets that plan through at once)
            return MIN_TOKENS_PER_S, None, f"{t:.1f} °C past the {target:.1f} °C target (idle): the floor first"
        if e > ENGAGE_C or rate is None:
            return None, None, ""
        prev_i, dt = math.log(rate), 0.0
    elif rate is None:  # idle: nothing to learn about the rate; let go once cool
        if e > ENGAGE_C:
            return None, None, "cool again: pacing lifted"
        return prev_cap, prev_i, f"holding {target:.1f} °C (idle)"
    else:
        dt = min(max(r.time_s - previous.since_s, 0.0), 30.0)
    i = prev_i + KI_PER_C_S * e * dt
    # anti-windup: never bank more than the device can use, nor less than the floor
    i = min(max(i, math.log(MIN_TOKENS_PER_S)), math.log(rate * 1.5))
    cap = math.exp(min(i + KP_PER_C * e, LOG_MAX_CAP))
    if rate is not None and cap >= rate * 1.1 and e > ENGAGE_C:
        return None, None, "cool again: pacing lifted"
    return max(cap, MIN_TOKENS_PER_S), i, f"holding {target:.1f} °C at {max(cap, MIN_TOKENS_PER_S):.1f} tok/s"


_FLOAT_FIELDS = ("temp_c", "throttle_temp_c", "critical_temp_c", "battery_pct", "power_w", "cpu_speed_limit_pct")


def finite_readings(r: Readings) -> tuple[Readings, list[str]]:
    """`r` with every non-finite number (NaN, inf) and negative power as None, and what was dropped."""
    bad = {f: None for f in _FLOAT_FIELDS if isinstance(getattr(r, f), float) and not math.isfinite(getattr(r, f))}
    if isinstance(r.power_w, (int, float)) and r.power_w < 0:
        bad["power_w"] = None
    if not isinstance(r.time_s, (int, float)) or not math.isfinite(r.time_s):
        bad["time_s"] = 0.0
    return (replace(r, **bad) if bad else r), sorted(bad)


def decide(readings: Readings, policy: Policy, load: Load, previous: Plan | None = None) -> Plan:
    """The plan for `readings` under `policy` (see the module doc's steps)."""
    readings, dropped = finite_readings(readings)
    n = max(1, int(load.max_threads))
    level, why = thermal_level(readings, policy, previous)
    budget_cap, budget_why = _budget_cap(readings, policy, load, previous)
    thermal_cap, thermal_i, thermal_why = _thermal_cap(readings, policy, load, previous)
    heat_cap = min((c for c in (budget_cap, thermal_cap) if c is not None), default=None)
    cap_why = "; ".join(w for w in (thermal_why, budget_why) if w)
    cap = heat_cap
    if policy.max_tokens_per_s is not None:
        cap = policy.max_tokens_per_s if cap is None else min(cap, policy.max_tokens_per_s)
    threads, admit, reasons = n, True, [why] + ([cap_why] if cap_why else [])
    if dropped:
        reasons.append(f"ignored non-finite {', '.join(dropped)}")
    low_battery = readings.on_battery and readings.battery_pct is not None \
        and readings.battery_pct < policy.battery_floor_pct()
    if policy.name == "battery" and readings.on_battery:
        threads = max(1, n // 2)
        reasons.append(f"on battery: {threads} of {n} cores")
    if policy.name != "performance" and readings.pi_throttle is not None and readings.pi_throttle.under_voltage:
        threads = max(1, n // 2)  # less current: the fewer cores, the smaller the dips
        reasons.append(f"under-voltage: {threads} of {n} cores")
    if policy.name != "performance":
        if level == "hot" or (policy.name == "thermal-guard" and level == "warm"):
            admit = False  # hot by the device's own report (a Pi's under-voltage throttling, say) or by heat
            reasons.append("background refused: " + ("the device reports throttling" if _device_says_hot(readings)
                                                      else "heat"))
        if low_battery:
            admit = False
            reasons.append(f"background refused: battery {readings.battery_pct:g}% < {policy.battery_floor_pct():g}%")
    # performance guards the critical point only: its prefill is chunked while that guard paces, not at
    # the generic hot level (79 °C where the device names no throttle point)
    prefill = HOT_PREFILL_CHUNK if level == "hot" and (policy.name != "performance" or thermal_cap is not None) \
        else None
    plan = Plan(threads=threads, max_tokens_per_s=cap, prefill_chunk=prefill, admit_background=admit,
                reason="; ".join(r for r in reasons if r), level=level, heat_cap=heat_cap, since_s=readings.time_s, thermal_cap=thermal_cap,
                thermal_i=thermal_i, budget_cap=budget_cap)
    critical = readings.temp_c is not None and readings.critical_temp_c is not None \
        and readings.temp_c >= readings.critical_temp_c
    return _hold(plan, previous, policy, readings.time_s, critical)


def _same(a: Plan, b: Plan) -> bool:
    return (a.threads, a.max_tokens_per_s, a.prefill_chunk, a.admit_background, a.level) == \
        (b.threads, b.max_tokens_per_s, b.prefill_chunk, b.admit_background, b.level)


def _safer(new: Plan, old: Plan) -> bool:
    """`new` restricts more than `old` in some way and relaxes nothing."""
    inf = math.inf
    new_cap, old_cap = new.max_tokens_per_s or inf, old.max_tokens_per_s or inf
    return (new.threads <= old.threads and new_cap <= old_cap and (old.admit_background or not new.admit_background))


def _hold(plan: Plan, previous: Plan | None, policy: Policy, now: float, critical: bool = False) -> Plan:
    """Step 4: keep `previous` unless hold_s has passed, or the change is a safety one while hot (at or
    past the device's critical point: any safer plan)."""
    if previous is None:
        return plan
    if _same(plan, previous):
        return replace(previous, reason=plan.reason)
    if now - previous.since_s >= policy.hold_s or now < previous.since_s:  # held long enough, or the clock jumped back
        return plan
    if critical and _safer(plan, previous):
        return plan  # past the critical point, a plan already hot and paced kept its cap for the hold (189 tok/s
        # of 200 at 110 °C, critical 105, for 4.5 s: a hostile round)
    if plan.level == "hot" and _safer(plan, previous) and (previous.level != "hot" or previous.heat_cap is None):
        return plan  # getting hot (or busy while hot): act now
    if previous.thermal_cap is not None and previous.thermal_i is None and plan.thermal_i is not None and \
            LEVELS.index(plan.level) >= LEVELS.index(previous.level) and \
            (plan.prefill_chunk is not None or previous.prefill_chunk is None) and \
            _safer(replace(plan, max_tokens_per_s=previous.max_tokens_per_s), previous):
        return plan  # the idle floor (`_thermal_cap`) gives way to the cap from a measured rate at once (only
        # the cap: a plan relaxing anything else waits for the hold, one tightening it too does not: reviews)
    if plan.budget_cap is not None and previous.budget_cap is None and _safer(plan, previous):
        return plan  # over the power budget (a supply's limit: a Pi browns out past it): act now, not after
        # the idle plan's hold (a generation ran uncapped for its first 5 s: a Jetson review)
    return replace(previous, reason=previous.reason if previous.reason.endswith("(held)")
                   else previous.reason + " (held)")

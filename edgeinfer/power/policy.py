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
2. Pace: while hot, the token cap shrinks by `step_down` every hold period (multiplicative
   decrease; performance paces only within 5 °C of the critical point); while cool or warm with a
   cap that heat set, it grows by `step_up` and is lifted once it no longer binds. With
   `power_budget_w` and a power reading, the cap follows the budget instead: cap *= sqrt(budget /
   watts) per hold period. The user's `max_tokens_per_s` always applies on top.
3. Threads, prefill and admission from the policy's table (docs/power.md):
   battery halves the cores on battery; hot runs prefill in small chunks; background work is refused
   when hot (thermal-guard: warm too) or on battery under `min_battery_pct`.
4. Hold: a plan differs from `previous` at most once per `hold_s`, except a change that makes it
   safer because the device is hot, which applies at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from edgeinfer.errors import InvalidArgumentError
from edgeinfer.power.readings import ANDROID_THERMAL_STATUS, Readings

POLICY_NAMES = ("performance", "balanced", "battery", "thermal-guard")
DEFAULT_LIMIT_C = 80.0  # when neither the policy nor the device gives a throttle point
MIN_TOKENS_PER_S = 1.0  # the lowest cap a plan sets: pacing never sleeps more than 1 s a token
HOT_PREFILL_CHUNK = 32


@dataclass(frozen=True)
class Policy:
    """A named policy and the user's limits. Build with `Policy(name, ...)` or `resolve_policy`."""
    name: str = "balanced"
    max_temp_c: float | None = None  # stay under this (default: the device's throttle point less margin_c)
    min_battery_pct: float | None = None  # on battery below this, refuse background work (default 20; battery: 50)
    power_budget_w: float | None = None  # hold the device's draw (power_w) at or under this
    max_tokens_per_s: float | None = None  # never decode faster than this
    margin_c: float | None = None  # below the device's throttle point (default 2; thermal-guard 5)
    hysteresis_c: float = 3.0
    hold_s: float = 5.0  # a plan changes at most once per hold_s (except to get safer when hot)
    warm_band_c: float = 8.0  # "warm" starts this far below the limit
    step_down: float = 0.8  # the cap's factor per hold period while hot
    step_up: float = 1.15  # and while cool again

    def __post_init__(self):
        if self.name not in POLICY_NAMES:
            raise InvalidArgumentError(f"unknown power policy {self.name!r} (choose from {', '.join(POLICY_NAMES)})")
        for field, lo, hi in (("max_temp_c", 30.0, 125.0), ("min_battery_pct", 0.0, 100.0),
                              ("power_budget_w", 0.1, 1000.0), ("max_tokens_per_s", MIN_TOKENS_PER_S, 1e6),
                              ("margin_c", 0.0, 30.0), ("hysteresis_c", 0.0, 20.0), ("hold_s", 0.0, 3600.0),
                              ("warm_band_c", 0.5, 40.0), ("step_down", 0.1, 0.99), ("step_up", 1.01, 3.0)):
            v = getattr(self, field)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
                raise InvalidArgumentError(f"power policy {field} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        if self.hysteresis_c >= self.warm_band_c:
            raise InvalidArgumentError(f"hysteresis_c ({self.hysteresis_c}) must be less than warm_band_c "
                                       f"({self.warm_band_c}): the warm level would never be left")
        if self.name == "performance" and self.min_battery_pct is not None:
            raise InvalidArgumentError("min_battery_pct contradicts the performance policy (it never refuses work); "
                                       "use balanced or battery")

    def temperature_limit_c(self, readings: Readings) -> float:
        """The temperature to stay under: max_temp_c, else the device's throttle point less the margin."""
        if self.max_temp_c is not None:
            return float(self.max_temp_c)
        margin = self.margin_c if self.margin_c is not None else (5.0 if self.name == "thermal-guard" else 2.0)
        base = readings.throttle_temp_c if readings.throttle_temp_c is not None else DEFAULT_LIMIT_C
        return base - margin

    def battery_floor_pct(self) -> float:
        if self.min_battery_pct is not None:
            return float(self.min_battery_pct)
        return 50.0 if self.name == "battery" else 20.0


def resolve_policy(power) -> Policy | None:
    """`load(power=...)`: None (off), a policy name, or a Policy; anything else is refused."""
    if power is None or isinstance(power, Policy):
        return power
    if isinstance(power, str):
        return Policy(power)
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

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def safe_plan(load: Load, reason: str) -> Plan:
    """What to run when sensors or the policy fail: one core, slow, no background work."""
    return Plan(threads=1, max_tokens_per_s=None, prefill_chunk=HOT_PREFILL_CHUNK, admit_background=False,
                reason=reason, level="hot")


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
        return "hot", forced
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


def _heat_cap(r: Readings, policy: Policy, load: Load, level: str, previous: Plan | None) -> tuple[float | None, str]:
    """Step 2: the cap heat or the power budget sets (None: none), and why."""
    prev_cap = previous.heat_cap if previous is not None else None
    rate = load.tokens_per_s or load.unpaced_tokens_per_s
    if policy.power_budget_w is not None and r.power_w is not None:
        base = prev_cap or load.unpaced_tokens_per_s or rate
        if base is None:
            return prev_cap, f"power {r.power_w:.2f} W, budget {policy.power_budget_w:g} W (idle)"
        gain = (policy.power_budget_w / max(r.power_w, 0.01)) ** 0.5  # damped: half the step in log space
        cap = base * min(max(gain, 0.5), 1.5)
        if load.unpaced_tokens_per_s and cap >= load.unpaced_tokens_per_s * 1.5 and r.power_w < policy.power_budget_w:
            return None, f"power {r.power_w:.2f} W under budget {policy.power_budget_w:g} W"
        return max(cap, MIN_TOKENS_PER_S), f"power {r.power_w:.2f} W, budget {policy.power_budget_w:g} W"
    near_shutdown = r.temp_c is not None and r.critical_temp_c is not None and r.temp_c >= r.critical_temp_c - 5
    if level == "hot" and (policy.name != "performance" or near_shutdown):
        base = prev_cap or rate
        if base is None:
            return prev_cap, "hot, idle"
        return max(base * policy.step_down, MIN_TOKENS_PER_S), "hot: pacing down"
    if prev_cap is not None and level == "cool":
        cap = prev_cap * policy.step_up
        if load.unpaced_tokens_per_s is not None and cap >= load.unpaced_tokens_per_s:
            return None, "cool again: pacing lifted"
        return cap, "cooling: pacing up"
    return prev_cap, "holding pace" if prev_cap is not None else ""


def decide(readings: Readings, policy: Policy, load: Load, previous: Plan | None = None) -> Plan:
    """The plan for `readings` under `policy` (see the module doc's steps)."""
    n = max(1, int(load.max_threads))
    level, why = thermal_level(readings, policy, previous)
    heat_cap, cap_why = _heat_cap(readings, policy, load, level, previous)
    cap = heat_cap
    if policy.max_tokens_per_s is not None:
        cap = policy.max_tokens_per_s if cap is None else min(cap, policy.max_tokens_per_s)
    threads, admit, reasons = n, True, [why] + ([cap_why] if cap_why else [])
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
            admit = False
            reasons.append("background refused: heat")
        if low_battery:
            admit = False
            reasons.append(f"background refused: battery {readings.battery_pct:g}% < {policy.battery_floor_pct():g}%")
    prefill = HOT_PREFILL_CHUNK if level == "hot" else None
    plan = Plan(threads=threads, max_tokens_per_s=cap, prefill_chunk=prefill, admit_background=admit,
                reason="; ".join(r for r in reasons if r), level=level, heat_cap=heat_cap, since_s=readings.time_s)
    return _hold(plan, previous, policy, readings.time_s)


def _same(a: Plan, b: Plan) -> bool:
    return (a.threads, a.max_tokens_per_s, a.prefill_chunk, a.admit_background, a.level) == \
        (b.threads, b.max_tokens_per_s, b.prefill_chunk, b.admit_background, b.level)


def _safer(new: Plan, old: Plan) -> bool:
    """`new` restricts more than `old` in some way and relaxes nothing."""
    inf = math.inf
    new_cap, old_cap = new.max_tokens_per_s or inf, old.max_tokens_per_s or inf
    return (new.threads <= old.threads and new_cap <= old_cap and (old.admit_background or not new.admit_background))


def _hold(plan: Plan, previous: Plan | None, policy: Policy, now: float) -> Plan:
    """Step 4: keep `previous` unless hold_s has passed, or the change is a safety one while hot."""
    if previous is None:
        return plan
    if _same(plan, previous):
        return replace(previous, reason=plan.reason)
    if now - previous.since_s >= policy.hold_s:
        return plan
    if plan.level == "hot" and _safer(plan, previous) and (previous.level != "hot" or previous.heat_cap is None):
        return plan  # getting hot (or busy while hot): act now
    return replace(previous, reason=previous.reason if previous.reason.endswith("(held)")
                   else previous.reason + " (held)")

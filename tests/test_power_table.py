"""Every recorded device x every policy -> the expected plan (hand-written table), read through the
real sensor readers from the fixture trees in tests/fixtures/power/."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from edgeinfer.power.policy import HOT_PREFILL_CHUNK as H, KP_PER_C, POLICY_NAMES, Load, Policy, decide
from edgeinfer.power.sensors import sensors_from_fixture

FIXTURES = Path(__file__).parent / "fixtures" / "power"
RATE = 20.0  # the decode rate the runtime reports (tok/s); a hot plan's first cap is RATE * exp(KP * error)

# device -> {policy: (threads, capped, prefill_chunk, admit_background, level)}
COOL4 = {p: (4, False, None, True, "cool") for p in POLICY_NAMES}
# performance guards the critical point only: no smaller prefill calls at the generic hot level
HOT_PI = {"performance": (4, False, None, True, "hot"), "balanced": (4, True, H, False, "hot"),
          "battery": (4, True, H, False, "hot"), "thermal-guard": (4, True, H, False, "hot")}
TABLE = {
    "pi4-cool": COOL4,
    "pi5-cool": COOL4,
    "pi4-throttled": HOT_PI,  # 82 °C, firmware flags 0xe000e
    "pi5-throttled": HOT_PI,
    # 58 °C: no pacing for heat, but half the cores and no background work while the supply sags
    "pi5-undervoltage": {"performance": (4, False, None, True, "hot"), "balanced": (2, False, H, False, "hot"),
                         "battery": (2, False, H, False, "hot"), "thermal-guard": (2, False, H, False, "hot")},
    "jetson-orin-nano-15w": {p: (6, False, None, True, "cool") for p in POLICY_NAMES},
    "jetson-orin-nano-7w": {p: (4, False, None, True, "cool") for p in POLICY_NAMES},
    "laptop-ac": COOL4,
    "laptop-battery": {"performance": (8, False, None, True, "cool"), "balanced": (8, False, None, True, "cool"),
                       "battery": (4, False, None, False, "cool"),  # 42 % < battery's 50 % floor
                       "thermal-guard": (8, False, None, True, "cool")},
    "android-phone": {"performance": (8, False, None, True, "cool"), "balanced": (8, False, None, True, "cool"),
                      "battery": (4, False, None, True, "cool"), "thermal-guard": (8, False, None, True, "cool")},
    "macos-laptop": {"performance": (4, False, None, True, "cool"), "balanced": (4, False, None, True, "cool"),
                     "battery": (2, False, None, True, "cool"), "thermal-guard": (4, False, None, True, "cool")},
}


def test_every_fixture_is_in_the_table():
    assert sorted(TABLE) == sorted(d.name for d in FIXTURES.iterdir() if d.is_dir())


@pytest.mark.parametrize("device", sorted(TABLE))
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_plan(device, policy):
    r = sensors_from_fixture(FIXTURES / device).read()
    plan = decide(r, Policy(policy), Load(max_threads=r.cpu_count or 4, tokens_per_s=RATE, unpaced_tokens_per_s=RATE))
    threads, capped, chunk, admit, level = TABLE[device][policy]
    assert (plan.threads, plan.max_tokens_per_s is not None, plan.prefill_chunk, plan.admit_background, plan.level) \
        == (threads, capped, chunk, admit, level), plan.reason
    if capped:  # engaging: exp(log RATE + KP * (target - temperature)), target = limit - 0.5
        target = Policy(policy).temperature_limit_c(r) - 0.5
        assert plan.max_tokens_per_s == pytest.approx(max(1.0, RATE * math.exp(KP_PER_C * (target - r.temp_c))))
    assert plan.reason


def test_limits_change_the_table():
    """The user's limits move the plan on the same device."""
    jetson = sensors_from_fixture(FIXTURES / "jetson-orin-nano-15w").read()  # VDD_IN 6.07 W
    load = Load(max_threads=6, tokens_per_s=RATE, unpaced_tokens_per_s=RATE)
    plan = decide(jetson, Policy("balanced", power_budget_w=5.0), load)
    assert plan.max_tokens_per_s == pytest.approx(RATE * (5.0 / jetson.power_w) ** 0.5)
    cool_pi = sensors_from_fixture(FIXTURES / "pi5-cool").read()  # 52 °C
    guarded = decide(cool_pi, Policy("thermal-guard", max_temp_c=50.0), load)
    assert guarded.level == "hot" and guarded.max_tokens_per_s < RATE
    phone = sensors_from_fixture(FIXTURES / "android-phone").read()  # 64 % on battery
    assert not decide(phone, Policy("balanced", min_battery_pct=70), load).admit_background

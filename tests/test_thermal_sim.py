"""scripts/thermal_sim.py: the simulated Pi 5's physics against hand-computed values, and issue 11's
acceptance over the full 10 simulated minutes (each run takes well under a second)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from edgeinfer.power.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "thermal_sim.py"
BENCH = ROOT / "docs" / "power" / "bench-small-int4.json"
TEN_MIN = 600.0


def _load():
    spec = importlib.util.spec_from_file_location("thermal_sim", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["thermal_sim"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


ts = _load()
COST = ts.TokenCost.from_bench(BENCH)
PLANT = ts.PiPlant()
PLANT_HALF = ts.PiPlant(throttled_power_fraction=0.5)
BUDGET = Policy("balanced", power_budget_w=4.5)


@pytest.fixture(scope="module")
def runs():
    """The full 10-minute runs the acceptance needs (flat-out, thermal-guard, the budget; both plants)."""
    return {("flat", 1.0): ts.run(None, PLANT, COST, TEN_MIN),
            ("guard", 1.0): ts.run(Policy("thermal-guard"), PLANT, COST, TEN_MIN),
            ("budget", 1.0): ts.run(BUDGET, PLANT, COST, TEN_MIN),
            ("flat", 0.5): ts.run(None, PLANT_HALF, COST, TEN_MIN)}


# --- the plant ---

def test_constants_match_the_published_anchors():
    assert PLANT.steady_c(PLANT.p_idle_w) == pytest.approx(50.0)  # bare board idles near 50 °C
    assert PLANT.steady_c(PLANT.p_full_w) == pytest.approx(25 + 25 / 2.7 * 7.0)  # 89.8 °C: above 85
    assert PLANT.steady_c(PLANT.p_full_w) > PLANT.throttle_c
    assert PLANT.tau_s == pytest.approx(120.0)


def test_bench_cost():
    assert COST.step_s == pytest.approx(1 / 179.754)
    assert COST.cores_busy == pytest.approx(0.012 * 179.754)  # 2.157 cores on a 2-thread bench
    assert COST.threads == 2 and COST.util == 1.0  # clamped: the device's CPU is fully busy


@pytest.mark.parametrize("u", [0.0, 0.25, 0.5, 1.0])
def test_steady_state_is_ambient_plus_r_times_p(u):
    sim = ts.PiSim(PLANT, COST, duration_s=1e9)
    for _ in range(200):  # 2000 s: 16.7 time constants, in 10 s calls of 50 ms pieces
        sim.advance(10.0, u)
    p = 2.7 + u * (7.0 - 2.7)
    expected = 25.0 + (25.0 / 2.7) * p
    assert sim.temp == pytest.approx(expected, abs=1e-3)
    if expected >= 85.0:
        assert sim.throttled


def test_exact_step_after_one_time_constant():
    """From 50 °C at full load, after tau: T_inf + (T0 - T_inf) / e (the first-order response)."""
    t_inf = 25 + 25 / 2.7 * 7.0
    assert PLANT.advance_c(50.0, 7.0, 120.0) == pytest.approx(t_inf + (50.0 - t_inf) / math.e)
    temp = 50.0
    for _ in range(120000):  # the same by small Euler steps of C dT/dt = P - (T - T_amb)/R
        temp += 1e-3 * (7.0 - (temp - 25.0) / PLANT.r_k_per_w) / PLANT.c_j_per_k
    assert PLANT.advance_c(50.0, 7.0, 120.0) == pytest.approx(temp, abs=1e-3)


def test_idle_sits_near_50():
    sim = ts.PiSim(PLANT, COST, duration_s=TEN_MIN)
    assert sim.temp == pytest.approx(50.0)
    sim.sleep(TEN_MIN)
    assert sim.temp == pytest.approx(50.0, abs=0.01) and not sim.ever_throttled and sim.tokens == 0


def test_sensor_power_is_the_mean_over_the_interval_and_throttle_flags():
    sim = ts.PiSim(PLANT, COST, duration_s=1e9)
    sensors = ts.SimSensors(sim)
    first = sensors.read()
    assert first.power_w == pytest.approx(2.7) and first.time_s == 0.0  # the draw now, on the first read
    sim.advance(0.25, 1.0)
    sim.advance(0.25, 0.0)
    r = sensors.read()
    assert r.power_w == pytest.approx((7.0 + 2.7) / 2)
    assert r.time_s == pytest.approx(0.5) and r.throttle_temp_c == 85.0 and r.cpu_count == 2
    assert r.pi_throttle.raw == 0 and not r.pi_throttle.limited_now
    sim.advance(3000.0, 1.0)  # full load forever: throttled
    r = sensors.read()
    assert r.pi_throttle.raw == 0x60006 and r.pi_throttle.throttled and r.pi_throttle.throttled_since_boot


def test_throttle_halves_the_clock_and_releases_below_84():
    sim = ts.PiSim(PLANT_HALF, COST, duration_s=1e9)
    sim.temp, sim.throttled = 85.5, True
    t0 = sim.t
    sim.step()
    assert sim.t - t0 == pytest.approx(2 * COST.step_s)  # half the clock: twice the step time
    assert PLANT_HALF.power_w(1.0, True) == pytest.approx(2.7 + 0.5 * 4.3)
    assert PLANT.power_w(1.0, True) == pytest.approx(7.0)
    while sim.throttled:
        sim.advance(0.01, 1.0)  # throttled at 4.85 W the Pi cools toward 69.9 °C
    assert 83.99 < sim.temp < 84.0


# --- the runs (the same PowerController code against the simulated sensors) ---

def test_flat_out_crosses_85_and_throttles(runs):
    sim = runs[("flat", 1.0)]
    assert sim.max_temp >= 85.0 and sim.ever_throttled
    # hand-computed: 85 °C is reached at tau * ln((89.81 - 50) / (89.81 - 85)) = 253.6 s, then it
    # stays throttled (at 7 W the plant heads for 89.8 °C, never back under 84 °C)
    t_cross = 120.0 * math.log((25 + 25 / 2.7 * 7.0 - 50.0) / (25 + 25 / 2.7 * 7.0 - 85.0))
    assert sim.throttled_s == pytest.approx(TEN_MIN - t_cross, abs=0.2)
    assert sim.tokens == pytest.approx(t_cross / COST.step_s + (TEN_MIN - t_cross) / (2 * COST.step_s), rel=1e-3)


def test_flat_out_under_half_power_oscillates_at_the_throttle_point(runs):
    sim = runs[("flat", 0.5)]
    late = [r[1] for r in sim.timeline if r[0] > 300]
    assert 83.9 < min(late) and max(late) < 85.05


def test_thermal_guard_stays_under_the_throttle_point(runs):
    sim = runs[("guard", 1.0)]
    assert sim.duration_s == TEN_MIN and sim.t >= TEN_MIN
    assert sim.max_temp < 85.0 and not sim.ever_throttled and sim.throttled_s == 0.0
    assert sim.max_temp < 84.0  # its limit is 85 - 2 = 83 °C (target 82.5): under 1 °C of overshoot
    # no controller can beat an ideal one holding the same limit
    assert sim.tokens <= ts.oracle_tokens(PLANT, COST, 83.0, TEN_MIN)


def test_thermal_guard_delivers_1_2x_flat_out(runs):
    """The issue's plant (a throttled core draws full power at half speed)."""
    assert runs[("guard", 1.0)].tokens >= 1.2 * runs[("flat", 1.0)].tokens


def test_power_budget_is_held_within_10_percent(runs):
    sim = runs[("budget", 1.0)]
    tail = [r[2] for r in sim.timeline if r[0] > TEN_MIN - 480.0]
    assert len(tail) == 480
    avg = sum(tail) / len(tail)
    assert abs(avg / 4.5 - 1) <= 0.10
    assert sim.max_temp < 85.0


def test_cli_writes_json_and_plots(tmp_path):
    rc = ts.main(["--bench", str(BENCH), "--minutes", "1", "--out", str(tmp_path),
                  "--throttled-power-fraction", "1.0", "0.5"])
    assert rc == 0
    doc = json.loads((tmp_path / "sim-results.json").read_text())
    assert set(doc["by_throttled_power_fraction"]) == {"1", "0.5"}
    entry = doc["by_throttled_power_fraction"]["1"]
    assert set(entry["policies"]) == {name for name, _ in ts.POLICIES}
    budget = entry["policies"]["balanced+budget 4.5 W"]["budget"]
    assert budget["window_s"] == 60.0  # a 1-minute run averages its whole minute, not "the last 8"
    pytest.importorskip("matplotlib")
    assert (tmp_path / "sim-fraction-1.png").stat().st_size > 0
    assert (tmp_path / "sim-fraction-0.5.png").stat().st_size > 0


@pytest.mark.parametrize("minutes", ["0.1", "0", "nan"])
def test_cli_refuses_a_run_too_short_for_its_figures(minutes, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ts.main(["--minutes", minutes, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--minutes must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "sim-results.json").exists()

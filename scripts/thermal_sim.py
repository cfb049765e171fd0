"""A thermal plant for issue 11's power policies: a simulated, passively cooled Raspberry Pi 5 driven
by the per-token CPU cost `edgeinfer bench --json` measured, under the unmodified `PowerController`
(its `tick()`, `decide` and `Pacer.pace()` run as in the runtime; only the clock, the sleep and the
sensors are simulated).

The model (every constant is a field of `PiPlant`, with where it comes from):

    power        P(t) = P_idle + u(t) * (P_full - P_idle) * f(t)
    temperature  C dT/dt = P(t) - (T - T_amb) / R          (integrated exactly over pieces <= 50 ms)
    throttle     the firmware halves the clock once T >= 85 °C, until T < 85 - 1 °C (hysteresis)

- u in [0, 1]: the fraction of the device's CPU busy. Decoding: u = cores busy / bench threads, with
  cores busy = cpu_s_per_token.median * decode_tok_s.median (clamped to 1); sleeping (paced): u = 0.
- f = 1 at full clock; while throttled the step time doubles and f = --throttled-power-fraction:
  1.0 (default) is the issue's plant, CPU power = utilisation x per-core watts whatever the clock;
  0.5 is dynamic power proportional to the clock at a fixed voltage.
- Steady state: T = T_amb + R * P. Idle: 25 + 9.26 * 2.7 = 50 °C; full load: 25 + 9.26 * 7.0 = 89.8 °C,
  above the throttle point. Time constant tau = R * C = 120 s (an assumption). Start: idle steady state.
- Simplification: the simulated Pi runs at the cost measured by the bench (on whatever machine ran
  it) at full clock: step time = 1 / decode_tok_s.median; cores busy as above.
- Sensors: time, T, throttle point 85 °C, power = the mean over the last controller interval (as an
  INA-style rail reports it), the Pi firmware flags (0x6 while throttled, 0x60000 once throttled).

The runtime loop, per policy (flat-out: no controller; "performance", "balanced", "thermal-guard",
"balanced" with power_budget_w = 4.5 W): the controller ticks every 0.5 simulated s (also during a
pacing sleep or a step, as its thread would); before each decode step `pacer.pace()` runs (its sleeps
advance the clock at idle power), then the clock advances by the step time (doubled if throttled)
at busy power, and a token is counted. 600 simulated seconds of continuous generation, no prompts.

Why both fractions: pacing can out-deliver the throttle only where throttling wastes energy (f = 1.0:
half the clock at full CPU power doubles the CPU joules per token). Under f = 0.5 a throttled token
costs the same CPU joules as a paced one, so pacing cannot beat the throttle on tokens per joule, and
the firmware, which holds the Pi at 84-85 °C, spends more heat than thermal-guard (held under its
83 °C limit): flat-out delivers slightly more tokens. `oracle_tokens` bounds any controller: flat
out until the limit, then exactly holding it. sim-results.json gives every figure and both verdicts.

    python scripts/thermal_sim.py                      # both fractions, JSON and PNGs in docs/power
    python scripts/thermal_sim.py --bench docs/power/bench-small-int4.json --minutes 10 \\
        --out docs/power --throttled-power-fraction 1.0 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgeinfer.power.controller import PowerController  # noqa: E402
from edgeinfer.power.policy import Policy  # noqa: E402
from edgeinfer.power.readings import PiThrottle, Readings  # noqa: E402
from edgeinfer.power.threads import CoreLimit  # noqa: E402

MAX_PIECE_S = 0.05  # integration and throttle-check granularity
BUDGET_W = 4.5


@dataclass(frozen=True)
class PiPlant:
    """A passively cooled (bare board) Raspberry Pi 5."""
    t_amb_c: float = 25.0  # the ambient
    # Board power: approximate published figures for a Pi 5 (idle ~2.5-3 W; full load under stress-ng
    # ~6.5-7.5 W); docs that quote these results must cite the measurements they rely on.
    p_idle_w: float = 2.7
    p_full_w: float = 7.0
    # R: so that the idle board sits at 50 °C ("idles around 50 °C with no cooling",
    # https://beamostore.com/guides/raspberry-pi-5-overheating): (50 - 25) / 2.7 = 9.26 K/W; full load
    # then settles at 89.8 °C, above 85 °C (Phoronix, uncooled Pi 5: mean 81 °C, peak 89 °C over a
    # benchmark suite, https://www.phoronix.com/review/raspberry-pi-5-benchmarks/2).
    r_k_per_w: float = 25.0 / 2.7
    # C: an assumption, chosen for a time constant R*C of 120 s ("a couple of minutes")
    c_j_per_k: float = 120.0 / (25.0 / 2.7)
    throttle_c: float = 85.0  # the Pi 5 firmware's throttle point: the clock halves from here
    throttle_hysteresis_c: float = 1.0  # an assumption: the clock is restored below 84 °C
    throttled_clock: float = 0.5  # the clock while throttled: steps take 1 / 0.5 = 2x longer
    throttled_power_fraction: float = 1.0  # f above: 1.0 the plant, 0.5 power ~ clock

    @property
    def tau_s(self) -> float:
        return self.r_k_per_w * self.c_j_per_k

    def power_w(self, u: float, throttled: bool) -> float:
        f = self.throttled_power_fraction if throttled else 1.0
        return self.p_idle_w + u * (self.p_full_w - self.p_idle_w) * f

    def steady_c(self, power_w: float) -> float:
        return self.t_amb_c + self.r_k_per_w * power_w

    def advance_c(self, temp_c: float, power_w: float, dt: float) -> float:
        """The exact solution of C dT/dt = P - (T - T_amb)/R over dt at constant P."""
        target = self.steady_c(power_w)
        return target + (temp_c - target) * math.exp(-dt / self.tau_s)


@dataclass(frozen=True)
class TokenCost:
    step_s: float  # one decode step at full clock
    cores_busy: float  # cores busy while decoding
    threads: int  # the bench's thread count (the simulated runtime's cores)

    @property
    def util(self) -> float:
        return min(1.0, self.cores_busy / self.threads)

    @classmethod
    def from_bench(cls, path) -> "TokenCost":
        b = json.loads(Path(path).read_text())
        rate = float(b["decode_tok_s"]["median"])
        return cls(1.0 / rate, float(b["cpu_s_per_token"]["median"]) * rate, int(b["threads"]))


class PiSim:
    """The simulated Pi: a clock, a sleep and a step that heat it; timeline bins every bin_s."""

    def __init__(self, plant: PiPlant, cost: TokenCost, duration_s: float, bin_s: float = 1.0):
        self.plant, self.cost, self.duration_s, self.bin_s = plant, cost, duration_s, bin_s
        self.t, self.temp = 0.0, plant.steady_c(plant.p_idle_w)
        self.throttled, self.ever_throttled, self.throttled_s = False, False, 0.0
        self.tokens, self.energy_j, self.max_temp = 0, 0.0, self.temp
        self.on_tick, self.tick_s, self.next_tick = None, 0.5, math.inf
        self._read_t, self._read_e, self._power_now = 0.0, 0.0, plant.p_idle_w
        self._bin_end, self._bin_e, self._bin_tok = bin_s, 0.0, 0
        self.timeline: list[tuple[float, float, float, float, float | None]] = []  # t, T, W, tok/s, cap
        self.cap_of = lambda: None

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.advance(s, 0.0)

    def step(self, core_fraction: float = 1.0) -> None:
        """One decode step on core_fraction of the cores (the same CPU work: slower, less busy)."""
        slow = 1.0 / self.plant.throttled_clock if self.throttled else 1.0
        self.advance(self.cost.step_s * slow / core_fraction, self.cost.util * core_fraction)
        if self.t <= self.duration_s + 1e-9:
            self.tokens += 1
            self._bin_tok += 1

    def advance(self, dt: float, u: float) -> None:
        end, p = self.t + dt, self.plant
        while self.t < end - 1e-12:
            nxt = min(end, self.next_tick, self._bin_end, self.t + MAX_PIECE_S)
            h = nxt - self.t
            w = p.power_w(u, self.throttled)
            self.temp = p.advance_c(self.temp, w, h)
            self._power_now = w
            if self.t < self.duration_s:
                self.energy_j += w * h
                self.throttled_s += h if self.throttled else 0.0
                self.max_temp = max(self.max_temp, self.temp)
            self._read_e += w * h
            self._bin_e += w * h
            self.t = nxt
            if not self.throttled and self.temp >= p.throttle_c:
                self.throttled = self.ever_throttled = True
            elif self.throttled and self.temp < p.throttle_c - p.throttle_hysteresis_c:
                self.throttled = False
            if self.t >= self._bin_end - 1e-9:
                if self._bin_end <= self.duration_s + 1e-9:
                    self.timeline.append((round(self._bin_end, 3), self.temp, self._bin_e / self.bin_s,
                                          self._bin_tok / self.bin_s, self.cap_of()))
                self._bin_end += self.bin_s
                self._bin_e, self._bin_tok = 0.0, 0
            if self.t >= self.next_tick - 1e-9:
                self.next_tick += self.tick_s
                self.on_tick()

    def read_power_w(self) -> float:
        """The mean power since the previous read (an INA-style rail); the draw now on the first read."""
        span = self.t - self._read_t
        w = self._read_e / span if span > 1e-9 else self._power_now
        self._read_t, self._read_e = self.t, 0.0
        return w


class SimSensors:
    def __init__(self, sim: PiSim):
        self.sim = sim

    def read(self) -> Readings:
        s = self.sim
        mask = (0x6 if s.throttled else 0) | (0x60000 if s.ever_throttled else 0)
        return Readings(time_s=s.t, temp_c=s.temp, throttle_temp_c=s.plant.throttle_c,
                        power_w=s.read_power_w(), pi_throttle=PiThrottle.from_mask(mask),
                        device="simulated Raspberry Pi 5", cpu_count=s.cost.threads, sources=("simulation",))


def run(policy: Policy | None, plant: PiPlant, cost: TokenCost, duration_s: float = 600.0,
        interval_s: float = 0.5) -> PiSim:
    """Continuous generation for duration_s under `policy` (None: flat out, no controller)."""
    sim = PiSim(plant, cost, duration_s)
    pacer, cores = None, None
    if policy is not None:
        cores = CoreLimit(list(range(cost.threads)))
        cores.supported = False  # record the plan's core count only
        ctl = PowerController(policy, SimSensors(sim), cores, interval_s=interval_s,
                              clock=sim.clock, sleep=sim.sleep)
        sim.controller, sim.plans = ctl, []

        def on_tick():
            before = ctl.plan
            plan = ctl.tick()
            if before is None or plan.since_s != before.since_s:
                sim.plans.append((sim.t, plan.max_tokens_per_s, plan.level))

        sim.on_tick, sim.tick_s, sim.next_tick = on_tick, interval_s, interval_s
        sim.cap_of = lambda: ctl.plan.max_tokens_per_s if ctl.plan is not None else None
        on_tick()  # the first reading at start, as PowerController.start() takes it
        pacer = ctl.pacer()
    while sim.t < duration_s:
        if pacer is not None:
            pacer.pace()
            if sim.t >= duration_s:
                break
        sim.step(cores.applied / cores.max_threads if cores is not None else 1.0)
    return sim


POLICIES = [("flat-out", None), ("performance", Policy("performance")), ("balanced", Policy("balanced")),
            ("thermal-guard", Policy("thermal-guard")),
            (f"balanced+budget {BUDGET_W:g} W", Policy("balanced", power_budget_w=BUDGET_W))]


def summarize(sim: PiSim, flat_tokens: int | None, policy: Policy | None) -> dict:
    d = sim.duration_s
    out = {"tokens": sim.tokens, "tokens_vs_flat_out": round(sim.tokens / flat_tokens, 4) if flat_tokens else 1.0,
           "mean_tok_s": round(sim.tokens / d, 2), "max_temp_c": round(sim.max_temp, 2),
           "final_temp_c": round(sim.temp, 2), "throttled_s": round(sim.throttled_s, 1),
           "avg_power_w": round(sim.energy_j / d, 3),
           "tokens_per_joule": round(sim.tokens / sim.energy_j, 3)}
    late = [r for r in sim.timeline if r[0] > d / 2]
    out["second_half_temp_c_range"] = [round(min(r[1] for r in late), 2), round(max(r[1] for r in late), 2)]
    out["second_half_tok_s_range"] = [round(min(r[3] for r in late), 1), round(max(r[3] for r in late), 1)]
    if policy is not None:
        out["plan_changes"] = len(sim.plans) - 1
        caps = [c for t, c, _ in sim.plans if t > d / 2 and c is not None]
        out["second_half_cap_range"] = [round(min(caps), 1), round(max(caps), 1)] if caps else None
    if policy is not None and policy.power_budget_w is not None:
        b = policy.power_budget_w
        window_s = min(480.0, d)  # the last 8 minutes, or the whole run when it is shorter
        tail = [r for r in sim.timeline if r[0] > d - window_s]
        avg = sum(r[2] for r in tail) / len(tail)
        tens = [sum(r[2] for r in tail[i:i + 10]) / 10 for i in range(0, len(tail) - 9, 10)]
        out["budget"] = {"budget_w": b, "window_s": window_s, "window_avg_power_w": round(avg, 3),
                         "error_vs_budget": round(avg / b - 1, 4),
                         "window_power_1s_range_w": [round(min(r[2] for r in tail), 2),
                                                     round(max(r[2] for r in tail), 2)],
                         "window_power_10s_range_w": [round(min(tens), 3), round(max(tens), 3)],
                         "window_power_10s_stdev_w": round(statistics.pstdev(tens), 3)}
    return out


def oracle_tokens(plant: PiPlant, cost: TokenCost, limit_c: float, duration_s: float) -> float:
    """An ideal controller's tokens: flat out until limit_c (< the throttle point), then exactly the
    duty cycle that holds limit_c (P = (limit_c - T_amb) / R). An upper bound for a policy at that limit."""
    busy, t0 = plant.power_w(cost.util, False), plant.steady_c(plant.p_idle_w)
    t_full = plant.steady_c(busy)
    t1 = plant.tau_s * math.log((t_full - t0) / (t_full - limit_c)) if t_full > limit_c else duration_s
    duty = ((limit_c - plant.t_amb_c) / plant.r_k_per_w - plant.p_idle_w) / (busy - plant.p_idle_w)
    t1 = min(t1, duration_s)
    return (t1 + min(1.0, duty) * (duration_s - t1)) / cost.step_s


def simulate(plant: PiPlant, cost: TokenCost, duration_s: float) -> tuple[dict, dict]:
    results, sims, flat = {}, {}, None
    for name, pol in POLICIES:
        sim = run(pol, plant, cost, duration_s)
        flat = flat if flat is not None else sim.tokens
        results[name] = summarize(sim, flat, pol)
        sims[name] = sim
    return results, sims


def plot(sims: dict, plant: PiPlant, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name, sim in sims.items():
        t = [r[0] / 60 for r in sim.timeline]
        for i in range(3):
            ax[i].plot(t, [r[i + 1] for r in sim.timeline], label=name, lw=3 if name == "flat-out" else 1)
    ax[0].axhline(plant.throttle_c, color="red", ls="--", lw=1, label="throttle 85 °C")
    ax[0].set_ylabel("temperature (°C)")
    ax[1].set_ylabel("board power (W, 1 s mean)")
    ax[2].set_ylabel("tokens/s (1 s bins)")
    ax[2].set_xlabel("simulated minutes")
    ax[0].legend(fontsize=8, loc="lower right")
    ax[0].set_title(f"Simulated passively cooled Pi 5, throttled power fraction {plant.throttled_power_fraction:g}")
    fig.tight_layout(), fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=str(ROOT / "docs" / "power" / "bench-small-int4.json"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "power"))
    ap.add_argument("--throttled-power-fraction", type=float, nargs="+", default=[1.0, 0.5])
    a = ap.parse_args(argv)
    if not a.minutes >= 1:  # the figures take 10 s windows and a run's second half
        ap.error(f"--minutes must be at least 1, got {a.minutes:g}")
    cost, out = TokenCost.from_bench(a.bench), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = PiPlant()
    doc = {"model": {k: round(v, 4) for k, v in vars(base).items() if k != "throttled_power_fraction"},
           "tau_s": round(base.tau_s, 1), "idle_c": round(base.steady_c(base.p_idle_w), 2),
           "full_load_c": round(base.steady_c(base.p_full_w), 2),
           "bench": {"file": Path(a.bench).name, "step_s": round(cost.step_s, 6),
                     "cores_busy": round(cost.cores_busy, 3), "threads": cost.threads,
                     "util": round(cost.util, 3)},
           "minutes": a.minutes, "budget_w": BUDGET_W, "by_throttled_power_fraction": {}}
    for f in a.throttled_power_fraction:
        plant = PiPlant(throttled_power_fraction=f)
        results, sims = simulate(plant, cost, a.minutes * 60.0)
        png = out / f"sim-fraction-{f:g}.png"
        entry = {"policies": results, "plot": png.name if plot(sims, plant, png) else None}
        for name in ("balanced", "thermal-guard"):  # what an ideal controller at that limit would deliver
            lim = Policy(name).temperature_limit_c(Readings(throttle_temp_c=plant.throttle_c))
            results[name]["oracle_at_limit"] = {"limit_c": lim, "tokens_vs_flat_out": round(
                oracle_tokens(plant, cost, lim, a.minutes * 60.0) / results["flat-out"]["tokens"], 4)}
        tg = results["thermal-guard"]
        entry["thermal_guard_under_throttle"] = tg["max_temp_c"] < plant.throttle_c
        entry["thermal_guard_1_2x"] = tg["tokens_vs_flat_out"] >= 1.2
        entry["budget_within_10pct"] = abs(results[POLICIES[-1][0]]["budget"]["error_vs_budget"]) <= 0.10
        doc["by_throttled_power_fraction"][f"{f:g}"] = entry
        print(f"throttled power fraction {f:g}:")
        for name, r in results.items():
            extra = f"  budget: last {r['budget']['window_s'] / 60:g} min {r['budget']['window_avg_power_w']} W " \
                    f"({r['budget']['error_vs_budget']:+.1%})" if "budget" in r else ""
            print(f"  {name:24s} tokens {r['tokens']:6d} ({r['tokens_vs_flat_out']:.3f}x)  max "
                  f"{r['max_temp_c']:.1f} °C  throttled {r['throttled_s']:5.1f} s  {r['avg_power_w']:.2f} W{extra}")
    doc["note"] = ("fraction 1.0 is the issue's plant (CPU power = utilisation x per-core watts whatever the "
                   "clock); under 0.5 throttling costs no extra CPU joules per token, so pacing cannot beat the "
                   "throttle on tokens per joule. oracle_at_limit: an ideal controller holding the policy's "
                   "limit exactly, an upper bound. P_idle/P_full are approximate published Pi 5 figures and "
                   "R, C, the hysteresis are assumptions (see the script's PiPlant).")
    (out / "sim-results.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'sim-results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

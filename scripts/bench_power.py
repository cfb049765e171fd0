"""Issue 11's runtime figures, measured on this machine (JSON out):

- pacing: the unpaced decode rate, then a cap at half of it (`--cap-fraction`: 0.9 asks whether a cap
  near the unpaced rate is met): delivered tokens/s against the cap and the process's CPU seconds
  per wall second while decoding (psutil), A/B alternated, medians.
- threads: one greedy generation whose plan goes 2 -> 1 -> 2 cores mid-way (a scripted battery
  timeline under the battery policy): the cores in force at each token, the output against an
  unchanged run, resident memory before and after.
- overhead: power="balanced" against power=None on this (cool) machine, decode tokens/s, paired runs.

    python scripts/bench_power.py --model /tmp/small-int4 --out power.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import psutil

import edgeinfer
from edgeinfer.power.policy import Policy
from edgeinfer.power.readings import Readings


def timed(model, ids, n):
    """Generate n tokens; the CPU seconds per wall second of the decode part (first token to end)."""
    proc = psutil.Process()
    gen = model.stream(ids, max_new_tokens=n, temperature=0, ignore_eos=True)
    next(gen)  # prefill and the first token
    c0, w0 = proc.cpu_times(), time.perf_counter()
    for _ in gen:
        pass
    c1, w1 = proc.cpu_times(), time.perf_counter()
    cpu = (c1.user - c0.user + c1.system - c0.system) / (w1 - w0)
    return gen.completion, cpu


class Timeline:
    """Sensors that read whatever `now` is set to (a scripted device)."""
    def __init__(self, readings: Readings):
        self.now = readings

    def read(self) -> Readings:
        return replace(self.now, time_s=time.monotonic())


def bench_pacing(model, ids, n, rounds, fraction=0.5):
    ctl = model.power
    free, paced = [], []
    ctl.set_policy(Policy("performance"))
    timed(model, ids, n)  # a cold run, not counted (counted, it set the cap at 0.63 of the rate, not 0.5)
    rate = statistics.median(timed(model, ids, n)[0].timings.decode_tok_s for _ in range(3))  # then the cap
    cap = round(rate * fraction, 1)
    for _ in range(rounds):
        ctl.set_policy(Policy("performance"))
        c, cpu = timed(model, ids, n)
        free.append((c.timings.decode_tok_s, cpu))
        ctl.set_policy(Policy("performance", max_tokens_per_s=cap))
        c, cpu = timed(model, ids, n)
        paced.append((c.timings.decode_tok_s, cpu, c.timings.paced_ms))
    ctl.set_policy(Policy("performance"))
    f_rate = statistics.median(x[0] for x in free)
    p_rate = statistics.median(x[0] for x in paced)
    f_cpu = statistics.median(x[1] for x in free)
    p_cpu = statistics.median(x[1] for x in paced)
    return {"unpaced_tok_s": round(f_rate, 2), "cap_tok_s": cap, "cap_over_unpaced": round(cap / f_rate, 3), "paced_tok_s": round(p_rate, 2),
            "paced_over_cap": round(p_rate / cap, 4),
            "cpu_per_wall_unpaced": round(f_cpu, 3), "cpu_per_wall_paced": round(p_cpu, 3),
            "cpu_drop": round(1 - p_cpu / f_cpu, 3),
            "paced_ms_median": round(statistics.median(x[2] for x in paced), 1), "rounds": rounds}


def bench_threads(path, ids, n, switch_at):
    proc = psutil.Process()
    ac = Readings(battery_pct=80.0, on_ac=True, charging=True)
    batt = Readings(battery_pct=80.0, on_ac=False, charging=False)
    sensors = Timeline(ac)
    model = edgeinfer.load(path, threads=2, capacity_tokens=len(ids) + n + 8, power=Policy("battery", hold_s=0))
    model.power.sensors = sensors
    model.power.tick()
    ref = model.generate(ids, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids
    rss0 = proc.memory_info().rss
    gen = model.stream(ids, max_new_tokens=n, temperature=0, ignore_eos=True)
    cores, stamps, toks = [], [], []
    for i, chunk in enumerate(gen):
        if chunk.token_id is None:
            continue
        toks.append(chunk.token_id)
        stamps.append(time.perf_counter())
        cores.append(len(os.sched_getaffinity(0)))
        if i + 1 == switch_at[0]:
            sensors.now = batt
            model.power.tick()
        elif i + 1 == switch_at[1]:
            sensors.now = ac
            model.power.tick()
    rss1 = proc.memory_info().rss
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    a, b = switch_at

    def med(lo, hi):
        return round(statistics.median(gaps[lo:hi]) * 1e3, 3)
    return {"switch_after_tokens": list(switch_at), "cores_per_token": cores,
            "cores_first_token_after_switch": [cores[a], cores[b]] if b < len(cores) else None,
            "identical_to_unchanged_run": tuple(toks) == tuple(ref),
            "ms_per_token_2cores": med(2, a - 1), "ms_per_token_1core": med(a + 1, b - 1),
            "ms_per_token_2cores_again": med(b + 1, len(gaps)),
            "rss_mb_before": round(rss0 / 2**20, 1), "rss_mb_after": round(rss1 / 2**20, 1),
            "rss_growth": round(rss1 / rss0 - 1, 4)}


def bench_overhead(path, ids, n, rounds):
    """Two pairs of models, one loaded off-first and one on-first (the order a model is loaded in
    moves its speed by a few per cent here), every round all four in alternating order; the ratio
    is the geometric mean of the two pairs' on/off, median over rounds."""
    cap = len(ids) + n + 8

    def load(power):
        return edgeinfer.load(path, threads=2, capacity_tokens=cap, power=power)
    off1 = load(None)
    on1 = load("balanced")
    on2 = load("balanced")
    off2 = load(None)
    models = [off1, on1, on2, off2]
    for m in models:
        m.generate(ids, max_new_tokens=8, temperature=0, ignore_eos=True)
    ratios, offs, ons = [], [], []
    for r in range(rounds):
        order = models if r % 2 == 0 else models[::-1]
        speed = {id(m): m.generate(ids, max_new_tokens=n, temperature=0, ignore_eos=True).timings.decode_tok_s
                 for m in order}
        a1, b1, b2, a2 = (speed[id(m)] for m in models)
        ratios.append(((b1 / a1) * (b2 / a2)) ** 0.5)
        offs.append((a1 + a2) / 2)
        ons.append((b1 + b2) / 2)
    st = on1.power_state()
    return {"off_tok_s": round(statistics.median(offs), 2), "balanced_tok_s": round(statistics.median(ons), 2),
            "ratio_median": round(statistics.median(ratios), 4), "rounds": rounds,
            "plan": st.plan.as_dict(), "sources": list(st.readings.sources)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=["pacing", "threads", "overhead"])
    ap.add_argument("--cap-fraction", type=float, default=0.5, help="pacing: the cap as a fraction of the unpaced rate")
    ap.add_argument("--out")
    a = ap.parse_args()
    ids = [1] + list(range(100, 163))
    out = {"model": a.model, "tokens": a.tokens}
    if a.only in (None, "pacing"):
        m = edgeinfer.load(a.model, threads=2, capacity_tokens=len(ids) + a.tokens + 8, power="performance")
        out["pacing"] = bench_pacing(m, ids, a.tokens, a.rounds, a.cap_fraction)
        del m
    if a.only in (None, "threads"):
        out["threads"] = bench_threads(a.model, ids, 3 * 64, (64, 128))
    if a.only in (None, "overhead"):
        out["overhead"] = bench_overhead(a.model, ids, a.tokens, a.rounds)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()

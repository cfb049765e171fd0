"""`edgeinfer power`: what this device's sensors read and the plan each policy would choose now
(a tiny tegrastats). `report` builds the data; `format_report` the text."""

from __future__ import annotations

from edgeinfer.power.policy import POLICY_NAMES, Load, Policy, decide
from edgeinfer.power.readings import Readings
from edgeinfer.power.threads import allowed_cores
from edgeinfer.terminal import printable


def report(readings: Readings) -> dict:
    """{"readings": ..., "plan_cpus": the cores the plans are for, "plans": {policy: plan}} for an idle
    runtime on all its cores (the readings' CPU count, else this host's), from this reading alone."""
    load = Load(max_threads=readings.cpu_count or len(allowed_cores()))
    return {"readings": readings.as_dict(), "plan_cpus": load.max_threads,
            "plans": {name: decide(readings, Policy(name), load).as_dict() for name in POLICY_NAMES}}


class _ThisRound:
    """The round's one reading, given to every policy's controller."""

    readings: Readings | None = None

    def read(self) -> Readings:
        return self.readings


def watch(sensors, interval_s: float = 1.0):
    """`power --watch`: a `report` per reading, whose plans are made as a running model makes them
    (`PowerController.tick`: the temperature's median over the last readings, a level kept while a
    reading is missing, holds): one controller per policy, over no cores of this process. Each plan
    from `report` alone forgot the last: a sensor gone garbage while hot showed "background admitted"
    while the daemon kept refusing (a Jetson review)."""
    from edgeinfer.power.controller import PowerController
    from edgeinfer.power.threads import CoreLimit

    this, controllers = _ThisRound(), None
    while True:
        this.readings = sensors.read()
        if controllers is None:
            cores = CoreLimit(list(range(this.readings.cpu_count or len(allowed_cores()))))
            cores.supported = False  # reported, never applied: the watch runs no model
            warned: set[str] = set()  # each sensor warning logged once, not once per policy
            controllers = {name: PowerController(Policy(name), this, cores, interval_s=interval_s, warned=warned)
                           for name in POLICY_NAMES}
        yield {"readings": this.readings.as_dict(), "plan_cpus": cores.max_threads,
               "plans": {name: c.tick().as_dict() for name, c in controllers.items()}}


def _fmt(value, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def format_report(data: dict) -> str:
    r = data["readings"]
    cpus = f"{r['cpu_count']} CPUs" if r["cpu_count"] else \
        f"CPU count unread: plans for this host's {data.get('plan_cpus', '?')}"
    lines = [f"device      {r['device'] or 'unknown'}  ({cpus}; read: {', '.join(r['sources']) or 'nothing'})",
             f"temperature {_fmt(r['temp_c'], ' °C')}  throttles at {_fmt(r['throttle_temp_c'], ' °C')}  "
             f"critical {_fmt(r['critical_temp_c'], ' °C')}",
             f"cpu         {_fmt(r['cpu_freq_mhz'], ' MHz', 0)} of {_fmt(r['cpu_max_freq_mhz'], ' MHz', 0)}",
             f"battery     {_fmt(r['battery_pct'], ' %', 0)}  charging {_fmt(r['charging'])}  "
             f"external power {_fmt(r['on_ac'])}",
             f"power       {_fmt(r['power_w'], ' W', 2)}"
             + "".join(f"  {k} {v:.2f} W" for k, v in r["rails"].items())]
    if r["pi_throttle"] is not None:
        t = r["pi_throttle"]
        now = [k for k in ("under_voltage", "freq_capped", "throttled", "soft_temp_limit") if t[k]]
        ever = [k[:-len("_since_boot")] for k in t if k.endswith("_since_boot") and t[k]]
        lines.append(f"pi firmware 0x{t['raw']:x}  now: {', '.join(now) or 'ok'}  since boot: {', '.join(ever) or 'ok'}")
    if r["power_mode"] or r["gpu_load_pct"] is not None:
        lines.append(f"jetson      mode {_fmt(r['power_mode'])}  gpu {_fmt(r['gpu_load_pct'], ' %', 0)} at "
                     f"{_fmt(r['gpu_freq_mhz'], ' MHz', 0)}")
    if r["thermal_status"] or r["cpu_speed_limit_pct"] is not None:
        lines.append(f"os thermal  {_fmt(r['thermal_status'])}  cpu speed limit {_fmt(r['cpu_speed_limit_pct'], ' %', 0)}")
    for w in r["warnings"]:
        lines.append(f"warning     {w}")
    lines.append("plans (idle runtime):")
    for name, p in data["plans"].items():
        cap = f"{p['max_tokens_per_s']:.1f} tok/s" if p["max_tokens_per_s"] else "unpaced"
        lines.append(f"  {name:<13} {p['threads']} core{'s' if p['threads'] != 1 else ''}, {cap}, background "
                     f"{'admitted' if p['admit_background'] else 'refused'}  ({p['reason'] or p['level']})")
    return "\n".join(map(printable, lines))  # the device's own strings (a device-tree model, a command's output)

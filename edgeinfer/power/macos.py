"""macOS: battery and thermal state from `pmset` (no sysfs there).

`pmset -g batt` prints, e.g.:
    Now drawing from 'Battery Power'
     -InternalBattery-0 (id=4653155)	85%; discharging; 4:12 remaining present: true
on_ac: drawing from 'AC Power' (or 'UPS Power'), not 'Battery Power'. charging: the state after the
percentage: "charging", "charged" and "finishing charge" -> True (as Linux counts "Full"),
"discharging" and "AC attached" (AC attached; not charging) -> False. A Mac without a battery
prints only the first line: on_ac True, battery_pct None.

`pmset -g therm` prints "Note: No thermal warning level has been recorded" when there is no
thermal warning (-> thermal_status "nominal"), or a recorded level ("Thermal warning level = N",
spelled differently across macOS versions: matched loosely) -> "nominal" for 0, "warning" above;
and, after a CPU power notification, "CPU_Speed_Limit \t= 100" -> cpu_speed_limit_pct.

Both commands run with a 2 s timeout; their answers are reused for 5 s (reading at 2 Hz should not
start a process each time).
"""

from __future__ import annotations

import re

from .commands import CommandGate
from .linux_sysfs import Report, in_range

PMSET_BATT = ("pmset", "-g", "batt")
PMSET_THERM = ("pmset", "-g", "therm")
PMSET_TIMEOUT_S = 2.0
PMSET_CACHE_S = 5.0

_SOURCE = re.compile(r"Now drawing from '([^']+)'")
_BATTERY = re.compile(r"(-?\d+(?:\.\d+)?)%;\s*([^;\n]+)")
_SPEED = re.compile(r"^\s*CPU_Speed_Limit\s*=\s*(\S+)", re.MULTILINE)
_LEVEL = re.compile(r"thermal[ _]*(?:warning[ _]*)?level\s*[=:]\s*(\d{1,9})\b", re.IGNORECASE)  # a level, not 5,000 digits
_CHARGING = {"charging": True, "charged": True, "finishing charge": True,
             "discharging": False, "ac attached": False}


def parse_pmset_batt(text: str, report: Report) -> dict:
    """{"battery_pct", "charging", "on_ac"} from `pmset -g batt` (None where absent or garbage)."""
    out = {"battery_pct": None, "charging": None, "on_ac": None}
    m = _SOURCE.search(text)
    if m:
        out["on_ac"] = m.group(1) != "Battery Power"
    b = _BATTERY.search(text)
    if b:
        out["battery_pct"] = in_range(float(b.group(1)), 0, 100, "pmset battery", report)
        state = b.group(2).strip().lower()
        out["charging"] = _CHARGING.get(state)
        if state not in _CHARGING:
            report.warn(f"pmset -g batt: unknown battery state {state[:24]!r}")
    if not m and not b:
        report.warn(f"pmset -g batt: unexpected output {text.strip()[:32]!r}")
    return out


def parse_pmset_therm(text: str, report: Report) -> dict:
    """{"thermal_status", "cpu_speed_limit_pct"} from `pmset -g therm`."""
    out = {"thermal_status": None, "cpu_speed_limit_pct": None}
    level = _LEVEL.search(text)
    if level:
        out["thermal_status"] = "nominal" if int(level.group(1)) == 0 else "warning"
    elif "No thermal warning level has been recorded" in text:
        out["thermal_status"] = "nominal"
    speed = _SPEED.search(text)
    if speed:
        try:
            value = float(speed.group(1))
        except ValueError:
            report.warn(f"pmset -g therm: CPU_Speed_Limit not a number: {speed.group(1)[:24]!r}")
        else:
            out["cpu_speed_limit_pct"] = in_range(value, 0, 100, "pmset CPU_Speed_Limit", report)
    if out["thermal_status"] is None and not speed:
        report.warn(f"pmset -g therm: unexpected output {text.strip()[:32]!r}")
    return out


class MacOS:
    """`read(report)`: battery_pct, charging, on_ac, thermal_status, cpu_speed_limit_pct."""

    def __init__(self, commands: CommandGate):
        self.commands = commands

    def read(self, report: Report) -> None:
        for argv, parse, source in ((PMSET_BATT, parse_pmset_batt, "pmset batt"),
                                    (PMSET_THERM, parse_pmset_therm, "pmset therm")):
            out = self.commands.answer(argv, PMSET_TIMEOUT_S, report.warn, PMSET_CACHE_S)
            if out is None:
                continue
            values = parse(out, report)
            report.fields.update(values)
            if any(v is not None for v in values.values()):
                report.source(source)

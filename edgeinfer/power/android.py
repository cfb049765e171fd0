"""Android (Termux or adb shell): device name, battery and the system's thermal status.

Android is detected by `system/build.prop` under the root, or, live, by the ANDROID_ROOT or
TERMUX_VERSION environment variable. Thermal zones and (where SELinux allows) the power_supply
battery come from `linux_sysfs`; this module adds:
- device: "manufacturer model" from `system/build.prop` and `vendor/build.prop` (read once; the
  first of ro.product.model, ro.product.vendor.model, ro.product.system.model, and the same for
  the manufacturer).
- battery, only when sysfs gave none (apps are usually denied /sys/class/power_supply):
  `termux-battery-status` (Termux:API) prints JSON: "percentage" (0..100), "status"
  (CHARGING/DISCHARGING/FULL/NOT_CHARGING), "plugged" (UNPLUGGED/PLUGGED_AC/PLUGGED_USB/
  PLUGGED_WIRELESS), "temperature" (°C, added to zones as "battery (termux)"). Run with a 5 s
  timeout, answer reused for 10 s (it starts an Android activity, which is slow).
- thermal_status: `dumpsys thermalservice`'s "Thermal Status: N" -> ANDROID_THERMAL_STATUS[N]. Only
  a shell with the DUMP permission (adb, root) may run it; "Permission Denial" is a warning and the
  command is not run again for a minute. Timeout 3 s, answer reused for 5 s.
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from .commands import CommandGate
from .linux_sysfs import TEMP_RANGE_C, Report, SysfsTree, in_range, is_file
from .readings import ANDROID_THERMAL_STATUS

TERMUX_BATTERY = ("termux-battery-status",)
TERMUX_TIMEOUT_S, TERMUX_CACHE_S = 5.0, 10.0
DUMPSYS_THERMAL = ("dumpsys", "thermalservice")
DUMPSYS_TIMEOUT_S, DUMPSYS_CACHE_S = 3.0, 5.0
BUILD_PROPS = ("system/build.prop", "vendor/build.prop")
MODEL_KEYS = ("ro.product.model", "ro.product.vendor.model", "ro.product.system.model")
MAKER_KEYS = ("ro.product.manufacturer", "ro.product.vendor.manufacturer",
              "ro.product.system.manufacturer")
_STATUS = re.compile(r"^\s*Thermal Status:\s*(\S+)", re.MULTILINE)


def parse_build_prop(text: str) -> str | None:
    """The maker and model named by build.prop's key=value lines; None when it names no model."""
    props = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            props[key.strip()] = value.strip()
    model = next((props[k] for k in MODEL_KEYS if props.get(k)), None)
    maker = next((props[k] for k in MAKER_KEYS if props.get(k)), None)
    if not model:
        return None
    return model if not maker or model.lower().startswith(maker.lower()) else f"{maker} {model}"


def parse_termux_battery(text: str, report: Report) -> dict:
    """{"battery_pct", "charging", "on_ac", "temp_c"} from termux-battery-status JSON."""
    out = {"battery_pct": None, "charging": None, "on_ac": None, "temp_c": None}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        report.warn(f"termux-battery-status: not a JSON object: {text.strip()[:32]!r}")
        return out
    pct, temp = data.get("percentage"), data.get("temperature")
    if isinstance(pct, (int, float)) and not isinstance(pct, bool):
        try:
            out["battery_pct"] = in_range(float(pct), 0, 100, "termux-battery-status percentage", report)
        except OverflowError:  # an integer too long for a float
            report.warn("termux-battery-status: percentage absurd, dropped")
    elif pct is not None:
        report.warn(f"termux-battery-status: percentage not a number: {str(pct)[:24]!r}")
    status, plugged = data.get("status"), data.get("plugged")
    out["charging"] = {"CHARGING": True, "FULL": True, "DISCHARGING": False,
                       "NOT_CHARGING": False}.get(status) if isinstance(status, str) else None
    if isinstance(plugged, str) and (plugged == "UNPLUGGED" or plugged.startswith("PLUGGED_")):
        out["on_ac"] = plugged != "UNPLUGGED"
    if isinstance(temp, (int, float)) and not isinstance(temp, bool):
        try:
            out["temp_c"] = in_range(float(temp), *TEMP_RANGE_C, "termux-battery-status temperature", report)
        except OverflowError:
            report.warn("termux-battery-status: temperature absurd, dropped")
    return out


def parse_thermal_status(text: str, report: Report) -> str | None:
    """ANDROID_THERMAL_STATUS name of dumpsys thermalservice's "Thermal Status: N"."""
    m = _STATUS.search(text)
    if m is None:
        report.warn(f"dumpsys thermalservice: no Thermal Status line: {text.strip()[:32]!r}")
        return None
    if not m.group(1).isdigit() or len(m.group(1)) > 2 or int(m.group(1)) >= len(ANDROID_THERMAL_STATUS):
        report.warn(f"dumpsys thermalservice: unknown thermal status {m.group(1)[:24]!r}")
        return None
    return ANDROID_THERMAL_STATUS[int(m.group(1))]


class Android(SysfsTree):
    """`read(report)`: device, battery via Termux when sysfs had none, thermal_status. Runs after
    `LinuxSysfs` (it looks at what that found)."""

    def __init__(self, root, commands: CommandGate, live: bool, env: Mapping[str, str]):
        super().__init__(root)
        self.commands = commands
        self.live = live
        self.env = env
        self.device: str | None = None

    def is_android(self) -> bool:
        live_hint = self.live and ("ANDROID_ROOT" in self.env or "TERMUX_VERSION" in self.env)
        return live_hint or is_file(self.root / "system/build.prop")

    def read(self, report: Report) -> None:
        if self.stale:
            self.android = self.is_android()
            props = [self.optional_text(self.root / p, report) for p in BUILD_PROPS]
            self.device = parse_build_prop("\n".join(p for p in props if p))
            self.stale = False  # listed whole (an error on the way: listed again at the next read)
        if not self.android:
            return
        f = report.fields
        if self.device:
            f["device"] = self.device
            report.source("build.prop")
        if f.get("battery_pct") is None:
            self._termux_battery(report)
        f["thermal_status"] = self._thermal_status(report)

    def _termux_battery(self, report: Report) -> None:
        out = self.commands.answer(TERMUX_BATTERY, TERMUX_TIMEOUT_S, report.warn, TERMUX_CACHE_S)
        if out is None:
            return
        values = parse_termux_battery(out, report)
        temp_c = values.pop("temp_c")
        if temp_c is not None:
            zones = report.fields.get("zones", ())
            report.fields["zones"] = zones + (("battery (termux)", temp_c),)
        if values["battery_pct"] is not None:
            report.fields.update(values)
            report.source("termux-battery-status")

    def _thermal_status(self, report: Report) -> str | None:
        out = self.commands.answer(DUMPSYS_THERMAL, DUMPSYS_TIMEOUT_S, report.warn, DUMPSYS_CACHE_S)
        if out is None:
            return None
        if "Permission Denial" in out:
            report.warn("dumpsys thermalservice: not permitted (needs the DUMP permission)")
            self.commands.fail(DUMPSYS_THERMAL)
            return None
        status = parse_thermal_status(out, report)
        if status is not None:
            report.source("dumpsys thermalservice")
        return status

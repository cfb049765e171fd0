"""Linux sysfs sensors under a root directory ("/" live, a recorded fixture tree in tests).

Read (units as the kernel documents them):
- `sys/class/thermal/thermal_zone*/`: `type`, `temp` (m°C), `trip_point_N_type`,
  `trip_point_N_temp`.
- `sys/class/hwmon/hwmon*/`: `name`, `tempN_input` (m°C), `tempN_label`. A hwmon whose name is a
  thermal zone's type with '-' turned into '_' is that zone's mirror (the thermal core registers
  one) and is skipped.
- `sys/devices/system/cpu/cpu*/cpufreq/`: `scaling_cur_freq`, `scaling_max_freq`, `cpuinfo_max_freq`
  (kHz). CPUs sharing a policy directory are read once and weighted by their count.
- `sys/class/power_supply/*/`: `type`, `scope`, `capacity` (%), `status`, `online`, `power_now`
  (µW), `current_now` (µA), `voltage_now` (µV). Supplies with scope "Device" (a mouse's battery)
  are skipped.
- `sys/devices/system/cpu/online` ("0-3,6"); the board (`boards`: `proc/device-tree/model` or
  `sys/firmware/devicetree/base/model`, NUL-terminated, else a Pi kernel's cpuinfo `Model` line),
  else `sys/class/dmi/id/product_name` (a PC's name: shown as the device, never a board).

Which temperatures are the CPU/SoC (`temp_c`, and the zones whose trip points count): a sensor
whose lowercased name (zone type, or "hwmon name/label") contains one of `CPU_WORDS` and none of
`NOT_CPU_WORDS` (batteries, chargers, PMICs, skin/ambient/case sensors, modems, drives, Wi-Fi).
Zones that are not temperatures at all are skipped: Qualcomm's battery monitors "soc"/"socd"
(state of charge) and "*ibat*"/"*vbat*"/"*vph*" (current, voltage).
`temp_c` is the hottest such sensor; `throttle_temp_c` the lowest "passive" trip point of such a
zone, `critical_temp_c` the lowest "critical" one (trip points <= 0 are disabled ones, ignored;
one under 30 °C is absurd: a value written in °C instead of m°C).
Names and trip points are read when the files are listed, temperatures at every read.

Battery: `battery_pct` the mean capacity; `charging` True for status Charging/Full, False for
Discharging/Not charging, None for Unknown; `on_ac` True when any Mains/USB*/Wireless supply has
online=1, False when there are such supplies and none is online, else from the battery status;
`power_w` the discharging batteries' draw: power_now, or |current_now| x voltage_now (the ABI lets
current_now be negative while discharging); None while charging (that is not the device's draw).

Bad input never raises: a vanished, unreadable, empty, garbage or absurd file gives None for what
it fed and a line in `warnings`; a vanished file also makes the next read list the files again.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.boards import MODEL_FILES, READ_LIMIT, cpuinfo_board, parse_cpuinfo

TEMP_RANGE_C = (-40.0, 150.0)
FAULT_MILLIDEGREES = (0.0, -1.0)  # what unconnected or failing sensors read (a hot device read "-1" for 2 s and its
# plan went cool and unpaced: a hostile round); a real 0.000 °C die is no device's concern here
TRIP_RANGE_C = (30.0, 150.0)  # a throttle point under 30 °C is a trip point written in °C, not m°C
POWER_MAX_W = 1000.0
FREQ_MAX_MHZ = 20000.0

CPU_WORDS = ("cpu", "soc", "core", "package", "x86_pkg", "k10temp", "zenpower", "tctl", "tdie",
             "tccd", "tj", "gpu", "acpitz", "cluster", "big", "mid", "little", "tsens")
NOT_CPU_WORDS = ("bat", "charg", "chg", "pmic", "pm8", "pmi", "pmk", "pmr", "pmx", "skin", "amb",
                 "xo-", "xo_", "case", "usb", "conn", "quiet", "modem", "mdm", "nvme", "wlan",
                 "wifi", "drive", "disk")
NOT_TEMPERATURE_NAMES = ("soc", "socd")
NOT_TEMPERATURE_WORDS = ("ibat", "vbat", "vph")
EXTERNAL_SUPPLY_TYPES = ("Mains", "Wireless")  # and every type starting with "USB"
STATUSES = ("Charging", "Full", "Discharging", "Not charging", "Unknown")


def is_cpu_sensor(name: str) -> bool:
    """The CPU/SoC rule of the module docstring."""
    n = name.lower()
    return any(w in n for w in CPU_WORDS) and not any(w in n for w in NOT_CPU_WORDS)


def is_temperature_zone(name: str) -> bool:
    """False for the thermal zones that report no temperature (battery monitors)."""
    n = name.lower()
    return n not in NOT_TEMPERATURE_NAMES and not any(w in n for w in NOT_TEMPERATURE_WORDS)


class Report:
    """What one read gathered: `fields` for Readings, `sources` read, `warnings`."""

    def __init__(self):
        self.fields: dict = {}
        self.board: str | None = None  # the board's model string (`boards`), which the Pi and Jetson readers go by
        self.sources: list[str] = []
        self.warnings: list[str] = []

    def source(self, name: str) -> None:
        if name not in self.sources:
            self.sources.append(name)

    def warn(self, line: str) -> None:
        if line not in self.warnings:
            self.warnings.append(line)


def in_range(value: float | None, lo: float, hi: float, what: str, report: Report) -> float | None:
    """`value` when lo <= value <= hi, else None and a warning ("absurd")."""
    if value is None:
        return None
    if lo <= value <= hi:
        return value
    report.warn(f"{what}: absurd value {value:g}, dropped")
    return None


def is_file(path: Path) -> bool:
    """`path.is_file()`, False where this process may not look (Python before 3.12 raises
    PermissionError from is_file under a folder it may not enter: Android apps, locked-down boards)."""
    try:
        return path.is_file()
    except OSError:
        return False


def is_dir(path: Path) -> bool:
    """`path.is_dir()`, False where this process may not look (as `is_file`)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def read_regular(path: Path, limit: int) -> bytes | None:
    """At most `limit` bytes of `path`, or None when it is no regular file. Checked by name first, so a
    device node is never opened (opening /dev/watchdog arms it), then opened without blocking and
    checked again, so a FIFO swapped in between never blocks the read. OSError propagates."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    with open(fd, "rb") as f:
        return f.read(limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _quiet_text(path: Path) -> str:
    """A file's text for optional evidence ("" when it is not a readable regular file): no warning."""
    try:
        data = read_regular(path, READ_LIMIT)
    except (OSError, ValueError):
        return ""
    return data.decode("utf-8", "replace") if data else ""


class SysfsTree:
    """File reading under `root` that never raises. `stale` is set when a known file vanished."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.stale = True

    def rel(self, path: Path) -> str:
        """`path` as the warnings name it: relative to the root."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def text(self, path: Path, report: Report) -> str | None:
        """The file's text, stripped of whitespace and NULs; None (and a warning) when it vanished,
        is unreadable or empty."""
        try:
            data = read_regular(path, 65536)
            if data is None:
                report.warn(f"{self.rel(path)}: not a regular file, skipped")
                return None
        except FileNotFoundError:
            report.warn(f"{self.rel(path)}: vanished")
            self.stale = True
            return None
        except PermissionError:
            report.warn(f"{self.rel(path)}: permission denied")
            return None
        except OSError as e:
            report.warn(f"{self.rel(path)}: unreadable ({e.strerror or e})")
            return None
        text = data.decode("utf-8", "replace").replace("\0", "").strip()
        if not text:
            report.warn(f"{self.rel(path)}: empty")
            return None
        return text

    def number(self, path: Path, report: Report) -> float | None:
        """The file's number (an integer or decimal); None and a warning for garbage."""
        text = self.text(path, report)
        if text is None:
            return None
        try:  # a plain integer or decimal only: float() would take "8_5_000" (85 °C) and "nan"
            if re.fullmatch(r"[+-]?\d{1,30}", text):
                return float(int(text))
            if not re.fullmatch(r"[+-]?\d{1,30}\.\d{1,30}", text):
                raise ValueError(text)
            return float(text)
        except (ValueError, OverflowError):  # garbage, or an integer too long for a float
            report.warn(f"{self.rel(path)}: not a number: {text[:24]!r}")
            return None

    def optional_text(self, path: Path, report: Report) -> str | None:
        """Like `text`, but a file that does not exist is simply None (no warning)."""
        return self.text(path, report) if is_file(path) else None


def numbered(folder: Path, glob: str) -> list[Path]:
    """`folder.glob(glob)` in the numeric order of the names' first numbers (zone2 before zone10)."""
    def key(path: Path) -> tuple[int, str]:
        m = re.search(r"\d+", path.name)
        return (int(m.group()) if m else -1, path.name)

    return sorted(folder.glob(glob), key=key)


MAX_CPUS = 4096  # the kernel's usual NR_CPUS ceiling: more is garbage


def parse_cpu_list(text: str) -> int | None:
    """How many CPUs a kernel CPU list names ("0-3,6" -> 5); None for garbage or over MAX_CPUS."""
    count = 0
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (1, 0)
        if hi < lo:
            return None
        count += hi - lo + 1
    return count if count <= MAX_CPUS else None


@dataclass
class _Sensor:
    name: str
    path: Path
    cpu: bool
    passive_c: list[float] = field(default_factory=list)
    critical_c: list[float] = field(default_factory=list)


class LinuxSysfs(SysfsTree):
    """The readers of the module docstring. `read(report)` fills `report.fields` with device,
    temp_c, throttle_temp_c, critical_temp_c, zones, cpu_freq_mhz, cpu_max_freq_mhz, battery_pct,
    charging, on_ac, power_w and cpu_count (from the online-CPUs file, unless `read_online` is
    False: the live system counts the CPUs this process may use instead)."""

    read_online = True

    def discover(self, report: Report) -> None:
        """List the sensor files (again). Reads names, types and trip points once."""
        r = self.root
        self.sensors: list[_Sensor] = []
        zone_types = set()
        for zone in numbered(r / "sys/class/thermal", "thermal_zone*"):
            if not is_file(zone / "temp"):
                if os.path.lexists(zone / "temp"):  # a FIFO, a folder, a link loop: said, not silently lost
                    report.warn(f"{self.rel(zone / 'temp')}: not a regular file, zone skipped")
                continue
            name = self.optional_text(zone / "type", report) or zone.name
            zone_types.add(name.replace("-", "_"))
            if not is_temperature_zone(name):
                continue
            sensor = _Sensor(name, zone / "temp", is_cpu_sensor(name))
            for type_file in numbered(zone, "trip_point_*_type"):
                kind = self.text(type_file, report)
                if kind not in ("passive", "critical"):
                    continue
                temp_file = zone / type_file.name.replace("_type", "_temp")
                temp_c = self.number(temp_file, report)
                if temp_c is None or temp_c <= 0:
                    continue
                temp_c = in_range(temp_c / 1000, *TRIP_RANGE_C, self.rel(temp_file), report)
                if temp_c is not None:
                    (sensor.passive_c if kind == "passive" else sensor.critical_c).append(temp_c)
            self.sensors.append(sensor)
        for hwmon in numbered(r / "sys/class/hwmon", "hwmon*"):
            chip = self.optional_text(hwmon / "name", report) or hwmon.name
            if chip in zone_types:
                continue
            for inp in numbered(hwmon, "temp*_input"):
                label_file = hwmon / inp.name.replace("_input", "_label")
                label = self.optional_text(label_file, report) or inp.name.replace("_input", "")
                name = f"{chip}/{label}"
                self.sensors.append(_Sensor(name, inp, is_cpu_sensor(name)))
        policies: dict[Path, tuple[Path, int]] = {}  # real folder: (first path to it, CPUs)
        cpu_dirs = numbered(r / "sys/devices/system/cpu", "cpu[0-9]*")
        for cpufreq in [d / "cpufreq" for d in cpu_dirs if is_dir(d / "cpufreq")]:
            first, cpus = policies.get(cpufreq.resolve(), (cpufreq, 0))
            policies[cpufreq.resolve()] = (first, cpus + 1)
        self.cpufreq = [(folder / name, name, cpus) for folder, cpus in policies.values()
                        for name in ("scaling_cur_freq", "scaling_max_freq", "cpuinfo_max_freq")
                        if is_file(folder / name)]
        self.supplies = []  # (name, type, {file name: path}) of the files it has
        for supply in sorted(r.glob("sys/class/power_supply/*")):
            kind = self.optional_text(supply / "type", report)
            if kind is None or self.optional_text(supply / "scope", report) == "Device":
                continue
            names = ("capacity", "status", "power_now", "current_now", "voltage_now", "online")
            files = {n: supply / n for n in names if is_file(supply / n)}
            self.supplies.append((supply.name, kind, files))
        self.board = None
        for model in MODEL_FILES:
            self.board = self.optional_text(r / model, report)
            if self.board:
                break
        if not self.board:  # a container masks /sys/firmware, and so the device tree: a Pi kernel's cpuinfo
            self.board = cpuinfo_board(parse_cpuinfo(_quiet_text(r / "proc/cpuinfo")))  # names the board too
        self.device = self.board or self.optional_text(r / "sys/class/dmi/id/product_name", report)  # (a PC's: shown)
        if self.device:
            report.source("device_model")
        online = r / "sys/devices/system/cpu/online"
        self.online_file = online if self.read_online and is_file(online) else None
        self.stale = False  # listed whole: a listing cut short by an error is tried again at the next read

    def read(self, report: Report) -> None:
        if self.stale:
            self.discover(report)
        f = report.fields
        f["device"], report.board = self.device, self.board
        self._read_temperatures(report)
        self._read_cpufreq(report)
        self._read_power_supply(report)
        if self.online_file is not None:
            text = self.text(self.online_file, report)
            count = parse_cpu_list(text) if text is not None else None
            if text is not None and count is None:
                report.warn(f"{self.rel(self.online_file)}: not a CPU list: {text[:24]!r}")
            f["cpu_count"] = count
            if count is not None:
                report.source("cpu_online")

    def _read_temperatures(self, report: Report) -> None:
        zones, cpu_temps, passive, critical = [], [], [], []
        for s in self.sensors:
            raw = self.number(s.path, report)
            if raw in FAULT_MILLIDEGREES:
                report.warn(f"{s.name}: {raw:g} m°C, a sensor's fault value, dropped")
                raw = None
            temp_c = in_range(None if raw is None else raw / 1000, *TEMP_RANGE_C, s.name, report)
            if s.cpu:
                passive += s.passive_c
                critical += s.critical_c
            if temp_c is None:
                continue
            zones.append((s.name, temp_c))
            report.source("hwmon" if "/" in s.name else "thermal_zone")
            if s.cpu:
                cpu_temps.append(temp_c)
        f = report.fields
        f["zones"] = tuple(zones)
        f["temp_c"] = max(cpu_temps) if cpu_temps else None
        f["throttle_temp_c"] = min(passive) if passive else None
        f["critical_temp_c"] = min(critical) if critical else None

    def _read_cpufreq(self, report: Report) -> None:
        cur_sum, cur_cpus, maxima = 0.0, 0, []
        for path, name, cpus in self.cpufreq:
            khz = self.number(path, report)
            mhz = in_range(None if khz is None else khz / 1000, 1e-9, FREQ_MAX_MHZ,
                           self.rel(path), report)
            if mhz is None:
                continue
            report.source("cpufreq")
            if name == "scaling_cur_freq":
                cur_sum, cur_cpus = cur_sum + mhz * cpus, cur_cpus + cpus
            else:
                maxima.append(mhz)
        # the mean to 1 kHz, the files' resolution
        report.fields["cpu_freq_mhz"] = round(cur_sum / cur_cpus, 3) if cur_cpus else None
        report.fields["cpu_max_freq_mhz"] = max(maxima) if maxima else None

    def _read_power_supply(self, report: Report) -> None:
        pcts, statuses, online, draw_w, external = [], [], [], [], False
        for name, kind, files in self.supplies:
            get = lambda n: self.number(files[n], report) if n in files else None  # noqa: E731
            if kind == "Battery":
                pct = in_range(get("capacity"), 0, 100, f"power_supply/{name} capacity", report)
                status = self.text(files["status"], report) if "status" in files else None
                if status not in (None, *STATUSES):
                    report.warn(f"power_supply/{name} status: unknown value {status[:24]!r}")
                    status = None
                if pct is not None:
                    pcts.append(pct)
                if pct is not None or status is not None:
                    statuses.append(status)
                    report.source("power_supply")
                if status == "Discharging":
                    draw_w.append(self._draw_w(name, get, report))
            elif kind in EXTERNAL_SUPPLY_TYPES or kind.startswith("USB"):
                external, value = True, get("online")
                if value is not None:
                    online.append(value >= 1)
                    report.source("power_supply")
        known = [x for x in statuses if x not in (None, "Unknown")]
        f = report.fields
        f["battery_pct"] = sum(pcts) / len(pcts) if pcts else None
        f["charging"] = any(x in ("Charging", "Full") for x in known) if known else None
        if any(online) or (external and online):  # external power present or known absent
            f["on_ac"] = any(online)
        else:  # no readable charger: what the battery status implies
            f["on_ac"] = (f["charging"] or "Not charging" in known) if known else None
        f["power_w"] = None if not draw_w or None in draw_w else sum(draw_w)

    def _draw_w(self, name: str, get, report: Report) -> float | None:
        """A discharging battery's draw: power_now, or |current_now| x voltage_now."""
        uw = get("power_now")
        if uw is None:
            ua, uv = get("current_now"), get("voltage_now")
            uw = None if ua is None or uv is None else abs(ua) * uv / 1e6
        w = None if uw is None else uw / 1e6
        return in_range(w, 0, POWER_MAX_W, f"power_supply/{name} power", report)

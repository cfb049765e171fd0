"""`Sensors`: one `Readings` from everything the device offers, cheap enough to read at 2 Hz.

- Linux and Android: `linux_sysfs` (thermal zones, hwmon, cpufreq, power_supply, online CPUs,
  device model), then `raspberry_pi`, `jetson` and `android` (each does nothing on other devices).
- macOS ("darwin"): `macos` (pmset).
- Anywhere: when nothing above gave a battery, `battery_fn()` (psutil.sensors_battery's contract:
  None, or an object with .percent and .power_plugged). It defaults to psutil's only when reading
  the live system (root "/"); tests pass their own.

File paths are listed once and again when a known file vanished or every `REDISCOVER_S` (a charger
or sensor that appeared); each read is then a handful of small file reads. Commands go through a
`CommandGate`: one that timed out, failed or is missing is not run again for 60 s, and slow ones
(nvpmodel, pmset, termux, dumpsys) have their answers reused for a few seconds.

`cpu_count`: live, the CPUs this process may run on (`os.sched_getaffinity`); for a recorded tree,
the count in `sys/devices/system/cpu/online`.

`sensors_from_fixture(folder)` reads a recorded device: `root/` (the files), `commands.json`
({command line: output or null}) and `platform.txt` ("linux" or "darwin").
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from edgeinfer import small_files
from edgeinfer.errors import InvalidArgumentError

from .android import Android
from .commands import CommandGate, CommandRunner, RecordedCommands, run_command
from .jetson import Jetson
from .linux_sysfs import LinuxSysfs, Report, in_range
from .macos import MacOS
from .raspberry_pi import RaspberryPi
from .readings import Readings

REDISCOVER_S = 60.0
REDISCOVER_MISSING_S = 5.0  # sooner while a field read before is missing (a zone gone and back: a driver reload)


def _psutil_battery():
    import psutil

    fn = getattr(psutil, "sensors_battery", None)
    return fn() if fn is not None else None


class Sensors:
    """Reads the device's sensors: `read() -> Readings`. Never raises."""

    def __init__(self, root="/", run: CommandRunner = run_command, platform: str = sys.platform,
                 battery_fn: Callable | None = None, clock: Callable[[], float] = time.monotonic):
        self.root = Path(root)
        self.live = self.root == Path("/")
        self.run = run
        self.platform = platform
        self.clock = clock
        self.battery_fn = battery_fn if battery_fn is not None else (
            _psutil_battery if self.live else None)
        self.commands = CommandGate(run, clock)
        self.linux = platform.startswith("linux") or platform == "android"
        self.darwin = platform == "darwin"
        self.sysfs = LinuxSysfs(self.root)
        self.sysfs.read_online = not self.live
        self.pi = RaspberryPi(self.root, self.commands)
        self.jetson = Jetson(self.root, self.commands)
        self.android = Android(self.root, self.commands, self.live, os.environ if self.live else {})
        self.macos = MacOS(self.commands)
        self._listed_at: float | None = None
        self._seen: set[str] = set()  # the fields some reading gave

    def read(self) -> Readings:
        now = self.clock()
        report = Report()
        self._read_into(report, now)
        fields = {k: v for k, v in report.fields.items() if k in Readings.__dataclass_fields__}
        given = {k for k, v in fields.items() if v is not None}
        if self._seen - given and self._listed_at is not None:  # list the files again within REDISCOVER_MISSING_S,
            # not REDISCOVER_S: a cap set while hot stayed for a minute after the sensor came back (a Jetson review)
            self._listed_at = min(self._listed_at, now - REDISCOVER_S + REDISCOVER_MISSING_S)
        self._seen |= given
        return Readings(time_s=now, **fields, sources=tuple(report.sources),
                        warnings=tuple(report.warnings))

    def _read_into(self, report: Report, now: float) -> None:
        if self._listed_at is None or now - self._listed_at >= REDISCOVER_S:
            for reader in (self.sysfs, self.pi, self.jetson, self.android):
                reader.stale = True
            self._listed_at = now
        readers = (self.sysfs, self.pi, self.jetson, self.android) if self.linux else (
            (self.macos,) if self.darwin else ())
        for reader in readers:
            try:
                reader.read(report)
            except Exception as e:  # a reader's bug must cost its fields, not the caller
                report.warn(f"{type(reader).__name__}: internal error {type(e).__name__}: {e}")
        if report.fields.get("battery_pct") is None and self.battery_fn is not None:
            self._read_battery_fn(report)
        if self.live:
            if hasattr(os, "sched_getaffinity"):
                report.fields["cpu_count"] = len(os.sched_getaffinity(0))
                report.source("sched_getaffinity")
            else:
                report.fields["cpu_count"] = os.cpu_count()

    def _read_battery_fn(self, report: Report) -> None:
        try:
            battery = self.battery_fn()
        except Exception as e:
            report.warn(f"battery: {type(e).__name__}: {e}")
            return
        if battery is None:
            return
        percent = getattr(battery, "percent", None)
        if not isinstance(percent, (int, float)):
            report.warn(f"battery: percent not a number: {str(percent)[:24]!r}")
            return
        pct = in_range(float(percent), 0, 100, "battery percent", report)
        if pct is None:
            return
        report.fields["battery_pct"] = pct
        plugged = getattr(battery, "power_plugged", None)
        if report.fields.get("on_ac") is None and isinstance(plugged, bool):
            report.fields["on_ac"] = plugged
        report.source("psutil")


def _recorded(path: Path) -> str:
    return small_files.read_text(path, small_files.MAX_RECORDED_BYTES, ValueError)


def sensors_from_fixture(folder: Path | str,
                         clock: Callable[[], float] = time.monotonic) -> Sensors:
    """Sensors reading a recorded device folder: `root/`, `commands.json` ({command line: output or
    null}), `platform.txt`. A malformed folder raises InvalidArgumentError naming the file."""
    folder = Path(folder)
    commands_file, platform_file = folder / "commands.json", folder / "platform.txt"
    try:  # bounded reads (a file of gigabytes is no recording); RecursionError: nested too deeply
        outputs = json.loads(_recorded(commands_file)) if commands_file.is_file() else {}
        platform = _recorded(platform_file).strip() if platform_file.is_file() else "linux"
    except (ValueError, RecursionError) as e:  # ValueError: also the bounded read's own errors
        raise InvalidArgumentError(f"{folder} is not a readable recorded device: {str(e)[:200]}") from None
    if not isinstance(outputs, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                                for k, v in outputs.items()):
        raise InvalidArgumentError(f"{commands_file} must be a JSON object of command line -> output (or null)")
    check_recording(folder, platform)
    return Sensors(folder / "root", run=RecordedCommands(outputs), platform=platform, clock=clock)


RECORDED_PLATFORMS = ("linux", "android", "darwin", "win32")  # sys.platform values a recording may give


def check_recording(folder: Path, platform: str) -> None:
    """InvalidArgumentError for a folder that is the live system's root (its /root is no recording:
    `--root /` read /root/sys and said "read: nothing") or whose platform.txt no sys.platform gives."""
    if folder.resolve() == Path(folder.anchor or "/").resolve():
        raise InvalidArgumentError(f"{folder} is this system's root, not a recorded device: leave out --root to "
                                   "read this device")
    if platform not in RECORDED_PLATFORMS:
        raise InvalidArgumentError(f"{folder / 'platform.txt'} says {platform[:40]!r}: a recording's platform is one "
                                   f"of {', '.join(RECORDED_PLATFORMS)} (Python's sys.platform)")

"""NVIDIA Jetson: INA3221 power rails, GPU load and frequency, and the nvpmodel power mode.

Only on a Jetson (`boards`: the board's model string names a Jetson or an Orin, or
`etc/nv_tegra_release` has some text):
- Rails: a hwmon whose `name` is "ina3221": each channel N with `inN_label` (e.g. VDD_IN,
  VDD_CPU_GPU_CV, VDD_SOC), `inN_input` (mV) and `currN_input` (mA) is a rail of mV x mA / 1e6 W
  ("sum of shunt voltages" channels are skipped). power_w is the VDD_IN rail (the whole module's
  input) when there is one.
- GPU load: the `load` file (per mille) of the GPU platform device (`GPU_LOAD_GLOBS`).
- GPU frequency: `sys/class/devfreq/*` whose name contains gpu/ga10b/gv11b/gp10b: `cur_freq` (Hz).
- Power mode: `nvpmodel -q` ("NV Power Mode: 15W\\n0\\n" -> "15W"), run with a 5 s timeout and
  its answer reused for 30 s because it is slow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.boards import READ_LIMIT, TEGRA_RELEASE, names_jetson, release_text

from .commands import CommandGate
from .linux_sysfs import FREQ_MAX_MHZ, POWER_MAX_W, Report, SysfsTree, in_range, is_file, numbered, read_regular

NVPMODEL = ("nvpmodel", "-q")
NVPMODEL_TIMEOUT_S = 5.0
NVPMODEL_CACHE_S = 30.0
GPU_LOAD_GLOBS = ("sys/devices/platform/gpu.0/load", "sys/devices/gpu.0/load",
                  "sys/devices/platform/*.gpu/load", "sys/devices/platform/*.ga10b/load",
                  "sys/devices/platform/bus@0/*.gpu/load",
                  "sys/devices/platform/bus@0/*.ga10b/load")
GPU_DEVFREQ_WORDS = ("gpu", "ga10b", "gv11b", "gp10b")
TOTAL_RAIL = "VDD_IN"


def is_jetson(device: str | None, root: Path) -> bool:
    """By the model string, else by a non-empty etc/nv_tegra_release (`boards`: as the profiles decide)."""
    if names_jetson(device):
        return True
    try:
        data = read_regular(root / TEGRA_RELEASE, READ_LIMIT)
    except (OSError, ValueError):
        return False
    return data is not None and release_text(data) is not None


def parse_nvpmodel(text: str) -> str | None:
    """The mode name of `nvpmodel -q` output ("NV Power Mode: 15W" -> "15W"); None if absent."""
    m = re.search(r"^NV Power Mode:\s*(\S.*?)\s*$", text, re.MULTILINE)
    return m.group(1) if m else None


@dataclass
class _Rail:
    name: str
    mv_path: Path
    ma_path: Path


class Jetson(SysfsTree):
    """`read(report)`: sets rails, power_w (VDD_IN), gpu_load_pct, gpu_freq_mhz, power_mode. Needs
    report.board from `LinuxSysfs` first."""

    def __init__(self, root, commands: CommandGate):
        super().__init__(root)
        self.commands = commands

    def discover(self, report: Report) -> None:
        self.enabled = is_jetson(report.board, self.root)
        self.rails: list[_Rail] = []
        self.gpu_load = self.gpu_freq = None
        if not self.enabled:
            self.stale = False
            return
        for hwmon in sorted(self.root.glob("sys/class/hwmon/hwmon*")):
            if self.optional_text(hwmon / "name", report) != "ina3221":
                continue
            for label_file in numbered(hwmon, "in*_label"):
                n = label_file.name[2:-len("_label")]
                mv, ma = hwmon / f"in{n}_input", hwmon / f"curr{n}_input"
                label = self.text(label_file, report)
                if label and "sum" not in label.lower() and is_file(mv) and is_file(ma):
                    self.rails.append(_Rail(label, mv, ma))
        self.gpu_load = next((p for g in GPU_LOAD_GLOBS for p in sorted(self.root.glob(g))), None)
        self.gpu_freq = next((d / "cur_freq" for d in sorted(self.root.glob("sys/class/devfreq/*"))
                              if any(w in d.name.lower() for w in GPU_DEVFREQ_WORDS)
                              and is_file(d / "cur_freq")), None)
        self.stale = False  # listed whole (an error on the way: listed again at the next read)

    def read(self, report: Report) -> None:
        if self.stale:
            self.discover(report)
        if not self.enabled:
            return
        f = report.fields
        rails = []
        for rail in self.rails:
            mv, ma = self.number(rail.mv_path, report), self.number(rail.ma_path, report)
            watts = None if mv is None or ma is None else mv * ma / 1e6
            watts = in_range(watts, 0, POWER_MAX_W, f"ina3221 {rail.name}", report)
            if watts is not None:
                rails.append((rail.name, watts))
                report.source("ina3221")
        f["rails"] = tuple(rails)
        if any(name == TOTAL_RAIL for name, _ in rails):
            f["power_w"] = dict(rails)[TOTAL_RAIL]
        if self.gpu_load is not None:
            permille = self.number(self.gpu_load, report)
            pct = in_range(None if permille is None else permille / 10, 0, 100,
                           self.rel(self.gpu_load), report)
            f["gpu_load_pct"] = pct
            if pct is not None:
                report.source("gpu_load")
        if self.gpu_freq is not None:
            hz = self.number(self.gpu_freq, report)
            mhz = in_range(None if hz is None else hz / 1e6, 1e-9, FREQ_MAX_MHZ,
                           self.rel(self.gpu_freq), report)
            f["gpu_freq_mhz"] = mhz
            if mhz is not None:
                report.source("devfreq")
        f["power_mode"] = self._power_mode(report)

    def _power_mode(self, report: Report) -> str | None:
        mode = self.commands.answer(NVPMODEL, NVPMODEL_TIMEOUT_S, report.warn, NVPMODEL_CACHE_S, parse_nvpmodel)
        if mode is not None:
            report.source("nvpmodel")
        return mode

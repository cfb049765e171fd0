"""Raspberry Pi firmware throttle flags and the Pi 4/5 soft temperature limit.

Only on a Raspberry Pi (the board's model string names one, `boards.names_raspberry_pi`):
- Throttle flags: the kernel's `sys/devices/platform/soc*/soc*:firmware/get_throttled` (a hex
  number, "50005" or "0x50005"), or, where that file is absent, `vcgencmd get_throttled` (prints
  "throttled=0x50005") run with a 1 s timeout -> `PiThrottle.from_mask`. A command that gave no
  answer is not run again for a minute (see `CommandGate`).
- throttle_temp_c on a Pi 4 or 5 (Pi 400/500 and Compute Modules 4/5 included): the firmware's
  documented soft limit, 80 °C (Raspberry Pi documentation, "Frequency management and thermal
  control": the ARM cores are throttled between 80 and 85 °C, ARM and GPU above 85 °C), unless the
  kernel reported a passive trip point (which then wins).
"""

from __future__ import annotations

import re

from edgeinfer.boards import names_pi4_or_pi5, names_raspberry_pi

from .commands import CommandGate
from .linux_sysfs import Report, SysfsTree
from .readings import PiThrottle

VCGENCMD = ("vcgencmd", "get_throttled")
VCGENCMD_TIMEOUT_S = 1.0
PI45_SOFT_LIMIT_C = 80.0


def parse_throttle_mask(text: str) -> int | None:
    """The mask of "0x50005", "50005" or "throttled=0x50005"; None for anything else."""
    text = text.strip()
    if text.startswith("throttled="):
        text = text[len("throttled="):]
    if not re.fullmatch(r"(0[xX])?[0-9a-fA-F]{1,8}", text):  # the firmware's mask is 32 bits (bits 0-19 used)
        return None
    return int(text, 16)


class RaspberryPi(SysfsTree):
    """`read(report)`: sets pi_throttle and (Pi 4/5) throttle_temp_c. Needs report.board from
    `LinuxSysfs` first."""

    def __init__(self, root, commands: CommandGate):
        super().__init__(root)
        self.commands = commands

    def discover(self) -> None:
        found = sorted(self.root.glob("sys/devices/platform/soc*/soc*:firmware/get_throttled"))
        self.throttled_file = found[0] if found else None
        self.stale = False  # listed whole (an error on the way: listed again at the next read)

    def read(self, report: Report) -> None:
        device = report.board
        if not names_raspberry_pi(device):
            return
        if self.stale:
            self.discover()
        if names_pi4_or_pi5(device) and report.fields.get("throttle_temp_c") is None:
            report.fields["throttle_temp_c"] = PI45_SOFT_LIMIT_C
        if self.throttled_file is not None:
            mask = self._mask_from_file(report)
        else:
            mask = self._mask_from_vcgencmd(report)
        report.fields["pi_throttle"] = None if mask is None else PiThrottle.from_mask(mask)

    def _mask_from_file(self, report: Report) -> int | None:
        text = self.text(self.throttled_file, report)
        if text is None:
            return None
        mask = parse_throttle_mask(text)
        if mask is None:
            report.warn(f"{self.rel(self.throttled_file)}: not a hex mask: {text[:24]!r}")
            return None
        report.source("get_throttled")
        return mask

    def _mask_from_vcgencmd(self, report: Report) -> int | None:
        mask = self.commands.answer(VCGENCMD, VCGENCMD_TIMEOUT_S, report.warn, parse=parse_throttle_mask)
        if mask is not None:
            report.source("vcgencmd")
        return mask

"""Which board a device's model string names: the one rule that the device profiles
(`platform_rules`, `inspect --platform`) and the power sensors (`power.raspberry_pi`,
`power.jetson`, `power.linux_sysfs`) share, so that a device is a Pi or a Jetson to both or to
neither (a hostile round: a Pi in a container, its device tree masked, was a Pi to the profile by
its cpuinfo and not to the sensors, which then never read its under-voltage flags).

The board's model string comes from the device tree (`MODEL_FILES`), else, on a Raspberry Pi
kernel, the `Model` line of /proc/cpuinfo (`cpuinfo_board`); case does not matter. DMI's product
name names a PC, never one of these boards (an "Orin" gaming laptop is not a Jetson): the sensors
show it as the device, and go by the board alone. A Jetson without a model string shows by the text
of etc/nv_tegra_release (`release_text`: not empty once NULs and whitespace are gone).
"""

from __future__ import annotations

import re

MODEL_FILES = ("proc/device-tree/model", "sys/firmware/devicetree/base/model")
TEGRA_RELEASE = "etc/nv_tegra_release"
READ_LIMIT = 65536  # bytes read of any of these files (the first CPU's block of cpuinfo is near the start)

_ORIN = re.compile(r"\borin\b")
_PI45 = re.compile(r"raspberry pi (?:compute module )?[45]")


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first value of each "key : value" line of /proc/cpuinfo, keys lowercased."""
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if sep and key and key not in info:
            info[key] = value.strip()
    return info


def release_text(data: bytes) -> str | None:
    """A small file's text as evidence: decoded (bad bytes replaced), NULs and surrounding whitespace
    removed; None when nothing is left."""
    text = data.decode("utf-8", "replace").replace("\0", "").strip()
    return text or None


def cpuinfo_board(cpuinfo: dict[str, str]) -> str | None:
    """The board's model from parsed cpuinfo: Raspberry Pi kernels repeat it in a `Model` line (seen
    where a container masks the device tree); None for any other."""
    model = cpuinfo.get("model", "")
    return model if names_raspberry_pi(model) else None


def names_raspberry_pi(model: str | None) -> bool:
    return "raspberry pi" in (model or "").lower()


def names_pi4_or_pi5(model: str | None) -> bool:
    return bool(_PI45.search((model or "").lower()))


def names_jetson(model: str | None) -> bool:
    """A Jetson by its model string ("NVIDIA Jetson Orin Nano ..."; an Orin module named without
    "Jetson" too). A Jetson without a model string shows by a non-empty etc/nv_tegra_release."""
    model = (model or "").lower()
    return "jetson" in model or bool(_ORIN.search(model))

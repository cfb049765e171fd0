"""What `edgeinfer.platforms.detect` reads from a device and the rules that name its profile
(the rules are listed in `edgeinfer.platforms`' docstring; this module is their code).

`read_facts(root, env, platform, machine) -> Facts` reads the files under `root` with `read_text`,
which never raises; `choose(facts) -> (profile name, reason, note or None)` is pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from edgeinfer.boards import (MODEL_FILES, READ_LIMIT, TEGRA_RELEASE, cpuinfo_board, names_jetson, names_raspberry_pi,
                              parse_cpuinfo, release_text)
from edgeinfer.power.android import parse_build_prop
from edgeinfer.power.linux_sysfs import read_regular

GENERIC = "generic-cpu"
EVIDENCE_CHARS = 80  # a value quoted in the evidence is cut to this
CPUINFO = "proc/cpuinfo"
BUILD_PROPS = ("system/build.prop", "vendor/build.prop")
ANDROID_ENV = ("ANDROID_ROOT", "ANDROID_DATA", "TERMUX_VERSION")
ARM64 = ("aarch64", "arm64", "armv8l")
X86_64 = ("x86_64", "amd64")
ARM_PARTS = {"0xd03": "Cortex-A53", "0xd05": "Cortex-A55", "0xd08": "Cortex-A72", "0xd0b": "Cortex-A76",
             "0xd41": "Cortex-A78", "0xd42": "Cortex-A78AE", "0xd44": "Cortex-X1", "0xd46": "Cortex-A510",
             "0xd47": "Cortex-A710", "0xd48": "Cortex-X2", "0xd4d": "Cortex-A715", "0xd4e": "Cortex-X3"}
_TEGRA = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")
_PI = re.compile(r"raspberry pi (?:compute module )?(\d)")
_ARM_PART = re.compile(r"^CPU part\s*:\s*(\S+)", re.MULTILINE)


def read_text(root: Path, rel: str, warnings: list[str]) -> str | None:
    """The text of `root/rel` (at most READ_LIMIT bytes, NULs and surrounding whitespace removed);
    None when it does not exist, and None plus a warning when it is not a regular file, cannot be
    read or is empty. Never raises."""
    path = root / rel
    try:
        data = read_regular(path, READ_LIMIT)  # a FIFO or a device would block the read: never opened
        if data is None:
            warnings.append(f"{rel}: not a regular file, skipped")
            return None
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        warnings.append(f"{rel}: unreadable ({getattr(e, 'strerror', None) or e})")
        return None
    text = release_text(data)
    if not text:
        warnings.append(f"{rel}: empty")
        return None
    return text


def quoted(text: str) -> str:
    """`text` on one line, cut to EVIDENCE_CHARS, in quotes."""
    one_line = " ".join(text.split())
    return repr(one_line if len(one_line) <= EVIDENCE_CHARS else one_line[:EVIDENCE_CHARS] + "...")


def parse_tegra_release(text: str) -> str | None:
    """"# R36 (release), REVISION: 3.0, ..." -> "R36.3.0"; None when the line is not there."""
    m = _TEGRA.search(text)
    return f"R{m.group(1)}.{m.group(2)}" if m else None


@dataclass
class Facts:
    """What was read: the device model (and where from), whether etc/nv_tegra_release exists, the
    cpuinfo fields, the Android hints, sys.platform and the machine; `evidence` and `warnings` as
    the lines a Detection carries."""

    platform: str
    machine: str
    model: str | None = None
    tegra: bool = False
    cpuinfo: dict[str, str] = field(default_factory=dict)
    android: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_facts(root: Path, env: Mapping[str, str], platform: str, machine: str) -> Facts:
    """Everything `choose` looks at, read under `root`; never raises."""
    f = Facts(platform=str(platform), machine=str(machine))
    for rel in MODEL_FILES:
        f.model = read_text(root, rel, f.warnings)
        if f.model:
            f.evidence.append(f"{rel}: {quoted(f.model)}")
            break
    release = read_text(root, TEGRA_RELEASE, f.warnings)
    if release is not None:
        f.tegra = True
        version = parse_tegra_release(release)
        f.evidence.append(f"{TEGRA_RELEASE}: L4T {version}" if version else f"{TEGRA_RELEASE}: present ({quoted(release)})")
    cpuinfo = read_text(root, CPUINFO, f.warnings)
    if cpuinfo is not None:
        f.cpuinfo = parse_cpuinfo(cpuinfo)
        described = describe_cpu(f.cpuinfo, _ARM_PART.findall(cpuinfo))
        f.evidence.append(f"{CPUINFO}: {described}" if described else f"{CPUINFO}: no CPU model named")
        if not f.model and cpuinfo_board(f.cpuinfo):
            f.model = cpuinfo_board(f.cpuinfo)  # Raspberry Pi kernels repeat the board's model here
            f.evidence.append(f"{CPUINFO} Model: {quoted(f.model)}")
    try:
        hints = [name for name in ANDROID_ENV if name in env]
    except Exception:  # a Mapping that fails on lookup is no evidence
        hints = []
    if hints:
        f.android.append(f"environment {', '.join(hints)}")
    props = [read_text(root, rel, f.warnings) for rel in BUILD_PROPS]
    if props[0] is not None:
        device = parse_build_prop("\n".join(p for p in props if p))
        f.android.append(f"{BUILD_PROPS[0]}" + (f" ({quoted(device)})" if device else ""))
    if f.platform == "android":
        f.android.append("sys.platform android")
    if f.android:
        f.evidence.append("Android: " + "; ".join(f.android))
    f.evidence.append(f"sys.platform {f.platform!r}, machine {f.machine!r}")
    return f


def describe_cpu(info: dict[str, str], arm_parts: list[str]) -> str | None:
    """A short name of the CPU cpuinfo describes: x86 "model name", Arm implementer and the count
    of each core part (and "Hardware"), RISC-V "uarch"/"isa"; None when it names none."""
    if info.get("model name"):
        return f"model name {quoted(info['model name'])}"
    if info.get("cpu implementer"):
        counts: dict[str, int] = {}
        for part in arm_parts[:1024]:
            counts[part[:8]] = counts.get(part[:8], 0) + 1
        cores = ", ".join(f"{n}x {p}" + (f" ({ARM_PARTS[p.lower()]})" if p.lower() in ARM_PARTS else "")
                          for p, n in list(counts.items())[:8])
        text = f"CPU implementer {info['cpu implementer'][:8]}, parts {cores or '?'}"
        return text + (f", Hardware {quoted(info['hardware'])}" if info.get("hardware") else "")
    if info.get("uarch") or info.get("isa"):
        return f"uarch {quoted(info.get('uarch') or '?')}, isa {quoted(info.get('isa') or '?')}"
    if info.get("hardware"):
        return f"Hardware {quoted(info['hardware'])}"
    return None


def choose(f: Facts) -> tuple[str, str, str | None]:
    """(profile name, why, note) for the facts, by the rules of `edgeinfer.platforms`. The note is
    None for a plain match and says what was approximated otherwise."""
    model = (f.model or "").lower()
    machine = f.machine.lower()
    if names_raspberry_pi(model):
        m = _PI.search(model)
        if m and m.group(1) in ("4", "5"):
            return f"raspberry-pi-{m.group(1)}", f"the model names a Raspberry Pi {m.group(1)}", None
        return GENERIC, "a Raspberry Pi without a profile", \
            f"{quoted(f.model)} has no profile (only the Pi 4 and 5 do): generic CPU profile"
    if names_jetson(model) or f.tegra:
        if "agx orin" in model:
            return "jetson-agx-orin", "the model names a Jetson AGX Orin", None
        if "orin nano" in model:
            return "jetson-orin-nano", "the model names a Jetson Orin Nano", None
        what = quoted(f.model) if f.model else "a Jetson (nv_tegra_release) with no model string"
        return "jetson-orin-nano", "a Jetson without its own profile", \
            f"{what} has no profile of its own: the Jetson Orin Nano one (the smallest Jetson profile)"
    if f.android:
        if machine in ARM64:
            return "android-arm64", "Android on arm64", None
        return GENERIC, f"Android on {f.machine or 'an unknown machine'}", \
            f"Android on {f.machine or 'an unknown machine'} has no profile (only arm64 does): generic CPU profile"
    if f.platform == "darwin":
        if machine == "arm64":
            return "apple-silicon-mac", "macOS on arm64", None
        if machine in X86_64:
            return "x86-64-desktop", "macOS on x86_64", ("an Intel Mac (or an x86_64 Python under Rosetta on Apple "
                                                         "silicon): the x86-64 desktop profile")
    if machine in X86_64:
        return "x86-64-desktop", f"machine {f.machine}", None
    what = quoted(f.model) if f.model else f"{f.platform or '?'} on {f.machine or 'an unknown machine'}"
    return GENERIC, "no rule matched", f"unknown device ({what}): generic CPU profile"

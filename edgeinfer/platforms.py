"""Device profiles (`platforms/*.toml`, package data `edgeinfer.platforms_data`) and `detect()`,
which picks the profile for the device it runs on.

A `Profile` holds what a device should get when the caller does not say: ONNX Runtime providers
in order of preference, the graph flavour and `convert --target`, threads, the default
quantization, KV capacity and daemon slots, the power policy and the sensors worth reading there.
`load_profiles()` reads and checks every file; a missing, unknown or ill-typed field, a value out
of its set, or fields that contradict each other raise `ProfileError` naming the file and field.

`detect(root, env, platform, machine)` reads, under `root` ("/" live, a recorded tree in tests):
`proc/device-tree/model` or `sys/firmware/devicetree/base/model` (NUL-terminated), `etc/nv_tegra_release`,
`proc/cpuinfo` and `system/build.prop`; plus `env` (ANDROID_ROOT, ANDROID_DATA, TERMUX_VERSION),
`platform` (sys.platform) and `machine` (platform.machine()). It returns a `Detection`: the
profile, the evidence (short strings: what was read, what matched) and a note when the choice is
a fallback or an approximation. A missing, unreadable, empty or garbage file is evidence of nothing
(a line in `warnings` when it exists but cannot be read); `detect` never raises for the device's files.

The rules, first match wins:
1. a Raspberry Pi model string (device tree, else the `Model` line Raspberry Pi kernels add to
   cpuinfo): Pi 4 / 400 / CM4 -> raspberry-pi-4, Pi 5 / 500 / CM5 -> raspberry-pi-5, other Pis -> generic-cpu;
2. a Jetson (model names Jetson or an Orin, or `etc/nv_tegra_release` has some text): AGX Orin ->
   jetson-agx-orin, Orin Nano -> jetson-orin-nano, anything else (Orin NX, Xavier, unknown) ->
   jetson-orin-nano with a note (the smallest Jetson profile);
3. Android (one of the environment variables, `system/build.prop`, or sys.platform "android"):
   arm64 -> android-arm64, other architectures -> generic-cpu;
4. macOS: arm64 -> apple-silicon-mac, x86_64 -> x86-64-desktop with a note;
5. machine x86_64 / AMD64 -> x86-64-desktop;
6. anything else -> generic-cpu, note "unknown device: generic CPU profile".
"""

from __future__ import annotations

import json
import os
import platform as _platform
import sys
import unicodedata
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Mapping

from edgeinfer import small_files
from edgeinfer.errors import EdgeInferError, InvalidArgumentError
from edgeinfer.fields import FieldError, json_fields
from edgeinfer.platform_rules import GENERIC, choose, read_facts
from edgeinfer.power.policy import POLICY_NAMES
from edgeinfer.terminal import ESCAPED

# ONNX Runtime execution providers by the short names profiles use
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                 "coreml": "CoreMLExecutionProvider", "nnapi": "NnapiExecutionProvider"}
FLAVOURS = ("fused", "portable")
TARGETS = ("cpu", "cuda", "coreml", "nnapi")  # edgeinfer convert --target
PORTABLE_TARGETS = ("coreml", "nnapi")
QUANTIZATIONS = ("fp32", "fp16", "int8", "int4")  # edgeinfer convert --quant
# the interfaces edgeinfer.power reads (docs/power.md, "What it reads on each device"); "vcgencmd" is
# the Pi firmware's throttle flags (sysfs get_throttled, else `vcgencmd get_throttled`), "ina3221"
# the Jetson power rails under hwmon, "termux" termux-battery-status, "dumpsys" its thermal status
SENSORS = ("thermal_zone", "hwmon", "cpufreq", "power_supply", "vcgencmd", "ina3221", "nvpmodel",
           "devfreq", "pmset", "termux", "dumpsys")
MIN_CAPACITY_TOKENS = 16  # the default ring's 4 sinks and a few tokens beside them
MAX_CAPACITY_TOKENS = 1 << 20
MAX_SLOTS = 256
MAX_THREADS = 256  # the session's cap (session.MAX_THREADS; that module imports ONNX Runtime): above it, every load failed
MAX_DESCRIPTION_CHARS = 200  # printed in `inspect --platform`: no control characters, no page of text
MAX_PROFILE_BYTES = 64 * 1024  # a profile is a dozen lines (a 200 MB comment was read whole)


class ProfileError(EdgeInferError, ValueError):
    """A profile file is unreadable or has a bad field; the message names the file and the field."""


@dataclass(frozen=True)
class Profile:
    """One device profile, as checked by `load_profile`.

    `providers`: ONNX Runtime providers by short name, most preferred first, always ending with
    "cpu"; the first is the one `convert_target` builds for. `threads`: a count, or "auto" (ONNX
    Runtime's own choice, `session_threads` None). `capacity_tokens`: the KV ring a load without
    `capacity_tokens` should get, capped by the model's own default. `daemon_slots`: `serve --slots`.
    `power_policy`: one of edgeinfer.power's POLICY_NAMES. `sensors`: names from SENSORS."""

    name: str
    description: str
    providers: tuple[str, ...]
    flavour: str
    convert_target: str
    threads: int | str
    quantization: str
    capacity_tokens: int
    daemon_slots: int
    power_policy: str
    sensors: tuple[str, ...]

    @property
    def session_threads(self) -> int | None:
        """The thread count to give ONNX Runtime: None for "auto"."""
        return None if self.threads == "auto" else self.threads

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _check_values(p: Profile, bad) -> None:
    """The value rules of a type-checked profile; `bad(field, expected, value)` raises."""
    def one_of(field: str, choices: tuple[str, ...]) -> None:
        if getattr(p, field) not in choices:
            bad(field, f"one of {', '.join(choices)}", getattr(p, field))

    def names(field: str, choices: tuple[str, ...]) -> None:
        values = getattr(p, field)
        for v in values:
            if v not in choices:
                bad(field, f"names from {', '.join(choices)}", v)
        if len(set(values)) != len(values):
            bad(field, "no name twice", list(values))

    if not p.description.strip() or len(p.description) > MAX_DESCRIPTION_CHARS or not one_line(p.description):
        bad("description", f"one line of printable text, at most {MAX_DESCRIPTION_CHARS} characters", p.description)
    names("providers", tuple(ORT_PROVIDERS))
    if not p.providers or p.providers[-1] != "cpu":
        bad("providers", 'a list ending with "cpu" (the provider every build has)', list(p.providers))
    one_of("flavour", FLAVOURS)
    one_of("convert_target", TARGETS)
    if p.convert_target != p.providers[0]:
        bad("convert_target", f"the first provider ({p.providers[0]!r})", p.convert_target)
    if (p.flavour == "portable") != (p.convert_target in PORTABLE_TARGETS):
        bad("flavour", f"{'portable' if p.convert_target in PORTABLE_TARGETS else 'fused'} for target "
            f"{p.convert_target!r}", p.flavour)
    if p.threads != "auto" and not (isinstance(p.threads, int) and 1 <= p.threads <= MAX_THREADS):
        bad("threads", f'an integer in 1..{MAX_THREADS} or "auto"', p.threads)
    one_of("quantization", QUANTIZATIONS)
    if p.flavour == "portable" and p.quantization == "int4":
        bad("quantization", "fp32, fp16 or int8 (the portable graph has no int4 ops)", p.quantization)
    if not MIN_CAPACITY_TOKENS <= p.capacity_tokens <= MAX_CAPACITY_TOKENS:  # (1: every load without one refused)
        bad("capacity_tokens", f"an integer in {MIN_CAPACITY_TOKENS}..{MAX_CAPACITY_TOKENS}", p.capacity_tokens)
    if not 1 <= p.daemon_slots <= MAX_SLOTS:
        bad("daemon_slots", f"an integer in 1..{MAX_SLOTS}", p.daemon_slots)
    one_of("power_policy", POLICY_NAMES)
    names("sensors", SENSORS)


def one_line(text: str) -> bool:
    """Whether `text` prints as one line: no control, format, private-use or unassigned character and no
    line or paragraph separator (a no-break or thin space is fine: str.isprintable refused those)."""
    return not any(unicodedata.category(c) in ESCAPED for c in text)


def load_profile(path: Path | str) -> Profile:
    """The profile in one TOML file, checked; the file's stem must be its `name`. Raises
    ProfileError naming the file and the field."""
    path = Path(path)
    data = small_files.read_toml(path, MAX_PROFILE_BYTES, ProfileError)  # a FIFO, /dev/zero, 600 nested arrays

    def bad(field: str, expected: str, value) -> None:
        raise ProfileError(f"{path}: bad field {field}: expected {expected}, got {str(repr(value))[:80]}")

    try:
        profile = Profile(**json_fields(Profile, data, "profile"))
    except FieldError as e:
        problem = str(e)[len(e.field) + 2:]
        raise ProfileError(f"{path}: bad field {e.field.removeprefix('profile.')}: {problem[:120]}") from None
    if profile.name != path.stem:
        bad("name", f"the file's name {path.stem!r}", profile.name)
    _check_values(profile, bad)
    return profile


def profiles_folder() -> Path:
    """Where the shipped profiles are: the package data `edgeinfer.platforms_data`, or the source
    tree's `platforms/` when the package was installed (editable) before that data was declared."""
    try:
        return Path(str(resources.files("edgeinfer.platforms_data")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "platforms"


def load_profiles(folder: Path | str | None = None) -> dict[str, Profile]:
    """Every `*.toml` profile in `folder` (default: the shipped ones), by name, checked. Raises
    ProfileError for a bad file, or when the folder has no generic-cpu profile (the fallback)."""
    folder = Path(folder) if folder is not None else profiles_folder()
    try:
        files = sorted(folder.glob("*.toml"))
    except OSError as e:
        raise ProfileError(f"{folder}: cannot list the profiles: {e}") from None
    profiles = {p.name: p for p in map(load_profile, files)}
    if GENERIC not in profiles:
        raise ProfileError(f"{folder}: no {GENERIC}.toml (the fallback profile); reinstall edgeinfer")
    return profiles


def preferred_provider(profile: Profile, available: list[str]) -> str:
    """The first of `profile.providers` that is in `available` (short names "cpu", "cuda",
    "coreml", "nnapi"; ONNX Runtime's own names such as "CUDAExecutionProvider" are accepted too).
    Raises InvalidArgumentError when none is."""
    by_ort_name = {v: k for k, v in ORT_PROVIDERS.items()}
    short = {by_ort_name.get(a, a) for a in available}
    for provider in profile.providers:
        if provider in short:
            return provider
    raise InvalidArgumentError(f"profile {profile.name} wants one of {', '.join(profile.providers)}, "
                               f"but only {', '.join(available) or 'no provider'} is available")


def available_providers() -> list[str]:
    """This ONNX Runtime build's providers, by short name where edgeinfer knows them."""
    import onnxruntime

    by_ort_name = {v: k for k, v in ORT_PROVIDERS.items()}
    return [by_ort_name.get(p, p) for p in onnxruntime.get_available_providers()]


def auto_provider(target: str, profile: "Profile", available: list[str], runnable: tuple[str, ...]) -> str:
    """`load(provider="auto")`: the first of the profile's providers that this ONNX Runtime build has,
    that this runtime can drive (`runnable`) and that suits a folder converted for `target` (its
    own provider, or the CPU, which runs every flavour)."""
    suits = [p for p in profile.providers if p in (target, "cpu") and p in runnable]
    return preferred_provider(replace(profile, providers=tuple(suits) or ("cpu",)), available)


@dataclass(frozen=True)
class Detection:
    """What `detect` chose: the profile, the evidence for it, a note when it is a fallback or an
    approximation (None for a plain match), and warnings about files that exist but could not be read."""

    profile: Profile
    evidence: tuple[str, ...]
    note: str | None
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"profile": self.profile.to_json(), "evidence": list(self.evidence), "note": self.note,
                "warnings": list(self.warnings)}


def detect(root: Path | str = "/", env: Mapping[str, str] | None = None, platform: str | None = None,
           machine: str | None = None, profiles: dict[str, Profile] | None = None) -> Detection:
    """The profile for the device under `root` (see the module docstring). `env`, `platform` and
    `machine` default to this process's os.environ, sys.platform and platform.machine();
    `profiles` to `load_profiles()`. Never raises for the device's files (only for a bad profile)."""
    env = os.environ if env is None else env
    platform = sys.platform if platform is None else platform
    machine = _platform.machine() if machine is None else machine
    profiles = load_profiles() if profiles is None else profiles
    facts = read_facts(Path(root), env, platform, machine)
    name, reason, note = choose(facts)
    if name not in profiles:
        name, note = GENERIC, f"no {name} profile in this installation: generic CPU profile"
    return Detection(profiles[name], tuple(facts.evidence) + (f"chose {name}: {reason}",), note,
                     tuple(facts.warnings))


def device_capacity_tokens(portable: bool, profile: Profile | None = None) -> int | None:
    """The device profile's default KV ring for a model (`Profile.capacity_tokens`; the detected
    profile's unless one is given), or None for a portable model: the rows of its ring are fixed by
    its graphs, so a smaller ring would save no memory, only context."""
    if portable:
        return None
    return (profile or detect().profile).capacity_tokens


def detect_from_fixture(folder: Path | str, profiles: dict[str, Profile] | None = None) -> Detection:
    """`detect` on a recorded device folder: `root/` (the files), `env.json` (a JSON object of
    strings), `platform.txt` (sys.platform, default "linux"), `machine.txt` (platform.machine(),
    default ""). A malformed folder raises InvalidArgumentError naming the file."""
    folder = Path(folder)
    if not folder.is_dir() or not ((folder / "root").is_dir() or any((folder / n).is_file() for n in
                                                                       ("platform.txt", "env.json", "machine.txt"))):
        raise InvalidArgumentError(f"{folder} is not a recorded device folder (root/, env.json, platform.txt, machine.txt)")

    def text(name: str, default: str) -> str:
        path = folder / name
        if not path.is_file():
            return default
        try:  # bounded: a file of gigabytes is no recording
            return small_files.read_text(path, small_files.MAX_RECORDED_BYTES, ValueError).strip()
        except ValueError as e:
            raise InvalidArgumentError(f"{path}: unreadable: {str(e)[:200]}") from None

    raw = text("env.json", "{}")
    try:
        env = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past Python's limit
        raise InvalidArgumentError(f"{folder / 'env.json'}: not JSON: {str(e)[:200]}") from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidArgumentError(f"{folder / 'env.json'} must be a JSON object of name -> string")
    from edgeinfer.power.sensors import check_recording

    platform, machine = text("platform.txt", "linux"), text("machine.txt", "")
    for name, value in (("platform.txt", platform), ("machine.txt", machine)):  # printed as they are
        if len(value) > 64 or not one_line(value):
            example = "linux" if name == "platform.txt" else "aarch64"
            raise InvalidArgumentError(f"{folder / name}: expected a name such as {example} (at most 64 printable "
                                       f"characters), got {value[:40]!r}")
    check_recording(folder, platform)
    return detect(folder / "root", env, platform, machine, profiles)


__all__ = ["Profile", "ProfileError", "Detection", "load_profile", "load_profiles", "detect",
           "detect_from_fixture", "preferred_provider", "available_providers", "GENERIC"]

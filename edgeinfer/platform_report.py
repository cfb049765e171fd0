"""`edgeinfer inspect --platform [--json] [--root DIR]`: the device profile `detect()` chose, its
fields and why, in words or as JSON.

On the live machine the report also names the provider this ONNX Runtime build would run
(`preferred_provider` over `available_providers()`); for a recorded device (`--root`) it does not,
since this machine's build says nothing about that device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from edgeinfer.errors import InvalidArgumentError
from edgeinfer.platforms import Detection, available_providers, detect, detect_from_fixture, preferred_provider


def platform_report(detection: Detection, providers_here: list[str] | None = None) -> dict:
    """`detection.to_json()` plus, when `providers_here` is given (this machine's providers by
    short name), "available_providers" and "provider": the one the profile would use here (None
    when it wants none of them)."""
    data = detection.to_json()
    if providers_here is not None:
        data["available_providers"] = list(providers_here)
        try:
            data["provider"] = preferred_provider(detection.profile, providers_here)
        except InvalidArgumentError:
            data["provider"] = None
    return data


def format_platform(data: dict) -> str:
    """`platform_report`'s dict in words: the profile's fields, then "why" (the evidence)."""
    p = data["profile"]
    threads = "ONNX Runtime's choice (auto)" if p["threads"] == "auto" else str(p["threads"])
    lines = [
        f"platform        {p['name']}: {p['description']}",
        f"  providers     {', '.join(p['providers'])} (first available wins"
        + ("; edgeinfer itself drives cpu and cuda, the app the others)" if set(p["providers"]) - {"cpu", "cuda"} else ")"),
        f"  graph         {p['flavour']} flavour: edgeinfer convert --target {p['convert_target']} "
        f"--quant {p['quantization']}" + ("" if p["convert_target"] in ("cpu", "cuda") else
                                          " (for the app's provider; edgeinfer's Python API and daemon run on "
                                          "the CPU here: --target cpu)"),
        f"  threads       {threads}",
        f"  capacity      {p['capacity_tokens']} tokens",
        f"  daemon slots  {p['daemon_slots']}",
        f"  power policy  {p['power_policy']}",
        f"  sensors       {', '.join(p['sensors']) or '(none)'}",
    ]
    if "available_providers" in data:
        provider = data["provider"] or "none of the profile's"
        available = ", ".join(data["available_providers"]) or "no provider"
        lines.append(f"  here          provider {provider}; this ONNX Runtime has {available}")
    if data["note"]:
        lines.append(f"  note          {data['note']}")
    lines.append("why")
    lines += [f"  {e}" for e in data["evidence"]]
    if data["warnings"]:
        lines.append("warnings")
        lines += [f"  {w}" for w in data["warnings"]]
    return "\n".join(lines)


def inspect_platform(model: Path | None, root: Path | None, verify: bool, as_json: bool,
                     out: Callable[[str], None] = print) -> int:
    """`edgeinfer inspect --platform`: detect (on the recorded device folder `root`, else this
    machine) and `out` the report. A model folder or --verify with it is an InvalidArgumentError."""
    if model is not None:
        raise InvalidArgumentError(f"--platform describes this device, not a model folder: drop {model} "
                                   "(edgeinfer inspect MODEL describes a model)")
    if verify:
        raise InvalidArgumentError("--verify checks a model folder's files; it does not go with --platform")
    if root is not None:
        data = platform_report(detect_from_fixture(root))
    else:
        data = platform_report(detect(), available_providers())
    out(json.dumps(data, indent=1) if as_json else format_platform(data))
    return 0

"""`edgeinfer serve`: its flags (declared once, shared with its TOML file) and its handler; the
daemon itself is `edgeinfer.server`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from edgeinfer.cli_args import path_text_arg
from edgeinfer.errors import EdgeInferError
from edgeinfer.options import SPECULATIVE
from edgeinfer.overflow import OVERFLOW_POLICIES
from edgeinfer.server.config import POWER_CHOICES


def add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (loopback unless an API key is given)")
    _serve_args(sv)
    sv.set_defaults(func=_cmd_serve, imports=("edgeinfer.model", "edgeinfer.server.run"),
                    writes_stdout=lambda a: a.print_systemd_unit)  # (its log is standard error)


# serve flags: (flag, setting, type, help, the values it takes or None); None defaults so that a TOML
# file's values are not overridden
SERVE_FLAGS = (
    ("--host", "host", str, "address to listen on (default 127.0.0.1; any other needs an API key)", None),
    ("--port", "port", int, "port (default 8080)", None),
    ("--api-key", "api_key", str, "require 'Authorization: Bearer KEY' (prefer --api-key-file or EDGEINFER_API_KEY)",
     None),
    ("--api-key-file", "api_key_file", path_text_arg, "read the API key from this file", None),
    ("--slots", "slots", int, "requests generating at once, each with its own KV ring (default: the device profile's)",
     None),
    ("--queue", "queue", int, "requests waiting for a slot; more get 429 at once (default 8)", None),
    ("--capacity", "capacity", int, "each slot's KV ring, in tokens (default: the model's, capped by the device profile's)", None),
    ("--threads", "threads", int, "ONNX Runtime threads (default: the device profile's)", None),
    ("--overflow", "overflow", str, "when a ring is full (default shift)", OVERFLOW_POLICIES),
    ("--speculative", "speculative", str, "speculative decoding, the same tokens sooner (default off): ngram drafts "
                                          "from the text itself (text that repeats its prompt), draft with "
                                          "--draft-model", ("off",) + SPECULATIVE),
    ("--draft-model", "draft_model", path_text_arg, "with --speculative draft: a small model folder of the same tokenizer", None),
    ("--max-tokens-limit", "max_tokens_limit", int, "most tokens one request may generate (default 512)", None),
    ("--max-prompt-tokens", "max_prompt_tokens", int, "longest prompt accepted, in tokens; a longer one is a 400 "
                                                      "(default: 8 times a slot's ring)", None),
    ("--log-format", "log_format", str, "one log line per request as text or JSON (default text)", ("text", "json")),
    ("--grace-s", "grace_s", float, "on SIGTERM, how long requests in flight may finish (default 30)", None),
    ("--power", "power", str, "power policy (default: the device profile's)", POWER_CHOICES),
    ("--max-temp-c", "max_temp_c", float, "power: stay under this temperature", None),
    ("--min-battery-pct", "min_battery_pct", float, "power: on battery under this, refuse background requests", None),
    ("--power-budget-w", "power_budget_w", float, "power: hold the device's draw under this many watts", None),
    ("--max-tokens-per-s", "max_tokens_per_s", float, "power: never decode faster than this", None),
)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", type=path_text_arg, default=None, help="edgeinfer model folder (default: bundled)")
    p.add_argument("--config", type=path_text_arg, default=None, help="TOML file of these settings (flags win)")
    for flag, _, kind, help_text, choices in SERVE_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=help_text, choices=choices)
    p.add_argument("--log-prompts", action=argparse.BooleanOptionalAction, default=None,
                   help="log each prompt's text (off by default; --no-log-prompts overrides a config file's true)")
    p.add_argument("--print-systemd-unit", action="store_true", help="print a systemd unit for these settings and exit")


def _cmd_serve(args: argparse.Namespace) -> int:
    from edgeinfer.server.config import load_config

    flags = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _, _ in SERVE_FLAGS}
    flags.update(model=args.model, log_prompts=args.log_prompts)
    if args.print_systemd_unit:
        load_config(args.config, flags)  # the service's own checks now, not at each of its starts: a host
        # off loopback needs a key (from the flags, the file or EDGEINFER_API_KEY: source the env file first)
        # the unit never holds the key (its environment file does), so this config, which only sizes the unit, is
        # read as if on loopback: a host from the file stays in force over a flag of None ("not given")
        # (nor its cors-origins: "*", which the first load allowed with the key, would be refused without it)
        config = load_config(args.config, {**flags, "host": "127.0.0.1", "api_key": None, "api_key_file": None,
                                           "cors_origins": ()}, use_env_key=False)
        return _print_systemd_unit(args, config)
    from edgeinfer.server.run import serve

    return serve(load_config(args.config, flags))


CUDA_RUNTIME_BYTES = 1 << 30  # a cuda folder's MemoryMax allowance for the CUDA runtime and its libraries (cuBLAS,
# cuDNN) in the process: not measured here (no GPU); the footprint alone left a Jetson's unit no room for them


def _print_systemd_unit(args: argparse.Namespace, config) -> int:
    from edgeinfer.manifest import read_manifest
    from edgeinfer.model import default_model_path
    from edgeinfer.server import footprint
    from edgeinfer.server.systemd import check_command, hidden_paths, systemd_unit

    if config.port == 0:
        raise EdgeInferError("port 0 lets the system pick a free port at each start, which no client of a service "
                             "could find: give the service a fixed --port")
    folder = (Path(config.model) if config.model else default_model_path()).resolve()
    folders = [folder]
    argv = [sys.executable, "-m", "edgeinfer", "serve", "-m", str(folder)]
    if config.draft_model is not None:  # from a flag or the config file: absolute in the unit
        folders.append(Path(config.draft_model).resolve())
        argv += ["--draft-model", str(folders[-1])]
    if args.config:
        argv += ["--config", str(Path(args.config).resolve())]
    for flag, name, _, _, _ in SERVE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if name == "api_key_file" and value is not None:  # its path, not the key: the service reads the file
            argv += [flag, str(Path(value).resolve())]  # (it was left out, and the service then had no key)
        elif value is not None and name not in ("api_key", "api_key_file", "draft_model"):  # a key: the env file's
            argv += [flag, str(value)]
    if args.log_prompts is not None:
        argv.append("--log-prompts" if args.log_prompts else "--no-log-prompts")
    check_command(argv, [str(f) for f in folders])  # before the load that sizes the unit (seconds)
    total = footprint.footprint_bytes(config, folders)  # (the service's own checks as it starts, here: a refusal
    # would restart it in a loop)
    if any(read_manifest(f).target == "cuda" for f in folders):  # once per process, draft model or not
        total += CUDA_RUNTIME_BYTES
    import edgeinfer

    needed = [sys.executable, os.path.realpath(sys.executable),  # what the service reads: the interpreter a venv's
              # link leads to (pyenv's, uv's, conda's: often under /root or /home), the package (an editable
              # install's source), the model folders, the files
              str(Path(edgeinfer.__file__).resolve().parent), *(str(f) for f in folders),
              *(str(Path(f).resolve()) for f in (args.config, args.api_key_file, config.api_key_file) if f)]
    for warning in hidden_paths(list(dict.fromkeys(needed))):
        print(f"edgeinfer: warning: {warning}", file=sys.stderr)
    from edgeinfer.platforms import detect

    device = detect().profile.name
    on_device = device.startswith(("raspberry-pi", "jetson")) or read_manifest(folder).target == "cuda"
    print(systemd_unit(exec_start=argv, memory_max_bytes=total, grace_s=config.grace_s,
                       writable_paths=[str(f) for f in folders],
                       supplementary_groups=("video",) if on_device else ()), end="")
    return 0

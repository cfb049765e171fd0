"""The systemd service unit that `edgeinfer serve --print-systemd-unit` prints.

`systemd_unit(...)` returns the text of one `.service` file; it writes nothing and asks nothing of
the machine. Contract of the text:

- runs `exec_start` (absolute program path, then its arguments), quoted with `shlex.join`, as a
  dedicated `user` (User= and Group= both that name), restarted 5 s after a failure;
- the API key is never in it: it comes from `EnvironmentFile=-<env_file>` (a line
  `EDGEINFER_API_KEY=...`, mode 0600, owned by root); `exec_start` holding `--api-key` is refused;
- `MemoryMax=` is the footprint (`server.footprint`: the model as loaded, measured, plus its KV
  rings, attention scores and speculation's buffers) rounded up to MiB plus `MEMORY_MARGIN_FRACTION`
  of it plus `MEMORY_MARGIN_MIB` (Python, ONNX Runtime's libraries and the HTTP stack, which the
  footprint does not count), written as an integer with the `M` suffix;
- `KillSignal=SIGTERM` and `TimeoutStopSec=` = the server's grace period + `STOP_MARGIN_S`, so
  systemd waits for requests in flight to finish before it sends SIGKILL;
- hardening that leaves a virtual environment under /opt working (it is only read):
  NoNewPrivileges, ProtectSystem=strict (the whole file system read-only to the service except
  `writable_paths`, e.g. the model folder so that load can keep its verification stamp; without it
  load simply writes no stamp), ProtectHome, PrivateTmp; logs go to the journal.

Every path and argument must be free of the characters systemd would interpret or that shlex and
systemd quote differently (`%` specifiers, `$` variables, backslashes, quotes, control
characters); they are refused with InvalidArgumentError (a ValueError) rather than escaped, so
the ExecStart line reads back with `shlex.split` exactly as given.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence

from edgeinfer.errors import InvalidArgumentError

MIB = 1 << 20
MEMORY_MARGIN_FRACTION = 0.25  # of the footprint
MEMORY_MARGIN_MIB = 128  # interpreter + ONNX Runtime + HTTP stack: about 80 MiB measured with the bundled model
STOP_MARGIN_S = 15  # TimeoutStopSec = grace + this: time to close sockets and exit after the last request
API_KEY_ENV = "EDGEINFER_API_KEY"

_USER = re.compile(r"[a-z_][a-z0-9_-]{0,30}\Z")
_FORBIDDEN = set("%$\\'\"`")


def _check_word(what: str, s: str) -> str:
    if not isinstance(s, str):
        raise InvalidArgumentError(f"{what} must be a string, got {s!r}")
    bad = sorted({c for c in s if c in _FORBIDDEN or ord(c) < 32 or ord(c) == 127})
    if bad:
        raise InvalidArgumentError(f"{what} {s!r} holds {', '.join(repr(c) for c in bad)}, which a systemd unit "
                                   "would interpret: use a path or argument without it")
    return s


def _check_path(what: str, s: str) -> str:
    _check_word(what, s)
    if not s.startswith("/") or any(c.isspace() for c in s):
        raise InvalidArgumentError(f"{what} must be an absolute path without spaces, got {s!r}")
    return s


def memory_max_mib(footprint_bytes: int) -> int:
    """MemoryMax in MiB for a process whose model footprint is `footprint_bytes`: the footprint
    rounded up to MiB, plus MEMORY_MARGIN_FRACTION of it, plus MEMORY_MARGIN_MIB; always >= the footprint."""
    if isinstance(footprint_bytes, bool) or not isinstance(footprint_bytes, int) or footprint_bytes <= 0:
        raise InvalidArgumentError(f"memory_max_bytes must be a positive integer, got {footprint_bytes!r}")
    mib = -(-footprint_bytes // MIB)
    return mib + math.ceil(mib * MEMORY_MARGIN_FRACTION) + MEMORY_MARGIN_MIB


HIDDEN = (("/tmp", "PrivateTmp=yes"), ("/var/tmp", "PrivateTmp=yes"), ("/home", "ProtectHome=yes"),
          ("/root", "ProtectHome=yes"), ("/run/user", "ProtectHome=yes"))  # what the unit's hardening hides


def hidden_paths(paths: Sequence[str]) -> list[str]:
    """One warning per path (the program, a model folder, the config file) that the unit's hardening
    hides from the service, so that it would fail to start: under /tmp or /var/tmp (PrivateTmp gives
    the service its own, empty ones), /home, /root or /run/user (ProtectHome)."""
    out = []
    for p in paths:
        for top, setting in HIDDEN:
            if p == top or p.startswith(top + "/"):
                out.append(f"{p} is under {top}, which the unit's {setting} hides from the service: it would not "
                           "start; move it (a virtual environment and models under /opt, e.g.) and print the unit "
                           "again")
                break
    return out


def check_command(exec_start: Sequence[str], writable_paths: Sequence[str] = (),
                  env_file: str = "/etc/edgeinfer/edgeinfer.env") -> tuple[list[str], list[str]]:
    """`systemd_unit`'s checks of the command and the writable paths, alone (InvalidArgumentError), so
    that `serve --print-systemd-unit` refuses an argument the unit cannot carry before it loads the
    model to size the unit; returns both as lists."""
    if isinstance(exec_start, str) or not exec_start:
        raise InvalidArgumentError("exec_start must be a non-empty list of strings (the program, then its arguments)")
    args = [_check_word("exec_start argument", a) for a in exec_start]
    _check_path("exec_start[0] (the program)", args[0])
    if any(a == "--api-key" or a.startswith("--api-key=") for a in args):
        raise InvalidArgumentError(f"the API key must not be on the command line (anyone can read it there): "
                                   f"put {API_KEY_ENV}=... in {env_file} instead")
    if isinstance(writable_paths, str):
        raise InvalidArgumentError("writable_paths must be a list of paths, not one string")
    return args, [_check_path("writable path", p) for p in writable_paths]


def systemd_unit(*, exec_start: Sequence[str], memory_max_bytes: int, user: str = "edgeinfer",
                 env_file: str = "/etc/edgeinfer/edgeinfer.env", working_dir: str | None = None,
                 writable_paths: Sequence[str] = (), grace_s: float = 30,
                 supplementary_groups: Sequence[str] = ()) -> str:
    """The text of `edgeinfer.service` (see the module docstring for what it guarantees).

    exec_start: the command, its first word an absolute path (e.g. /opt/edgeinfer/bin/edgeinfer);
    memory_max_bytes: the footprint the limit is derived from (see `memory_max_mib`);
    grace_s: the server's SIGTERM grace period, in seconds (TimeoutStopSec is larger);
    supplementary_groups: groups whose devices the service needs (`video` on a Pi and a Jetson).
    InvalidArgumentError for anything the unit could not carry faithfully."""
    args, writable = check_command(exec_start, writable_paths, env_file)
    if not isinstance(user, str) or not _USER.match(user):
        raise InvalidArgumentError(f"user must be a system user name ([a-z_][a-z0-9_-]*, at most 31), got {user!r}")
    if user == "root":
        raise InvalidArgumentError("the service must run as a dedicated user, not root")
    _check_path("env_file", env_file)
    if working_dir is not None:
        _check_path("working_dir", working_dir)
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 <= grace_s < 86400:
        raise InvalidArgumentError(f"grace_s must be a number of seconds in [0, 86400), got {grace_s!r}")
    mem = memory_max_mib(memory_max_bytes)
    if isinstance(supplementary_groups, str) or not all(isinstance(g, str) and _USER.match(g)
                                                          for g in supplementary_groups):
        raise InvalidArgumentError(f"supplementary_groups must be a list of group names, got {supplementary_groups!r}")

    lines = [
        "# edgeinfer OpenAI-compatible daemon (written by `edgeinfer serve --print-systemd-unit`)",
        f"# The API key goes in {env_file} as {API_KEY_ENV}=..., never on the command line.",
        "[Unit]",
        "Description=edgeinfer LLM server (OpenAI-compatible HTTP API)",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        f"Group={user}",
        *([f"SupplementaryGroups={' '.join(supplementary_groups)}",
           "# video: /dev/vcio (vcgencmd: a Pi's throttle flags), /dev/nvhost* and /dev/nvmap (a Jetson's CUDA)"]
          if supplementary_groups else []),
        f"EnvironmentFile=-{env_file}",
        "Environment=PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1",
    ]
    if working_dir is not None:
        lines.append(f"WorkingDirectory={working_dir}")
    lines += [
        f"ExecStart={shlex.join(args)}",
        "Restart=on-failure",
        "RestartSec=5",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={math.ceil(grace_s) + STOP_MARGIN_S}",
        f"# footprint {memory_max_bytes:,} bytes, rounded up to MiB, "
        f"+{MEMORY_MARGIN_FRACTION:.0%} +{MEMORY_MARGIN_MIB} MiB margin",
        f"MemoryMax={mem}M",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ]
    if writable:
        lines.append(f"ReadWritePaths={' '.join(writable)}")
    lines += [
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "StandardOutput=journal",
        "StandardError=journal",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


__all__ = ["hidden_paths", "MEMORY_MARGIN_FRACTION", "MEMORY_MARGIN_MIB", "STOP_MARGIN_S", "memory_max_mib", "systemd_unit"]

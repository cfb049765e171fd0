"""`ServeConfig`: the daemon's settings, from a TOML file and the command line (flags win), checked once.

A TOML file holds the long option names, with dashes or underscores (`max-tokens-limit = 512` or
`max_tokens_limit = 512`); an unknown key or a wrong type is refused with its name. A relative path
in the file (`model`, `draft-model`, `api-key-file`) is relative to the file's folder (its real
one, symlinks followed, as `--print-systemd-unit` writes it), as a path on the command line is to
the working directory. The API key may also come from the environment variable EDGEINFER_API_KEY
(how a systemd EnvironmentFile gives it), never from a file the server logs.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, fields
from pathlib import Path

from edgeinfer import small_files
from edgeinfer.errors import InvalidArgumentError, shown  # (a 900 KB value was echoed whole)
from edgeinfer.options import SPECULATIVE
from edgeinfer.overflow import OVERFLOW_POLICIES
from edgeinfer.power.policy import POLICY_NAMES
from edgeinfer.server.origins import origin

POWER_CHOICES = POLICY_NAMES + ("off",)  # power = ...: a policy, or no power management

LOOPBACK_NAMES = ("localhost",)
PATH_SETTINGS = ("model", "draft_model", "api_key_file")  # resolved against a config file's folder
API_KEY_ENV = "EDGEINFER_API_KEY"
PROMPT_RINGS = 8  # max-prompt-tokens' default, in slot rings: a longer prompt would only shift through the
# ring for minutes, holding its slot (a 1 MiB body of one-letter messages: 195,025 tokens, 10 minutes)
MAX_GRACE_S = 86400  # a day: the systemd unit's stop timeout is built from it
MAX_TOKENS_LIMIT = 1 << 20  # max-tokens-limit's ceiling: a day of tokens at 12 a second


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None  # a model folder; None: the bundled model
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_key_file: str | None = None
    slots: int = 2  # requests generating at once, each with its own KV ring
    queue: int = 8  # requests waiting for a slot; one more is answered 429 at once
    capacity: int | None = None  # each slot's ring, in tokens (default: the model's)
    threads: int | None = None
    overflow: str = "shift"
    speculative: str = "off"  # ngram | draft: speculative decoding for every request (edgeinfer/speculative.py)
    draft_model: str | None = None  # with speculative = draft: the small model of the same tokenizer that drafts
    max_tokens_limit: int = 512  # the most tokens one request may generate (and the default)
    max_prompt_tokens: int | None = None  # the longest prompt accepted (None: PROMPT_RINGS x a slot's ring)
    max_body_bytes: int = 1 << 20  # larger request bodies are answered 413
    grace_s: float = 30.0  # on SIGTERM: how long requests in flight may take to finish
    log_format: str = "text"
    log_prompts: bool = False
    cors_origins: tuple[str, ...] = ()
    power: str = "balanced"  # performance | balanced | battery | thermal-guard | off (docs/power.md)
    max_temp_c: float | None = None  # power policy limits (None: the policy's default)
    min_battery_pct: float | None = None
    power_budget_w: float | None = None
    max_tokens_per_s: float | None = None

    @property
    def body_budget_bytes(self) -> int:
        """The most bytes of request bodies the server holds before admission (`body.BodyBudget`), and
        what the systemd unit counts for them: slots + queue bodies of max_body_bytes."""
        return (self.slots + self.queue) * self.max_body_bytes

    def power_policy(self):
        """The power Policy these settings give (None for power = "off"); checked in __post_init__."""
        from edgeinfer.power.policy import Policy
        if self.power == "off":
            return None
        return Policy(self.power, max_temp_c=self.max_temp_c, min_battery_pct=self.min_battery_pct,
                      power_budget_w=self.power_budget_w, max_tokens_per_s=self.max_tokens_per_s)

    def __post_init__(self) -> None:
        for name in ("host", "overflow", "log_format", "speculative"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"{name.replace('_', '-')} must be a string, got {shown(getattr(self, name))}")
        for name in ("model", "api_key_file", "draft_model"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"{name.replace('_', '-')} must be a string, got {shown(getattr(self, name))}")
            if getattr(self, name) == "":  # ("" was read as not given: model = "" served the bundled model)
                raise InvalidArgumentError(f"{name.replace('_', '-')} is an empty path")
        if not isinstance(self.log_prompts, bool):
            raise InvalidArgumentError(f"log-prompts must be true or false, got {shown(self.log_prompts)}")

        def positive(name: str, low: int = 1) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidArgumentError(f"{name.replace('_', '-')} must be an integer >= {low}, got {shown(v)}")

        for name in ("slots", "max_tokens_limit", "max_body_bytes"):
            positive(name)
        if self.max_tokens_limit > MAX_TOKENS_LIMIT:  # it is also each request's default: 10**21 let a request
            raise InvalidArgumentError(f"max-tokens-limit must be at most {MAX_TOKENS_LIMIT}, got "  # run for ever
                                       f"{self.max_tokens_limit}")
        positive("queue", 0)
        if self.max_prompt_tokens is not None:
            positive("max_prompt_tokens")
        if self.capacity is not None:
            positive("capacity", 2)  # named as the file and the flag name it (load's check says capacity_tokens)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"port must be in [0, 65535], got {shown(self.port)}")
        if self.speculative not in ("off",) + SPECULATIVE:
            raise InvalidArgumentError(f"speculative must be one of off, {', '.join(SPECULATIVE)}, "
                                       f"got {shown(self.speculative)}")
        if self.speculative == "draft" and not self.draft_model:
            raise InvalidArgumentError("speculative = draft needs draft-model (a model folder of the same tokenizer)")
        if self.draft_model is not None and self.speculative != "draft":
            raise InvalidArgumentError(f"draft-model is used only with speculative = draft, not "
                                       f"{shown(self.speculative)}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise InvalidArgumentError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {shown(self.overflow)}")
        if self.log_format not in ("text", "json"):
            raise InvalidArgumentError(f"log-format must be text or json, got {shown(self.log_format)}")
        if (not isinstance(self.grace_s, (int, float)) or isinstance(self.grace_s, bool)
                or not 0 <= self.grace_s < MAX_GRACE_S):  # NaN fails the comparison too
            raise InvalidArgumentError(f"grace-s must be a number of seconds in [0, {MAX_GRACE_S}), got {shown(self.grace_s)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or len(self.api_key) < 8):
            raise InvalidArgumentError("the API key must be a string of at least 8 characters")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()
                                             and " " not in self.api_key):
            raise InvalidArgumentError("the API key must be printable ASCII without spaces or line breaks (clients "
                                       "send it in an HTTP header, where anything else cannot match)")
        if not isinstance(self.power, str):
            raise InvalidArgumentError(f"power must be a string, got {shown(self.power)}")
        if self.power not in POWER_CHOICES:
            raise InvalidArgumentError(f"power must be one of {', '.join(POWER_CHOICES)}, got {shown(self.power)}")
        if self.power == "off" and any(v is not None for v in (self.max_temp_c, self.min_battery_pct,
                                                                self.power_budget_w, self.max_tokens_per_s)):
            raise InvalidArgumentError("power = off contradicts the power limits given (max-temp-c, min-battery-pct, "
                                       "power-budget-w, max-tokens-per-s): choose a policy or drop the limits")
        self.power_policy()  # an unknown policy or a bad limit is refused here, with its name
        origins = self.cors_origins
        if isinstance(origins, str) or not isinstance(origins, (list, tuple)) or \
                not all(isinstance(v, str) for v in origins):  # (a string was searched as one: "http://a.exa" passed)
            raise InvalidArgumentError(f"cors-origins must be a list of strings, got {shown(origins)}")
        object.__setattr__(self, "cors_origins", tuple(origin(v, bool(self.api_key)) for v in origins))
        if not is_loopback(self.host) and not self.api_key:
            raise InvalidArgumentError(
                f"refusing to listen on {self.host or 'every interface (host empty)'} without an API key: anyone on "
                "the network could use the model; give --api-key-file FILE (or EDGEINFER_API_KEY), or keep "
                "--host 127.0.0.1")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost: not provably loopback


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes
MAX_KEY_FILE_BYTES = 64 * 1024


def _from_toml(path: str) -> dict:
    # bounded, and a regular file only (a FIFO or /dev/zero was read for ever); UTF-8 (a file saved as Latin-1)
    raw = small_files.read_toml(Path(path), MAX_CONFIG_BYTES, InvalidArgumentError)
    known = {f.name: f for f in fields(ServeConfig)}
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in out:  # both spellings of one setting (max-tokens-limit and max_tokens_limit): the last won
            raise InvalidArgumentError(f"{path}: {shown(key)} is set twice (as {name.replace('_', '-')!r} and "
                                       f"{name!r}): keep one")
        if name not in known:
            raise InvalidArgumentError(f"{path}: unknown setting {shown(key)} (known: "
                                       f"{', '.join(n.replace('_', '-') for n in known)})")
        if name == "cors_origins":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InvalidArgumentError(f"{path}: cors-origins must be a list of strings")
            value = tuple(value)  # (each entry is checked and put in a browser's form by ServeConfig)
        elif name in PATH_SETTINGS and isinstance(value, str) and value:  # a wrong type is refused later, by name
            value = str(Path(path).resolve().parent / Path(value).expanduser())
        out[name] = value
    return out


def _read_key_file(path: str) -> str:
    """The key in `path`: one line (a byte-order mark and surrounding white space dropped)."""
    try:
        key = small_files.read_text(Path(path), MAX_KEY_FILE_BYTES, InvalidArgumentError)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"the API key file: {e}") from None
    key = key.removeprefix("\ufeff").strip()
    if not key:
        raise InvalidArgumentError(f"the API key file {path} is empty")
    if any(c.isspace() for c in key):
        raise InvalidArgumentError(f"the API key file {path} holds more than one line, or a key with spaces: "
                                   "put the key alone on one line")
    return key


def load_config(config_file: str | None, flags: dict, use_env_key: bool = True) -> ServeConfig:
    """Settings from `config_file` (TOML), then the flags given on the command line (None = not given),
    then, for `slots` and `power` still unset, the detected device profile's (`platforms.detect`),
    then the API key from --api-key, --api-key-file or EDGEINFER_API_KEY (at most one)."""
    settings = _from_toml(config_file) if config_file else {}
    settings.update({k: v for k, v in flags.items() if v is not None})
    if "slots" not in settings or "power" not in settings:  # what neither the file nor a flag set: the device's
        from edgeinfer.platforms import detect

        profile = detect().profile
        settings.setdefault("slots", profile.daemon_slots)
        settings.setdefault("power", profile.power_policy)
    given = [k for k in ("api_key", "api_key_file") if settings.get(k)]
    if len(given) > 1:
        raise InvalidArgumentError("give the API key once: --api-key or --api-key-file, not both")
    if settings.get("api_key_file"):
        settings["api_key"] = _read_key_file(settings["api_key_file"])
    elif use_env_key and not settings.get("api_key") and os.environ.get(API_KEY_ENV):
        settings["api_key"] = os.environ[API_KEY_ENV].strip()
    try:
        return ServeConfig(**settings)
    except TypeError as e:  # a TOML value of the wrong kind reaching a comparison
        raise InvalidArgumentError(f"bad setting: {e}") from None

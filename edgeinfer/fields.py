"""Typed manifest sections from JSON: `json_fields` checks a JSON object against a frozen dataclass's
annotated fields (ArchSpec, QuantScheme, TokenizerInfo, Interface use it); a missing, unknown or
ill-typed field raises `FieldError`, whose message starts with the field's dotted path.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing


class FieldError(ValueError):
    """A manifest field is missing or has a bad value; the message starts with its dotted path."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.field = where


def _value(v, hint, where: str):
    """`v` checked against the annotation `hint` (int, float, bool, str, X | None, tuple[X, ...], dict, a
    dataclass), converted where JSON differs (list -> tuple, int -> float, object -> dataclass)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        for a in args:
            if a is type(None) and v is None:
                return None
            if a is not type(None):
                try:
                    return _value(v, a, where)
                except FieldError:
                    pass
        names = " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
        raise FieldError(where, f"expected {names}, got {v!r}")
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise FieldError(where, f"expected a list, got {v!r}")
        return tuple(_value(x, args[0], f"{where}[{i}]") for i, x in enumerate(v))
    if dataclasses.is_dataclass(hint):
        return hint(**json_fields(hint, v, where))
    if hint is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, int) and abs(v) > 2 ** 1023 or not math.isfinite(v):  # 10**400, NaN, Infinity
            raise FieldError(where, f"expected a finite number, got {v!r:.40}")
        return float(v)
    want = origin or hint
    if not isinstance(v, want) or (want is int and isinstance(v, bool)):
        raise FieldError(where, f"expected {want.__name__}, got {v!r:.200}")
    return v


def json_fields(cls, d, where: str, skip: tuple[str, ...] = ()) -> dict:
    """The constructor arguments of dataclass `cls` from the JSON object `d` (a manifest section at
    `where`): every field of its annotated type, a missing one taking its default; unknown keys and
    missing required fields raise FieldError. Fields named in `skip` are left to the caller."""
    if not isinstance(d, dict):
        raise FieldError(where, f"expected an object, got {d!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    unknown = [k for k in d if k not in fields and k not in skip]
    if unknown:
        raise FieldError(f"{where}.{unknown[0]}", "unknown field")
    out = {}
    for name, f in fields.items():
        if name in d:
            out[name] = _value(d[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FieldError(f"{where}.{name}", "missing")
    return out

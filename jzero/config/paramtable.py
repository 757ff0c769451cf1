"""DeepSpeed-style parameter tables and the one checker both the optimizer and the scheduler use.

Both sections name a ``type`` and pass it torch/DeepSpeed keyword arguments. The owning module
keeps a table per type, ``{param: default}``, and `resolve` checks a section against it: unknown
keys (with the closest valid name), each value by the kind of its default (a pair of betas, true
or false, a number, one of a `Choice`), `REQUIRED` params, and ``"auto"`` through the caller's
source for it. The result is every param with DeepSpeed's defaults filled in.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jzero.config import AUTO, ConfigError, unknown

REQUIRED = object()  # marks a parameter without a default


@dataclass(frozen=True)
class Choice:
    """A parameter that takes one of ``options`` (compared by value and type)."""

    options: tuple[Any, ...]
    default: Any


def canonical(section: str, name: str, tables: Mapping[str, Any]) -> str:
    """The table key for the case-insensitive ``name`` (``section.type``); ConfigError otherwise."""
    by_lower = {k.lower(): k for k in tables}
    if name.lower() not in by_lower:
        raise unknown(f"{section}.type", f"{section} '{name}'", name, tables, cutoff=0.5)
    return by_lower[name.lower()]


def resolve(section: str, name: str, table: Mapping[str, Any], given: Mapping[str, Any], *,
            auto: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``given`` checked against ``table`` (the params of type ``name`` in ``section``), with the
    defaults filled in. ``auto(key)`` supplies a value written as ``"auto"`` (or raises)."""
    out = {}
    for key, value in given.items():
        where = f"{section}.params.{key}"
        if key not in table:
            raise unknown(where, f"key for {name}", key, table)
        default = table[key]
        if value == AUTO and not (isinstance(default, Choice) and AUTO in default.options):
            if auto is None:
                raise ConfigError(f"{where}: 'auto' has no source in jzero; set a value")
            out[key] = auto(key)
        else:
            out[key] = check(where, default, value)
    for key, default in table.items():
        if key in out:
            continue
        if default is REQUIRED:
            raise ConfigError(f"{section}.params.{key}: required by {name}")
        out[key] = default.default if isinstance(default, Choice) else default
    return out


def check(where: str, default: Any, value: Any) -> Any:
    """``value`` checked against the kind of ``default``; numbers for float defaults become floats."""
    if isinstance(default, Choice):
        if not any(value == o and type(value) is type(o) for o in default.options):
            valid = ", ".join(repr(o) if isinstance(o, str) else json.dumps(o) for o in default.options)
            raise ConfigError(f"{where}: {value!r} is not one of {valid}")
        return value
    if isinstance(default, tuple):
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 for v in value)
        if not ok:
            raise ConfigError(f"{where}: expected [beta1, beta2] with 0 <= beta < 1, got {value!r}")
        return tuple(float(v) for v in value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    return float(value) if isinstance(default, float) else value

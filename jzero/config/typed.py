"""JSON into frozen dataclasses, checked: the generic half of `jzero.config`.

`parse` turns a mapping into a dataclass by its type hints (nested dataclasses, Literals,
optionals, numbers, strings, mappings); an unknown key or a wrong type raises `ConfigError` with
the dotted key path and what would be valid. `read_json` reads a config file with errors naming
the file and line. The bottom of jzero's import graph: it imports no jzero module.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal

AUTO = "auto"


class ConfigError(ValueError):
    """A config key is unknown, mistyped, out of range or inconsistent; the message names the key."""


class ConfigWarning(UserWarning):
    """A DeepSpeed key that jzero accepts but that has no effect under XLA."""


def unknown(where: str, label: str, name: str, valid: Any, cutoff: float = 0.6) -> ConfigError:
    """The error for an unknown name, with the closest valid one suggested and all listed."""
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=cutoff)
    if not close:
        lowered = {v.lower(): v for v in valid}
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), lowered, n=1, cutoff=cutoff)]
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(f"{where}: unknown {label}; {hint}valid: {', '.join(valid)}")


def auto_field(default: Any = None, **kw: Any) -> Any:
    """A field that may also be written as ``"auto"`` (resolved by `load_config`)."""
    return field(default=default, metadata={"auto": True}, **kw)



def read_json(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    """A config as a dict: a mapping as it is, or a JSON file (errors name the file and line)."""
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
    return data


def parse(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected an object, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            raise unknown(where, "key", key, sorted(fields))
        if value == AUTO and fields[key].metadata.get("auto"):
            values[key] = AUTO
            continue
        values[key] = _coerce(hints[key], value, where)
    return cls(**values)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, where)
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if tp is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        return tuple(value)
    raise TypeError(f"unhandled config type {tp} at {where}")


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj

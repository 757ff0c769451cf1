"""What every ``jzero`` command shares: the usage error, reading a config with ``--set``
overrides, and simulating CPU devices before JAX starts a backend."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from jzero.analysis import target


class UsageError(Exception):
    """Bad command-line input; the message is shown as one line."""


def add_config_arguments(parser: argparse.ArgumentParser, *, devices_required: bool = False) -> None:
    """The positional CONFIG, ``--devices`` and ``--set KEY=VALUE`` of the config-reading commands."""
    parser.add_argument("config", help="a jzero / DeepSpeed JSON config file")
    parser.add_argument("--devices", type=int, required=devices_required,
                        help="devices to use; simulated on a CPU-only host")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key by dotted path, e.g. --set zero_optimization.stage=3")
    parser.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory: the model, its weights and "
                        "tokenizer (jzero.model.hf; this flag wins)")


def read_overridden(path: str, overrides: list[str], hf: str | None = None) -> dict[str, Any]:
    """The config file as a dict with ``--set key=value`` overrides applied (values parsed as JSON)
    and ``--hf DIR`` as ``jzero.model.hf``."""
    if not Path(path).is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: the top level must be a JSON object")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set zero_optimization.stage=3")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"--set {key}: '{part}' is not a section (it holds {child!r})")
            node = child
        node[parts[-1]] = value
    if hf is not None:
        if not Path(hf).is_dir():
            raise UsageError(f"--hf: {hf} is not a directory (a Hugging Face model directory with config.json)")
        raw.setdefault("jzero", {}).setdefault("model", {})["hf"] = hf
    return raw


def simulate_devices(count: int | None) -> None:
    """Ask XLA's CPU platform for ``count`` devices; must run before JAX starts a backend."""
    if count is None:
        return
    if count < 1:
        raise UsageError(f"--devices: must be >= 1, got {count}")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    """``--target``: compile for this host's devices (default) or an abstract TPU topology."""
    parser.add_argument("--target", default="cpu", metavar="cpu|tpu:GEN:TOPOLOGY",
                        help="compile for this host (default) or for TPU devices that are not here, e.g. "
                             "tpu:v5e:2x2, tpu:v5p:4x4x4 (the TPU compiler: pip install 'jzero[tpu-aot]'); "
                             "the mesh is the whole topology")


def config_on_devices(args: argparse.Namespace) -> dict[str, Any]:
    """The config with ``--set`` applied and ``--devices`` (else jzero.mesh.devices) simulated;
    with ``--target tpu:...`` the mesh is the topology's devices instead (nothing simulated)."""
    raw = read_overridden(args.config, args.set, getattr(args, "hf", None))
    try:
        tpu = target.devices(target.check(getattr(args, "target", target.CPU)))
    except target.TargetError as e:
        raise UsageError(str(e)) from None
    if tpu is not None:
        if args.devices not in (None, len(tpu)):
            raise UsageError(f"--devices: {args.devices} with --target {args.target}, whose topology has {len(tpu)} "
                             "devices (leave --devices out: the mesh is the whole topology)")
        raw.setdefault("jzero", {}).setdefault("mesh", {})["devices"] = len(tpu)
        return raw
    if args.devices is not None:
        if args.devices < 1:
            raise UsageError(f"--devices: must be >= 1, got {args.devices}")
        raw.setdefault("jzero", {}).setdefault("mesh", {})["devices"] = args.devices
    devices = raw.get("jzero", {}).get("mesh", {}).get("devices")
    simulate_devices(devices if isinstance(devices, int) else None)
    return raw


def fmt(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)

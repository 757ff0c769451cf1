"""``jzero estimate CONFIG --devices N``: per-device memory and communication of the compiled
step on abstract shapes (see `jzero.analysis.estimate`)."""
from __future__ import annotations

import argparse
import json

from jzero.cli.common import UsageError, add_config_arguments, add_target_argument, config_on_devices, fmt


def add_parser(sub: argparse._SubParsersAction) -> None:
    est = sub.add_parser("estimate", help="per-device memory and communication from the compiled step")
    add_config_arguments(est)
    add_target_argument(est)
    est.add_argument("--stage", type=int, action="append", choices=[0, 1, 2, 3],
                     help="ZeRO stage(s) to estimate (repeatable; default: the config's)")
    est.add_argument("--peak-flops", type=float, help="device peak FLOP/s: prints the step time floor")
    est.add_argument("--device-gb", type=float, default=80.0,
                     help="device memory in GB (10^9 bytes) the peak is checked against (default 80: an H100)")
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raw = config_on_devices(args)
    devices = raw.get("jzero", {}).get("mesh", {}).get("devices")
    if not isinstance(devices, int):
        raise UsageError("--devices: required unless the config sets jzero.mesh.devices (the devices to plan for)")

    from rich.console import Console
    from rich.table import Table

    from jzero.analysis import target
    from jzero.analysis.estimate import estimate, fits
    from jzero.train.resolve import load_config

    config = load_config(raw)
    stages = args.stage or [config.zero_optimization.stage]
    rows = [estimate(config, stage, target.devices(args.target)).row() for stage in stages]
    if args.peak_flops:
        for row in (r for r in rows if "tflops_per_step" in r):
            row["step_time_floor_s"] = row["tflops_per_step"] * 1e12 / args.peak_flops
    if args.json:
        print(json.dumps({"config": args.config, "target": args.target, "devices": devices, "stages": rows}, indent=2))
        return 0
    where = f"{devices} devices" + (f" of {args.target}" if args.target != "cpu" else "")
    table = Table(title=f"jzero estimate: {args.config}, {where}, per device")
    table.add_column("quantity")
    for row in rows:
        table.add_column(f"ZeRO-{row['stage']}", justify="right")
    for key in rows[0]:
        if key != "stage":
            table.add_row(key.replace("_", " "), *(fmt(row[key]) for row in rows))
    console = Console()
    console.print(table)
    for row in rows:
        console.print(fits(row, args.device_gb))
    return 0

"""``jzero autotune CONFIG --devices N``: ZeRO stage x micro-batch x remat, pruned by compiled
memory before anything runs, survivors timed (see `jzero.analysis.autotune`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jzero.cli.common import UsageError, add_config_arguments, config_on_devices


def add_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("autotune", help="pick ZeRO stage x micro-batch x remat by compiled memory, then time")
    add_config_arguments(tune, devices_required=True)
    tune.add_argument("--memory-budget", type=float, metavar="GiB",
                      help="per-device memory budget (default: the device's memory; required on CPU)")
    tune.add_argument("--budget-minutes", type=float, default=float("inf"), help="stop timing after this long")
    tune.add_argument("--out", default="runs/autotune", help="folder for best.json and results.json")
    tune.add_argument("--stage", type=int, action="append", choices=[0, 1, 2, 3], help="stages to try (default: all)")
    tune.add_argument("--remat", action="append", help="remat policies to try (default: none, dots, full)")
    tune.add_argument("--steps", type=int, default=3, help="timed steps per surviving candidate")
    tune.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raw = config_on_devices(args)

    from rich.console import Console
    from rich.table import Table

    from jzero.analysis import autotune
    from jzero.zero.remat import POLICIES

    for name in args.remat or []:
        if name not in POLICIES:
            raise UsageError(f"--remat: '{name}' is not one of {', '.join(POLICIES)}")
    budget = args.memory_budget * 2**30 if args.memory_budget else autotune.device_memory_bytes()
    if budget is None:
        raise UsageError("--memory-budget: required on this backend (its devices report no memory size)")
    results = autotune.measure(raw, args.devices, stages=args.stage or autotune.STAGES,
                               remats=args.remat or autotune.REMATS)
    ranked = autotune.tune(raw, results, int(budget), steps=args.steps, budget_s=60 * args.budget_minutes)
    table = Table(title=f"jzero autotune: {args.config}, {args.devices} devices, budget "
                        f"{budget / 2**30:.3g} GiB per device")
    for col in ("rank", "stage", "micro x accum", "remat", "peak MiB", "tokens/s", "status"):
        table.add_column(col, justify="left" if col in ("remat", "status") else "right")
    for row in autotune.table_rows(ranked):
        table.add_row(*row)
    Console().print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"budget_bytes": budget, "results": [r.row() for r in ranked]},
                                                 indent=2))
    if ranked[0].status != "timed":
        print(f"jzero: autotune: no candidate fits {budget / 2**30:.3g} GiB per device; see {out / 'results.json'}",
              file=sys.stderr)
        return 1
    (out / "best.json").write_text(json.dumps(ranked[0].candidate.config(raw), indent=2))
    print(f"jzero: best config: {out / 'best.json'} (all results: {out / 'results.json'})")
    return 0

"""``jzero tune lr CONFIG``: the learning-rate range test (`jzero.analysis.lrfind`): a suggestion, a plot
and a config with the lr and its warmup. ``jzero tune batch CONFIG --memory-budget GiB``: the
largest micro-batch per device whose compiled step fits the budget (`jzero.analysis.tune`), the
accumulation for the configured global batch, measured throughput at the top sizes, and the
tuned config written under ``--out``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from jzero.cli.common import UsageError, add_config_arguments, config_on_devices

GiB = 2**30


def add_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser("tune", help="find the learning rate, or the batch size from compiled memory")
    kinds = tune.add_subparsers(dest="what", required=True)
    lr = kinds.add_parser("lr", help="learning-rate range test: suggestion, plot, tuned config")
    add_config_arguments(lr)
    lr.add_argument("--min", type=float, default=1e-7, help="first lr (default 1e-7)")
    lr.add_argument("--max", type=float, default=1.0, help="last lr (default 1)")
    lr.add_argument("--steps", type=int, default=100, help="optimizer steps of the sweep (default 100)")
    lr.add_argument("--out", metavar="DIR", default="tune_lr", help="where lr_find.png, tuned_lr.json and "
                    "lr_find.json go (default ./tune_lr)")
    lr.set_defaults(func=run_lr)
    batch = kinds.add_parser("batch", help="largest micro-batch per device under a memory budget (no OOM trials)")
    add_config_arguments(batch)
    batch.add_argument("--memory-budget", type=float, metavar="GiB",
                       help="per-device budget in GiB (default: the device's memory, where the backend reports it)")
    batch.add_argument("--time-top", type=int, default=2, metavar="K",
                       help="measure samples/s at the K largest fitting micro-batches (runs them; 0: none)")
    batch.add_argument("--out", metavar="DIR", help="write tuned_batch.json (the config) and tune_batch.json here")
    batch.set_defaults(func=run_batch)


def run_lr(args: argparse.Namespace) -> int:
    raw = config_on_devices(args)
    from jzero.analysis import lrfind

    test = lrfind.range_test(raw, args.min, args.max, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warmup = max(1, args.steps // 10)
    (out / "tuned_lr.json").write_text(json.dumps(test.config(raw, warmup), indent=2))
    (out / "lr_find.json").write_text(json.dumps({"suggestion": test.suggestion, "diverged_at": test.diverged_at,
                                                    "lrs": test.lrs, "losses": test.losses,
                                                    "smoothed": test.smoothed}, indent=2))
    try:
        lrfind.plot(test, str(out / "lr_find.png"), f"jzero tune lr: {Path(args.config).name}")
    except ImportError:
        print("jzero: no plot: lr_find.png needs matplotlib (pip install 'jzero[plot]')")
    stopped = f", stopped at lr {test.diverged_at:.2e} (diverging)" if test.diverged_at is not None else ""
    print(f"jzero: suggested lr {test.suggestion:.3e} (steepest descent of the smoothed loss over "
          f"{len(test.lrs)} steps{stopped}); wrote {out / 'tuned_lr.json'} (WarmupLR over {warmup} steps) "
          f"and {out / 'lr_find.png'}")
    return 0


def run_batch(args: argparse.Namespace) -> int:
    raw = config_on_devices(args)
    from rich.console import Console
    from rich.table import Table

    from jzero.analysis import tune
    from jzero.analysis.autotune import device_memory_bytes

    budget = int(args.memory_budget * GiB) if args.memory_budget is not None else device_memory_bytes()
    if budget is None:
        raise UsageError("--memory-budget: this backend reports no device memory; give the budget in GiB")
    if budget <= 0:
        raise UsageError(f"--memory-budget: must be > 0 GiB, got {args.memory_budget}")
    if args.time_top < 0:
        raise UsageError(f"--time-top: must be >= 0, got {args.time_top}")
    search = tune.largest_micro_batch(raw, budget)
    if not search.largest:
        raise UsageError(f"--memory-budget: {budget / GiB:.3f} GiB fits no micro-batch (1 row per device peaks at "
                         f"{search.peaks[1] / GiB:.3f} GiB)")
    fitting = sorted((m for m, p in search.peaks.items() if p <= budget), reverse=True)[:args.time_top]
    speed = {m: tune.samples_per_s(raw, m) for m in fitting}
    table = Table(title=f"jzero tune batch: {args.config}, {search.devices} devices, budget {budget / GiB:.3f} GiB")
    for col in ("micro-batch per device", "compiled peak GiB", "fits", "samples/s"):
        table.add_column(col, justify="right")
    for m, peak in sorted(search.peaks.items()):
        table.add_row(str(m), f"{peak / GiB:.4f}", "yes" if peak <= budget else "no",
                      f"{speed[m]:,.1f}" if m in speed else "")
    Console().print(table)
    print(f"jzero: largest micro-batch {search.largest} per device; for train_batch_size {search.train_batch_size}: "
          f"micro {search.micro} x accumulation {search.accum} x {search.devices} devices")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tuned_batch.json").write_text(json.dumps(search.config(raw), indent=2))
        (out / "tune_batch.json").write_text(json.dumps({"budget": budget, "largest": search.largest,
                                                          "micro": search.micro, "accum": search.accum,
                                                          "peaks": search.peaks, "samples_per_s": speed}, indent=2))
        print(f"jzero: wrote {out / 'tuned_batch.json'}")
    return 0

"""``jzero train CONFIG``: train the config's reference model with checkpoints and resume.

It resumes from ``OUT/checkpoints`` when that holds a step, saves every
``jzero.checkpoint.interval`` steps and at the end, and on SIGTERM/SIGINT finishes the current
step, saves and exits with 128 + the signal number. Every process runs a step watchdog
(`jzero.runtime.watchdog`, ``jzero.watchdog``): a process stuck in one phase of a step exits with
`jzero.runtime.progress.EXIT_STALLED`, naming itself, the phase and the process that holds the run up;
stack dumps go to ``OUT/watchdog`` and progress reports to ``OUT/progress``.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jzero.cli.common import UsageError, add_config_arguments, read_overridden, simulate_devices

if TYPE_CHECKING:
    from jzero.config import Config
    from jzero.runtime.checkpoint import Checkpointer
    from jzero.runtime.watchdog import Unwatched, Watchdog


def add_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train the reference model from a DeepSpeed-style config")
    add_config_arguments(train)
    train.add_argument("--steps", type=int, help="train this many steps (default: jzero.train.steps)")
    train.add_argument("--data", metavar="PATH", help="training data (jzero.data.path): with --hf, a text file or "
                       "folder, or .jsonl / .parquet records of text, chats or prompt/completion pairs (packed, "
                       "trained on the answers: docs/finetune.md), tokenized by the model's tokenizer")
    train.add_argument("--out", default="runs/jzero", help="output folder for metrics (default: runs/jzero)")
    train.add_argument("--peak-tflops", type=float,
                       help="device peak TFLOP/s for MFU (default: known for H100/H200/A100/TPU, none on CPU)")
    train.add_argument("--no-resume", action="store_true",
                       help="start over instead of resuming from OUT/checkpoints (which is moved aside, not deleted)")
    train.add_argument("--auto-lr", type=int, nargs="?", const=100, metavar="STEPS",
                       help='with optimizer.params.lr "auto": run the lr range test first (STEPS steps, default 100; '
                            "jzero tune lr) and train with its suggestion")
    train.add_argument("--coordinator", metavar="HOST:PORT",
                       help="multi-process: process 0's address (env JZERO_COORDINATOR)")
    train.add_argument("--num-processes", type=int, help="multi-process: how many (env JZERO_NUM_PROCESSES)")
    train.add_argument("--process-id", type=int, help="multi-process: this one, 0-based (env JZERO_PROCESS_ID)")
    train.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jzero.runtime import distributed, progress, xla_flags
    from jzero.train.resolve import load_config

    raw = read_overridden(args.config, args.set, args.hf)
    if args.data is not None:
        raw.setdefault("jzero", {}).setdefault("data", {})["path"] = args.data
    setting = distributed.settings(args.coordinator, args.num_processes, args.process_id)
    devices = args.devices or raw.get("jzero", {}).get("mesh", {}).get("devices")
    if args.devices:
        raw.setdefault("jzero", {}).setdefault("mesh", {})["devices"] = args.devices
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps: must be >= 1, got {args.steps}")
        raw.setdefault("jzero", {}).setdefault("train", {})["steps"] = args.steps
    auto_lr = _auto_lr(raw, args.auto_lr)
    config = load_config(raw)
    # Before any JAX backend starts: simulated devices, XLA flags, the multi-process runtime.
    simulate_devices(_local_devices(devices, setting.num_processes) if isinstance(devices, int) else None)
    flags = xla_flags.apply(config)
    startup = config.jzero.watchdog.startup_timeout
    distributed.initialize(setting, startup, progress.folder(args.out))
    if auto_lr:
        from jzero.analysis import lrfind

        t0 = time.perf_counter()
        test = lrfind.range_test(raw, steps=auto_lr)
        raw["optimizer"]["params"]["lr"] = test.suggestion
        config = load_config(raw)
        if distributed.is_primary():
            print(f"jzero: --auto-lr: the lr range test ({len(test.lrs)} steps, {time.perf_counter() - t0:.0f} s) "
                  f"suggests lr {test.suggestion:.3e}; training with it")

    import jax

    from jzero.runtime import watchdog
    from jzero.runtime.checkpoint import Checkpointer

    out = Path(args.out)
    checkpoints = out / "checkpoints"
    if args.no_resume and checkpoints.exists() and distributed.is_primary():
        aside = out / f"checkpoints.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        checkpoints.rename(aside)
        print(f"jzero: --no-resume: moved the earlier checkpoints to {aside}")
    fault = watchdog.Fault.from_env()
    if fault is not None:
        fault.hit(jax.process_index(), "start-up", 1)
    distributed.barrier("jzero-start", startup)
    ckpt_cfg = config.jzero.checkpoint
    checkpointer = Checkpointer(checkpoints, config, max_to_keep=ckpt_cfg.max_to_keep, async_save=ckpt_cfg.async_save)
    try:
        with watchdog.from_config(config, out) as watch:
            return _train(config, out, checkpointer, watch, flags, args.peak_tflops)
    finally:
        checkpointer.close()


def _auto_lr(raw: dict[str, Any], steps: int | None) -> int | None:
    """The range test's steps when ``--auto-lr`` is given for an ``"auto"`` lr (a placeholder lr
    stands in until the test has run); one-line errors otherwise."""
    params = raw.get("optimizer", {}).get("params", {})
    if steps is None:
        return None
    if params.get("lr") != "auto":
        raise UsageError(f"--auto-lr: the config's optimizer.params.lr is {params.get('lr')!r}, not \"auto\"; "
                         "set it to \"auto\" for the range test to choose it")
    if steps < 5:
        raise UsageError(f"--auto-lr: the range test needs at least 5 steps, got {steps}")
    params["lr"] = 1e-3  # stands in for the config checks; replaced by the suggestion
    return steps


def _local_devices(total: int, num_processes: int) -> int:
    """Devices each process simulates: ``--devices`` counts the whole run's devices."""
    if total % num_processes:
        raise UsageError(f"--devices: {total} devices do not split over {num_processes} processes")
    return total // num_processes


def _train(config: Config, out: Path, checkpointer: Checkpointer, watch: Watchdog | Unwatched, flags: list[str],
           peak_tflops: float | None = None) -> int:
    import jax
    from rich.markup import escape

    from jzero.analysis import profile
    from jzero.runtime import distributed
    from jzero.runtime.engine import Engine
    from jzero.runtime.monitor import Monitor

    say = print if distributed.is_primary() else _silent
    engine = Engine(config, checkpointer, watch)
    config = engine.config
    steps, start = config.jzero.train.steps, int(engine.state.step)
    if engine.resumed:
        say(f"jzero: resuming from step {start} of {checkpointer.directory} (--no-resume starts over)")
    if start >= steps:
        say(f"jzero: already trained to step {start} (jzero.train.steps is {steps}); nothing to do. "
            "Pass --steps to train longer or --no-resume to start over.")
        return 0
    monitor = Monitor(config, out, total_steps=steps, start_step=start, metrics=engine.task.metrics,
                      step_metrics=engine.model.step_metrics)
    for line in engine.header(flags):
        monitor.print(line)
    with StopOnSignals() as stop:
        try:
            summary = engine.train(steps, monitor, checkpointer, should_stop=stop.requested)
        finally:
            monitor.close()
    if summary.stopped:
        say(f"jzero: {signal.Signals(stop.signum).name} received: saved step {summary.steps} in "
            f"{checkpointer.directory}; run the same command to resume", file=sys.stderr)
        return 128 + stop.signum
    out.mkdir(parents=True, exist_ok=True)
    summary.sample = engine.sample()
    peak = peak_tflops or profile.known_peak_tflops(jax.devices()[0].device_kind)
    monitor.summary("jzero train: summary", summary.rows(peak))
    monitor.print(f"[bold]{engine.task.preview_title}[/bold]:\n{escape(summary.sample)}")
    monitor.print(f"metrics: {out / 'metrics.csv'}")
    return 0


def _silent(*args: Any, **kwargs: Any) -> None:
    """What processes other than 0 print: nothing (their errors still reach stderr)."""


class StopOnSignals:
    """While active, SIGTERM and SIGINT ask the training loop to stop after the current step
    (it then saves a checkpoint) instead of killing the process; a second signal still does."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # asked twice: stop now
            signal.signal(signum, self._previous[signum])
            signal.raise_signal(signum)
        self.signum = signum

    def __enter__(self) -> StopOnSignals:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

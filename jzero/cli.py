"""The ``jzero`` command line: ``jzero train CONFIG [--steps N] [--devices N] [--out DIR] [--set k=v]
[--no-resume]``, ``jzero export CHECKPOINT OUT.safetensors``, ``jzero estimate``, ``jzero bench``.

`jzero train` resumes from ``OUT/checkpoints`` when it holds a step, saves every
``jzero.checkpoint.interval`` steps and at the end, and on SIGTERM/SIGINT finishes the current
step, saves and exits with 128 + the signal number.

On a CPU-only host the devices the run asks for (``--devices`` or ``jzero.mesh.devices``) are
simulated: the XLA flag is set here, before any JAX backend starts. On GPU/TPU hosts the flag
only concerns the (unused) CPU platform and the real devices are used. Bad input ends with one
line on stderr and exit code 2; Ctrl-C with one line and exit code 130.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jzero.checkpoint import Checkpointer
    from jzero.config import Config

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


class UsageError(Exception):
    """Bad command-line input; the message is shown as one line."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("jzero: interrupted by Ctrl-C; stopped cleanly", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        print(f"jzero: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # ConfigError, CheckpointError: one line, no traceback
        from jzero.checkpoint import CheckpointError
        from jzero.config import ConfigError

        if isinstance(e, (ConfigError, CheckpointError)):
            print(f"jzero: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jzero", description="DeepSpeed's training engine on JAX/XLA.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the reference GPT from a DeepSpeed-style config")
    train.add_argument("config", help="a jzero / DeepSpeed JSON config file")
    train.add_argument("--steps", type=int, help="train this many steps (default: jzero.train.steps)")
    train.add_argument("--devices", type=int, help="devices to use; simulated on a CPU-only host")
    train.add_argument("--out", default="runs/jzero", help="output folder for metrics (default: runs/jzero)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key by dotted path, e.g. --set zero_optimization.stage=3")
    train.add_argument("--peak-tflops", type=float,
                       help="device peak TFLOP/s for MFU (default: known for H100/H200/A100/TPU, none on CPU)")
    train.add_argument("--no-resume", action="store_true",
                       help="start over instead of resuming from OUT/checkpoints (which is moved aside, not deleted)")
    train.add_argument("--coordinator", metavar="HOST:PORT",
                       help="multi-process: process 0's address (env JZERO_COORDINATOR)")
    train.add_argument("--num-processes", type=int, help="multi-process: how many (env JZERO_NUM_PROCESSES)")
    train.add_argument("--process-id", type=int, help="multi-process: this one, 0-based (env JZERO_PROCESS_ID)")
    train.set_defaults(func=cmd_train)

    launch = sub.add_parser("launch", help="run a command as N processes on this host (like torchrun)")
    launch.add_argument("--nproc", type=int, required=True, help="processes to start")
    launch.add_argument("--devices-per-proc", type=int, help="simulated CPU devices per process")
    launch.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. -- jzero train CONFIG")
    launch.set_defaults(func=cmd_launch)

    tune = sub.add_parser("autotune", help="pick ZeRO stage x micro-batch x remat by compiled memory, then time")
    tune.add_argument("config", help="a jzero / DeepSpeed JSON config file (its train_batch_size is kept)")
    tune.add_argument("--devices", type=int, required=True, help="devices to tune for (simulated on CPU)")
    tune.add_argument("--memory-budget", type=float, metavar="GiB",
                      help="per-device memory budget (default: the device's memory; required on CPU)")
    tune.add_argument("--budget-minutes", type=float, default=float("inf"), help="stop timing after this long")
    tune.add_argument("--out", default="runs/autotune", help="folder for best.json and results.json")
    tune.add_argument("--stage", type=int, action="append", choices=[0, 1, 2, 3], help="stages to try (default: all)")
    tune.add_argument("--remat", action="append", help="remat policies to try (default: none, dots, full)")
    tune.add_argument("--steps", type=int, default=3, help="timed steps per surviving candidate")
    tune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    tune.set_defaults(func=cmd_autotune)

    prof = sub.add_parser("profile", help="FLOPs by model scope, bytes, intensity and top collectives of a step")
    prof.add_argument("config", help="a jzero / DeepSpeed JSON config file")
    prof.add_argument("--devices", type=int, help="devices (simulated on a CPU-only host)")
    prof.add_argument("--trace", metavar="DIR", help="also run a few steps under jax.profiler into DIR (TensorBoard)")
    prof.add_argument("--json", action="store_true", help="print JSON instead of tables")
    prof.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    prof.set_defaults(func=cmd_profile)

    exp = sub.add_parser("export", help="write a checkpoint's params as one safetensors file")
    exp.add_argument("checkpoint", help="a checkpoint directory (its newest readable step) or one step directory")
    exp.add_argument("out", help="the .safetensors file to write")
    exp.add_argument("--dtype", choices=["fp32", "bf16"], help="cast floating params (default: as saved)")
    exp.set_defaults(func=cmd_export)

    est = sub.add_parser("estimate", help="per-device memory and communication from the compiled step")
    est.add_argument("config", help="a jzero / DeepSpeed JSON config file")
    est.add_argument("--devices", type=int, required=True, help="device count to plan for (simulated)")
    est.add_argument("--stage", type=int, action="append", choices=[0, 1, 2, 3],
                     help="ZeRO stage(s) to estimate (repeatable; default: the config's)")
    est.add_argument("--peak-flops", type=float, help="device peak FLOP/s: prints the step time floor")
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    est.set_defaults(func=cmd_estimate)

    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/ (sweep, compile_time, fused_adamw)")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=cmd_bench)
    return parser


def read_overridden(path: str, overrides: list[str]) -> dict[str, Any]:
    """The config file as a dict with ``--set key=value`` overrides applied (values parsed as JSON)."""
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
    return raw


def simulate_devices(count: int | None) -> None:
    """Ask XLA's CPU platform for ``count`` devices; must run before JAX starts a backend."""
    if count is None:
        return
    if count < 1:
        raise UsageError(f"--devices: must be >= 1, got {count}")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])


def _local_devices(total: int, num_processes: int) -> int:
    """Devices each process simulates: ``--devices`` counts the whole run's devices."""
    if total % num_processes:
        raise UsageError(f"--devices: {total} devices do not split over {num_processes} processes")
    return total // num_processes


def cmd_launch(args: argparse.Namespace) -> int:
    from jzero import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("launch: give the command after --, e.g. jzero launch --nproc 2 -- jzero train CONFIG")
    if args.nproc < 1:
        raise UsageError(f"--nproc: must be >= 1, got {args.nproc}")
    return launch.run(cmd, args.nproc, devices_per_proc=args.devices_per_proc, port=args.port)


def cmd_train(args: argparse.Namespace) -> int:
    from jzero import distributed, xla_flags
    from jzero.config import load_config

    raw = read_overridden(args.config, args.set)
    run = distributed.settings(args.coordinator, args.num_processes, args.process_id)
    devices = args.devices or raw.get("jzero", {}).get("mesh", {}).get("devices")
    if args.devices:
        raw.setdefault("jzero", {}).setdefault("mesh", {})["devices"] = args.devices
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps: must be >= 1, got {args.steps}")
        raw.setdefault("jzero", {}).setdefault("train", {})["steps"] = args.steps
    config = load_config(raw)
    # Before any JAX backend starts: simulated devices, XLA flags, the multi-process runtime.
    simulate_devices(_local_devices(devices, run.num_processes) if isinstance(devices, int) else None)
    flags = xla_flags.apply(config)
    distributed.initialize(run)

    from jzero.checkpoint import Checkpointer

    out = Path(args.out)
    checkpoints = out / "checkpoints"
    if args.no_resume and checkpoints.exists() and distributed.is_primary():
        aside = out / f"checkpoints.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        checkpoints.rename(aside)
        print(f"jzero: --no-resume: moved the earlier checkpoints to {aside}")
    distributed.barrier("jzero-no-resume")
    ckpt_cfg = config.jzero.checkpoint
    checkpointer = Checkpointer(checkpoints, config, max_to_keep=ckpt_cfg.max_to_keep, async_save=ckpt_cfg.async_save)
    try:
        return _train(config, out, checkpointer, flags, args.peak_tflops)
    finally:
        checkpointer.close()


def _train(config: Config, out: Path, checkpointer: Checkpointer, flags: list[str],
           peak_tflops: float | None = None) -> int:
    import jax

    from rich.markup import escape

    from jzero.data import describe
    from jzero.engine import Engine
    from jzero.mesh import data_parallel_size
    from jzero.monitor import Monitor

    from jzero import distributed, profile, xla_flags

    say = print if distributed.is_primary() else _silent
    engine = Engine(config, checkpointer)
    config = engine.config
    steps, start = config.jzero.train.steps, int(engine.state.step)
    if engine.resumed:
        say(f"jzero: resuming from step {start} of {checkpointer.directory} (--no-resume starts over)")
    if start >= steps:
        say(f"jzero: already trained to step {start} (jzero.train.steps is {steps}); nothing to do. "
            "Pass --steps to train longer or --no-resume to start over.")
        return 0
    monitor = Monitor(config, out, total_steps=steps, start_step=start)
    mesh = engine.state.plan.mesh
    monitor.print(f"jzero: {describe(engine.corpus)}")
    monitor.print(f"jzero: GPT {config.jzero.model.size} ({engine.num_params:,} params), ZeRO stage "
                  f"{config.zero_optimization.stage}, mesh {dict(mesh.shape)} on {jax.devices()[0].platform}, "
                  f"batch {config.train_batch_size} = micro {config.train_micro_batch_size_per_gpu} x accum "
                  f"{config.gradient_accumulation_steps} x dp {data_parallel_size(mesh)}, remat {config.jzero.remat}")
    if xla_flags.describe(flags, jax.default_backend()):
        monitor.print(xla_flags.describe(flags, jax.default_backend()))
    with StopOnSignals() as stop:
        try:
            summary = engine.train(steps, monitor, checkpointer, should_stop=stop.requested)
        finally:
            monitor.close()
        checkpointer.wait()
    if summary.stopped:
        say(f"jzero: {signal.Signals(stop.signum).name} received: saved step {summary.steps} in "
              f"{checkpointer.directory}; run the same command to resume", file=sys.stderr)
        return 128 + stop.signum
    out.mkdir(parents=True, exist_ok=True)
    summary.sample = engine.sample()
    drop = 1 - summary.eval_loss / summary.first_eval_loss
    mem = summary.memory
    rows = [("steps", f"{summary.steps}"),
            ("final train loss", f"{summary.train_loss:.4f}"),
            ("held-out loss", f"{summary.first_eval_loss:.4f} -> {summary.eval_loss:.4f} ({drop:.0%} lower)"),
            ("tokens/s", f"{summary.tokens_per_s:,.0f}"),
            ("samples/s", f"{summary.samples_per_s:,.1f}"),
            ("step time (compile excluded)", f"{1e3 * summary.step_s:,.1f} ms"),
            ("compile time", f"{summary.compile_s:.1f} s")]
    tflops = summary.model_flops_per_step / summary.step_s / summary.devices / 1e12
    rows.append(("model TFLOP/s per device", f"{tflops:,.4g}"))
    peak = peak_tflops or profile.known_peak_tflops(jax.devices()[0].device_kind)
    if peak:
        rows.append((f"MFU (peak {peak:g} TFLOP/s)", f"{tflops / peak:.1%}"))
    if mem:
        rows += [("per-device persistent state (compiled step)", _mib(mem.persistent)),
                 ("per-device temporaries (compiled step)", _mib(mem.temp)),
                 ("per-device peak (compiled step)", _mib(mem.peak))]
    monitor.summary("jzero train: summary", rows)
    monitor.print(f"[bold]sample[/bold] (temperature 0.8):\n{escape(summary.sample)}")
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


def cmd_export(args: argparse.Namespace) -> int:
    from jzero.export import export

    written = export(args.checkpoint, args.out, args.dtype)
    print(f"jzero: wrote {written['tensors']} tensors ({_mib(written['bytes'])}) from step {written['step']} "
          f"of {args.checkpoint} to {written['path']}")
    return 0


def _config_on_devices(args: argparse.Namespace) -> dict[str, Any]:
    """The config with ``--set`` applied and ``--devices`` (else jzero.mesh.devices) simulated."""
    raw = read_overridden(args.config, args.set)
    if args.devices is not None:
        if args.devices < 1:
            raise UsageError(f"--devices: must be >= 1, got {args.devices}")
        raw.setdefault("jzero", {}).setdefault("mesh", {})["devices"] = args.devices
    devices = raw.get("jzero", {}).get("mesh", {}).get("devices")
    simulate_devices(devices if isinstance(devices, int) else None)
    return raw


def cmd_estimate(args: argparse.Namespace) -> int:
    raw = _config_on_devices(args)

    from rich.console import Console
    from rich.table import Table

    from jzero.config import load_config
    from jzero.estimate import estimate

    config = load_config(raw)
    stages = args.stage or [config.zero_optimization.stage]
    rows = [estimate(config, stage).row() for stage in stages]
    if args.peak_flops:
        for row in rows:
            row["step_time_floor_s"] = row["tflops_per_step"] * 1e12 / args.peak_flops
    if args.json:
        print(json.dumps({"config": args.config, "devices": args.devices, "stages": rows}, indent=2))
        return 0
    table = Table(title=f"jzero estimate: {args.config}, {args.devices} devices, per device")
    table.add_column("quantity")
    for row in rows:
        table.add_column(f"ZeRO-{row['stage']}", justify="right")
    for key in rows[0]:
        if key != "stage":
            table.add_row(key.replace("_", " "), *(_fmt(row[key]) for row in rows))
    Console().print(table)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    raw = _config_on_devices(args)

    from rich.console import Console
    from rich.table import Table

    from jzero import profile
    from jzero.config import load_config
    from jzero.estimate import compile_step
    from jzero.models import gpt

    compiled, state, _, model_cfg, compile_s = compile_step(load_config(raw))
    devices = state.plan.mesh.size
    tokens = state.config.train_batch_size * model_cfg.seq_len
    scopes = {k: v * devices for k, v in sorted(profile.matmul_flops_by_scope(compiled).items(),
                                                  key=lambda kv: -kv[1])}
    total = sum(scopes.values())
    nbytes = profile.bytes_accessed(compiled)
    collectives = sorted(profile.comm(compiled).collectives, key=lambda c: -c.ring_bytes * c.count)[:5]
    report = {
        "config": args.config, "devices": devices, "tokens_per_step": tokens, "compile_s": compile_s,
        "matmul_flops_by_scope": scopes, "matmul_flops": total,
        "analytic_flops": gpt.model_flops(model_cfg, tokens),
        "xla_cost_analysis_flops_per_device": profile.xla_flops(compiled),
        "bytes_accessed_per_device": nbytes, "arithmetic_intensity": total / devices / nbytes,
        "top_collectives": [{"kind": c.kind, "dtype": c.dtype, "elements": c.elements, "group_size": c.group_size,
                             "per_step": c.count, "ring_bytes_per_step": c.ring_bytes * c.count, "name": c.name}
                            for c in collectives]}
    if args.trace:
        report["trace"] = _trace(raw, args.trace)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    table = Table(title=f"jzero profile: {args.config}, {devices} devices, {tokens:,} tokens per step")
    for col in ("scope", "GFLOPs per step", "share"):
        table.add_column(col, justify="left" if col == "scope" else "right")
    for scope, value in scopes.items():
        table.add_row(scope, f"{value / 1e9:,.3f}", f"{value / total:.1%}")
    table.add_row("all matmuls", f"{total / 1e9:,.3f}", "100%")
    analytic = report["analytic_flops"]["total"]
    table.add_row("analytic 6*params*tokens + attention", f"{analytic / 1e9:,.3f}", f"{analytic / total:.1%}")
    console.print(table)
    console.print(f"bytes accessed per device {nbytes / 2**20:,.1f} MiB (XLA cost analysis), arithmetic intensity "
                  f"{report['arithmetic_intensity']:.1f} FLOP/byte, compile {compile_s:.1f} s")
    coll = Table(title="top collectives by bytes per step (ring algorithm, per device)")
    for col in ("kind", "dtype", "elements", "group", "per step", "MiB per step"):
        coll.add_column(col, justify="right")
    for c in report["top_collectives"]:
        coll.add_row(c["kind"], c["dtype"], f"{c['elements']:,}", str(c["group_size"]), str(c["per_step"]),
                     f"{c['ring_bytes_per_step'] / 2**20:,.3f}")
    console.print(coll)
    if args.trace:
        console.print(f"trace: {report['trace']} (tensorboard --logdir {args.trace})")
    return 0


def _trace(raw: dict[str, Any], directory: str) -> str:
    """Run three steps of the config under `jax.profiler.trace` into ``directory``."""
    import jax
    import numpy as np

    import jzero
    from jzero.config import load_config
    from jzero.models import gpt

    config = load_config(raw)
    model_cfg = gpt.gpt_config(config.jzero.model, config.jzero.remat)
    init_fn, loss_fn = gpt.make(model_cfg)
    state = jzero.init(init_fn, config, loss_fn=loss_fn, rng=0)
    tokens = np.zeros((state.config.train_batch_size, model_cfg.seq_len), np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    state, metrics = jzero.train_step(state, batch)  # compile outside the trace
    jax.block_until_ready(metrics)
    with jax.profiler.trace(directory):
        for _ in range(3):
            state, metrics = jzero.train_step(state, batch)
        jax.block_until_ready(metrics)
    return directory


def cmd_autotune(args: argparse.Namespace) -> int:
    raw = _config_on_devices(args)

    from rich.console import Console
    from rich.table import Table

    from jzero import autotune
    from jzero.remat import POLICIES

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


BENCHMARKS = {"sweep": "sweep.py", "compile_time": "compile_time.py", "fused_adamw": "fused_adamw.py"}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/NAME.py`` of this checkout (benchmarks ship with the repository)."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "benchmarks" / BENCHMARKS[args.name]
    if not script.is_file():
        raise UsageError(f"bench {args.name}: {script} not found; benchmarks run from a repository checkout")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _fmt(value: Any) -> str:
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


if __name__ == "__main__":
    sys.exit(main())

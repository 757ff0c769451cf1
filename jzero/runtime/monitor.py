"""What a run shows and records: a live progress bar, log lines, CSV and TensorBoard metrics.

`OUT/metrics.csv` always gets a row per logged step (columns `CSV_COLUMNS`; ``eval_loss`` only
where it was measured). DeepSpeed's ``tensorboard`` section adds event files (tensorboardX: it
writes TensorBoard's format without TensorFlow) and ``csv_monitor`` a second CSV where it says.
Only process 0 writes or prints.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from jzero.config import Config, MonitorConfig

CSV_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "eval_loss")


@dataclass
class RunSummary:
    """What a finished (or stopped) `jzero train` run shows in its summary table."""

    steps: int = 0
    train_loss: float = float("nan")
    first_eval_loss: float = float("nan")
    eval_loss: float = float("nan")
    tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    step_s: float = float("nan")  # mean wall time of a training step (compile excluded)
    model_flops_per_step: float = 0.0  # analytic model FLOPs of one step, all devices (no recompute)
    devices: int = 1
    compile_s: float = 0.0
    memory: Any = None  # jzero.analysis.profile.MemoryReport of the compiled step, per device (None: not reported)
    attention_temp: int | None = None  # attention's share of those temporaries (None: no attention)
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the task's, at the last evaluation
    sample: str = ""
    stopped: bool = False  # ended early by should_stop (a signal)

    def rows(self, peak_tflops: float | None = None) -> list[tuple[str, str]]:
        """The summary table's rows; MFU where the device's peak TFLOP/s is known."""
        drop = 1 - self.eval_loss / self.first_eval_loss
        rows = [("steps", f"{self.steps}"),
                ("final train loss", f"{self.train_loss:.4f}"),
                ("held-out loss", f"{self.first_eval_loss:.4f} -> {self.eval_loss:.4f} ({drop:.0%} lower)"),
                *((f"held-out {name}", f"{value:.4f}") for name, value in self.eval_metrics.items()),
                ("tokens/s", f"{self.tokens_per_s:,.0f}"),
                ("samples/s", f"{self.samples_per_s:,.1f}"),
                ("step time (compile excluded)", f"{1e3 * self.step_s:,.1f} ms"),
                ("compile time", f"{self.compile_s:.1f} s")]
        tflops = self.model_flops_per_step / self.step_s / self.devices / 1e12
        rows.append(("model TFLOP/s per device", f"{tflops:,.4g}"))
        if peak_tflops:
            rows.append((f"MFU (peak {peak_tflops:g} TFLOP/s)", f"{tflops / peak_tflops:.1%}"))
        if self.memory is not None:
            rows += [("per-device persistent state (compiled step)", mib(self.memory.device_persistent)),
                     ("per-device temporaries (compiled step)", mib(self.memory.temp)),
                     *((("  of which attention", mib(self.attention_temp)),) if self.attention_temp else ()),
                     ("per-device peak (compiled step)", mib(self.memory.peak))]
            if self.memory.host:
                rows.append(("per-device state in host memory (offloaded)", mib(self.memory.host)))
        return rows


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


class CsvWriter:
    """One row per logged step. A run from step 0 starts the file anew; a run resumed at
    ``start_step`` keeps the rows up to it (rows a killed run logged after its last checkpoint
    are dropped: the resumed run logs those steps again) and appends."""

    def __init__(self, path: Path, start_step: int, columns: tuple[str, ...] = CSV_COLUMNS):
        self.columns = columns
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = start_step == 0 or not path.exists() or path.stat().st_size == 0
        if not fresh:
            _truncate_after(path, start_step, columns)
        self._file = open(path, "w" if fresh else "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=columns)
        if fresh:
            self._writer.writeheader()
            self._file.flush()

    def write(self, row: dict[str, Any]) -> None:
        self._writer.writerow({k: _fmt(row.get(k)) for k in self.columns})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _truncate_after(path: Path, step: int, columns: tuple[str, ...]) -> None:
    with open(path, newline="", encoding="utf-8") as f:
        rows = [row for row in csv.DictReader(f) if row.get("step", "").isdigit() and int(row["step"]) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


class TensorBoardWriter:
    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(logdir))

    def write(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key != "step" and value is not None:
                self._writer.add_scalar(f"train/{key}", value, row["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _section_dir(section: MonitorConfig, out: Path, default: str) -> Path:
    base = Path(section.output_path) if section.output_path else out / default
    return base / section.job_name


class Monitor:
    """Progress bar + log lines + metric writers for one run (silent on processes other than 0)."""

    def __init__(self, config: Config, out: Path, total_steps: int, start_step: int = 0,
                 console: Console | None = None, metrics: tuple[str, ...] = (),
                 step_metrics: tuple[str, ...] = ()):
        """``metrics``: the task's held-out metrics, columns of metrics.csv after ``eval_loss``;
        ``step_metrics``: the model's per-step metrics (MoE load...), the columns after them."""
        self.active = jax.process_index() == 0
        self.metrics, self.step_metrics, self._latest = metrics, step_metrics, ""
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.print_every = config.steps_per_print
        self._writers: list[Any] = []
        self._progress = None
        if not self.active:
            return
        columns = (*CSV_COLUMNS, *metrics, *step_metrics)
        self._writers.append(CsvWriter(out / "metrics.csv", start_step, columns))
        if config.csv_monitor.enabled:
            self._writers.append(CsvWriter(_section_dir(config.csv_monitor, out, "csv_monitor") / "metrics.csv",
                                           start_step, columns))
        if config.tensorboard.enabled:
            self._writers.append(TensorBoardWriter(_section_dir(config.tensorboard, out, "tensorboard")))
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                  console=self.console, transient=True)
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._progress.start()

    def print(self, *args: Any) -> None:
        if self.active:
            self.console.print(*args)

    def update(self, step: int, info: dict[str, float]) -> None:
        """Advance the bar to ``step`` showing loss / lr / tokens/s."""
        if self._progress is not None:
            text = f"loss {info['loss']:.4f}  lr {info['lr']:.2e}  {info['tokens_per_s']:,.0f} tok/s{self._latest}"
            self._progress.update(self._task, completed=step, info=text)

    def log(self, row: dict[str, Any]) -> None:
        """Record a logged step in every writer and print it as one line."""
        if not self.active:
            return
        for writer in self._writers:
            writer.write(row)
        parts = [f"step {row['step']:>6}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.3e}",
                 f"grad_norm {row['grad_norm']:.3f}", f"{row['tokens_per_s']:,.0f} tok/s",
                 *(f"{name} {row[name]:.3f}" for name in self.step_metrics)]
        if row.get("eval_loss") is not None:
            parts.append(f"held-out {row['eval_loss']:.4f}")
            measured = [f"{name} {row[name]:.3f}" for name in self.metrics if row.get(name) is not None]
            parts += measured
            self._latest = "".join(f"  {m}" for m in measured)
        if row.get("loss_scale") is not None:
            parts.append(f"loss-scale {row['loss_scale']:g}  skipped {int(row['skipped_total'])}")
            if row.get("loss_scale_at_min"):
                parts.append("(at min_loss_scale: overflowing steps are skipped, the run goes on)")
        self.console.print("  ".join(parts))

    def summary(self, title: str, rows: list[tuple[str, str]]) -> None:
        if not self.active:
            return
        table = Table(title=title, show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        for key, value in rows:
            table.add_row(key, value)
        self.console.print(table)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for writer in self._writers:
            writer.close()
        self._writers = []

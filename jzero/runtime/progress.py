"""Per-process progress reports: where each process of a run is, written to a shared folder.

Every process of `jzero train` keeps one small JSON file, ``rank<i>.json``, saying which step it
last finished and which phase of the next one it is in (and since when); its watchdog thread
rewrites the file every second (`jzero.runtime.watchdog`). Whoever needs to know which process holds a
run up reads the folder: a process's own watchdog when it stalls, `jzero launch` when the ranks
stop advancing, and a process waiting at start-up for peers that never came. The folder is
``JZERO_PROGRESS_DIR`` when set (`jzero launch` sets it), else ``OUT/progress``. Pure Python: the
launcher reads it without JAX.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "JZERO_PROGRESS_DIR"
EXIT_STALLED = 75  # sysexits' EX_TEMPFAIL: a process stalled or never joined; rerun the same command
# A step's phases in order: a process in an earlier phase of the same step is behind.
PHASES = ("start-up", "restore", "data", "compute/collective", "evaluation", "checkpoint")


@dataclass(frozen=True)
class Report:
    """One process's position: ``step`` last finished (-1 before the first), the ``phase`` it is
    in now and since when (``since``), when the report was written (``updated``) and the stall
    timeout its watchdog applies (None: unwatched)."""

    rank: int
    pid: int
    host: str
    started: float
    step: int = -1
    phase: str = "start-up"
    since: float = 0.0
    updated: float = 0.0
    timeout: float | None = None

    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.phase)

    def describe(self, now: float) -> str:
        where = f"in {self.phase} of step {self.step + 1}" if self.phase != "start-up" else "starting up"
        return f"rank {self.rank} (pid {self.pid} on {self.host}) {where} for {now - self.since:.0f} s"


def folder(out: str | os.PathLike) -> Path:
    """The run's progress folder: ``JZERO_PROGRESS_DIR`` or ``out/progress``."""
    return Path(os.environ.get(ENV) or Path(out) / "progress")


def write(directory: Path, report: Report) -> None:
    """Replace ``rank<i>.json`` atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{report.rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(report)))
    os.replace(tmp, path)


def read_all(directory: Path, since: float = 0.0) -> dict[int, Report]:
    """The reports in ``directory`` written at or after ``since`` (older files belong to an
    earlier run in the same folder, or to a process that is gone); unreadable files are skipped."""
    reports = {}
    for path in sorted(directory.glob("rank*.json")) if directory.is_dir() else ():
        try:
            report = Report(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if report.updated >= since:
            reports[report.rank] = report
    return reports


def behind(reports: dict[int, Report]) -> list[Report]:
    """The reports furthest behind (lowest step, then earliest phase); none when all are level,
    since then no single process holds the others up."""
    if not reports:
        return []
    low = min(r.order() for r in reports.values())
    laggards = [r for r in reports.values() if r.order() == low]
    return [] if len(laggards) == len(reports) > 1 else laggards


def likely_cause(reports: dict[int, Report], expected: int, now: float | None = None) -> str:
    """One clause naming the process(es) that hold the run up: ranks with no report at all, else
    the ones furthest behind, else (all level) the shared phase."""
    now = time.time() if now is None else now
    missing = [r for r in range(expected) if r not in reports]
    if missing:
        return f"likely cause: rank {', '.join(map(str, missing))} (no progress report)"
    laggards = behind(reports)
    if laggards:
        return "likely cause: " + "; ".join(r.describe(now) for r in laggards)
    if reports:
        level = next(iter(reports.values()))
        return (f"all {len(reports)} ranks are in {level.phase} of step {level.step + 1}: "
                "a collective or device that never completed")
    return "no progress reports"

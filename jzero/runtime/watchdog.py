"""The step watchdog: a process that stops making progress exits with a line saying where, instead
of hanging the job.

A stuck process (in I/O, a deadlock, a lost device) leaves every other process waiting in its
next collective forever. `Watchdog` is a daemon thread beside the training loop: the loop says
which phase it enters (`enter`: data, compute/collective, evaluation, checkpoint) and when a step
finishes (`step_done`); when one phase lasts longer than the timeout, the thread writes one line
naming this process, the step and the phase, and the process that holds the run up (from the
peers' progress reports, `jzero.runtime.progress`), dumps the Python stacks of all threads to
``OUT/watchdog/rank<i>-stacks.txt`` and ends the process with `EXIT_STALLED`. It needs no
cooperation from the stuck main thread (JAX releases the GIL while it waits on a device).

The timeout is ``jzero.watchdog.step_timeout`` seconds when set; by default it is derived from
the run itself: ``FACTOR`` x the slowest of the recent steps, never below
``jzero.watchdog.min_timeout``. Compile time is not judged: the training step is compiled before
the watch starts, and the first time a phase is entered (the held-out evaluation compiles its
programs then, the first checkpoint sets up its writer) it gets at least ``min_timeout``. The
clock restarts at each phase, so a long evaluation or checkpoint is judged on its own.

The thread needs the GIL. For a stuck C++ call that holds it, ``faulthandler``'s own C thread
is the backstop: it dumps the stacks to stderr and ends the process with code 1 between
``timeout + BACKSTOP_S / 2`` and ``timeout + BACKSTOP_S`` into a phase (after this thread's own
verdict, laggard wait included). `enter` re-arms it only when half its margin is used, so the
loop pays for it about once every ``BACKSTOP_S / 2`` seconds, not at every phase.

`Fault` is for tests only: ``JZERO_FAULT=rank:phase:step:seconds`` makes that rank sleep on
entering that phase of that step (``start-up``: before the first barrier, step 1), so a stall
can be produced end to end.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from jzero.config import AUTO, Config
from jzero.runtime import progress
from jzero.runtime.progress import EXIT_STALLED

FACTOR = 20.0  # auto timeout = FACTOR x the slowest recent step
RECENT = 50  # steps the auto timeout looks back over
REPORT_S = 1.0  # how often the progress report is rewritten
FRESH_S = 30.0  # a peer's report older than this: the peer is gone or frozen
LAGGARD_WAIT_S = 10.0  # at most this long for a lagging peer's watchdog to speak first
BACKSTOP_S = 3 * LAGGARD_WAIT_S  # past the timeout: faulthandler's own thread ends the process
FAULT_ENV = "JZERO_FAULT"


@dataclass(frozen=True)
class Fault:
    """Test-only fault injection: rank ``rank`` sleeps ``seconds`` on entering ``phase`` of step
    ``step`` (1-based, the step being trained)."""

    rank: int
    phase: str
    step: int
    seconds: float

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Fault | None:
        text = (os.environ if environ is None else environ).get(FAULT_ENV)
        if not text:
            return None
        try:
            rank, phase, step, seconds = text.split(":")
            fault = cls(int(rank), phase, int(step), float(seconds))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: expected rank:phase:step:seconds, e.g. 1:data:5:600, "
                             f"got {text!r}") from None
        if phase not in progress.PHASES:
            raise ValueError(f"{FAULT_ENV}: unknown phase {phase!r}; valid: {', '.join(progress.PHASES)}")
        return fault

    def hit(self, rank: int, phase: str, step: int) -> None:
        """Sleep when this is the fault's rank, phase and step."""
        if (self.rank, self.phase, self.step) == (rank, phase, step):
            time.sleep(self.seconds)


def auto_timeout(step_times: list[float], floor: float) -> float:
    """``FACTOR`` x the slowest of ``step_times``, at least ``floor`` seconds."""
    return max(floor, FACTOR * max(step_times, default=0.0))


class Watchdog:
    """Watches one process of a run (rank ``rank``), reporting to the progress folder
    ``directory`` and dumping stacks under ``dumps``; ``timeout`` None = derived (`auto_timeout`).
    A context manager: the watch runs inside ``with``."""

    def __init__(self, rank: int, num_processes: int, directory: Path, dumps: Path, *,
                 timeout: float | None = None, floor: float = 300.0, fault: Fault | None = None):
        self.rank, self.num_processes = rank, num_processes
        self.directory, self.dumps = directory, dumps
        self.fixed, self.floor, self.fault = timeout, floor, fault
        now = time.time()
        self.report = progress.Report(rank=rank, pid=os.getpid(), host=socket.gethostname(), started=now,
                                      since=now, updated=now)
        self.step_times: deque[float] = deque(maxlen=RECENT)
        self.seen: set[str] = set()  # phases entered before: their compiles are done
        self.first = False  # the current phase is entered for the first time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jzero-watchdog", daemon=True)
        self.watching = False
        self.active = False  # inside ``with``: the backstop may be armed
        self.armed_until = 0.0  # when the armed backstop fires

    @property
    def timeout(self) -> float:
        """Seconds the current phase may last."""
        limit = self.fixed if self.fixed is not None else auto_timeout(list(self.step_times), self.floor)
        return max(limit, self.floor) if self.first else limit

    def __enter__(self) -> Watchdog:
        self._publish()
        self.active = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        faulthandler.cancel_dump_traceback_later()
        self._stop.set()
        self._thread.join()

    def enter(self, phase: str, step: int | None = None) -> None:
        """The main thread enters ``phase`` (of the step after ``step``, the last finished; by
        default the current one); the clock restarts and the watch is on."""
        now = time.time()
        with self._lock:
            done = self.report.step if step is None else step
            self.report = replace(self.report, step=done, phase=phase, since=now)
            self.first, self.watching = phase not in self.seen, True
            self.seen.add(phase)
        margin = self.armed_until - now - self.timeout  # keep it in [BACKSTOP_S / 2, BACKSTOP_S]
        if self.active and not BACKSTOP_S / 2 <= margin <= BACKSTOP_S:
            self.armed_until = now + self.timeout + BACKSTOP_S
            faulthandler.dump_traceback_later(self.armed_until - now, exit=True)
        if self.fault is not None:
            self.fault.hit(self.rank, phase, done + 1)

    def pause(self) -> None:
        """Stop judging until the next `enter` (a compile, the end of the run)."""
        faulthandler.cancel_dump_traceback_later()
        self.armed_until = 0.0
        with self._lock:
            self.watching = False

    def step_done(self, step: int, seconds: float) -> None:
        """Step ``step`` finished, its data and compute phases took ``seconds``."""
        self.step_times.append(seconds)
        with self._lock:
            self.report = replace(self.report, step=step)

    def _publish(self) -> progress.Report:
        with self._lock:
            self.report = replace(self.report, updated=time.time(), timeout=self.timeout if self.watching else None)
            report = self.report
        try:
            progress.write(self.directory, report)
        except OSError:  # a full or vanished folder must not stop training
            pass
        return report

    def _watch(self) -> None:
        while not self._stop.wait(REPORT_S):
            report = self._publish()
            if self.watching and time.time() - report.since > self.timeout:
                self._stalled(report)

    def _peers(self, report: progress.Report) -> dict[int, progress.Report]:
        """The fresh progress reports of this run's processes, this one's current report included."""
        peers = progress.read_all(self.directory, since=time.time() - FRESH_S)
        peers[self.rank] = report
        return {r: p for r, p in peers.items() if r < self.num_processes}

    def _stalled(self, report: progress.Report) -> None:
        peers = self._peers(report)
        # The process holding the run up has the telling stacks: when it is another watched one,
        # let its own watchdog speak first (whoever exits first takes the others down with it).
        laggards = [r for r in progress.behind(peers) if r.rank != self.rank and r.timeout is not None]
        if laggards:
            wait = max(r.since + r.timeout for r in laggards) + 2 * REPORT_S - time.time()
            time.sleep(min(max(wait, 0.0), LAGGARD_WAIT_S))
            peers = self._peers(report)
        now = time.time()
        cause = "" if self.num_processes == 1 else "; " + progress.likely_cause(peers, self.num_processes, now)
        if [r.rank for r in progress.behind(peers)] == [self.rank]:
            cause = "; the other ranks are ahead: this process holds the run up"
        self.dumps.mkdir(parents=True, exist_ok=True)
        stacks = self.dumps / f"rank{self.rank}-stacks.txt"
        with open(stacks, "w") as f:
            f.write(f"jzero watchdog: rank {self.rank}, {report.phase} of step {report.step + 1}, "
                    f"no progress for {now - report.since:.0f} s\n")
            faulthandler.dump_traceback(f, all_threads=True)
        print(f"jzero watchdog: rank {self.rank} made no progress for {now - report.since:.0f} s (timeout "
              f"{self.timeout:.0f} s) in {report.phase} of step {report.step + 1}{cause}; Python stacks in "
              f"{stacks}; exiting with code {EXIT_STALLED} (rerun the same command to resume from the last "
              "checkpoint)", file=sys.stderr, flush=True)
        os._exit(EXIT_STALLED)


class Unwatched:
    """The watchdog's interface, watching nothing (``jzero.watchdog.enabled: false``, library use)."""

    def __enter__(self) -> Unwatched:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def enter(self, phase: str, step: int | None = None) -> None:
        pass

    def pause(self) -> None:
        pass

    def step_done(self, step: int, seconds: float) -> None:
        pass


def from_config(config: Config, out: str | os.PathLike) -> Watchdog | Unwatched:
    """The watchdog ``jzero.watchdog`` asks for, reporting to the run's progress folder and
    dumping stacks under ``out/watchdog``."""
    import jax

    section = config.jzero.watchdog
    if not section.enabled:
        return Unwatched()
    timeout = None if section.step_timeout in (None, AUTO) else float(section.step_timeout)
    return Watchdog(jax.process_index(), jax.process_count(), progress.folder(out), Path(out) / "watchdog",
                    timeout=timeout, floor=section.min_timeout, fault=Fault.from_env())

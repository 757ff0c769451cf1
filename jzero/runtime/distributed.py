"""Multi-process start-up: `jax.distributed.initialize` from flags, JZERO_* variables or the cluster.

Every process of a multi-host run executes the same program on its own devices (JAX's
multi-controller model); ZeRO's collectives then span all processes. Settings, first found wins:

1. explicit arguments (``jzero train --coordinator HOST:PORT --num-processes N --process-id I``);
2. ``JZERO_COORDINATOR``, ``JZERO_NUM_PROCESSES``, ``JZERO_PROCESS_ID`` (what `jzero launch` sets);
3. a cluster JAX detects by itself (SLURM, Open MPI, TPU pods): ``initialize()`` without arguments.

Nothing found (or one process) = a single-process run; nothing is started. On CPU the
collectives between processes go through gloo. Must run before any JAX computation.

Start-up never waits forever: when a process does not join within ``jzero.watchdog.
startup_timeout`` seconds, `initialize` ends this process with one line naming the coordinator
and the process ids that never joined (from their start-up reports, `jzero.runtime.progress`: a process
writes one before it connects), and `barrier` raises `StartupError` naming the processes that did
not arrive. JAX's own initialisation timeout aborts the process without saying who was missing,
so it is set past ours.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jzero.config import ConfigError
from jzero.runtime import progress

ENV = {"coordinator": "JZERO_COORDINATOR", "num_processes": "JZERO_NUM_PROCESSES", "process_id": "JZERO_PROCESS_ID"}
# Variables whose presence means JAX's own cluster detection can initialise (SLURM, Open MPI, TPU).
CLUSTER_HINTS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


@dataclass(frozen=True)
class Settings:
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    auto_detect: bool = False  # leave discovery to JAX's cluster detection

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1 or self.auto_detect


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, environ: dict[str, str] | None = None) -> Settings:
    """The run's settings from arguments, then JZERO_* variables, then cluster hints; validated
    with one-line errors that name the flag and its variable."""
    env = os.environ if environ is None else environ
    coordinator = coordinator or env.get(ENV["coordinator"]) or None
    num = num_processes if num_processes is not None else _int(env, "num_processes", "--num-processes")
    pid = process_id if process_id is not None else _int(env, "process_id", "--process-id")
    if coordinator is None and num is None and pid is None:
        single = env.get("SLURM_NTASKS", "1") == "1" and env.get("OMPI_COMM_WORLD_SIZE", "1") == "1"
        return Settings(auto_detect=any(h in env for h in CLUSTER_HINTS) and not single)
    if num is None or num < 1:
        raise ConfigError(f"--num-processes ({ENV['num_processes']}): must be >= 1, got {num}")
    pid = 0 if pid is None else pid
    if not 0 <= pid < num:
        raise ConfigError(f"--process-id ({ENV['process_id']}): must be in 0..{num - 1}, got {pid}")
    if num > 1:
        host, sep, port = (coordinator or "").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--coordinator ({ENV['coordinator']}): expected HOST:PORT, e.g. 127.0.0.1:12355, "
                              f"got {coordinator!r}")
    return Settings(coordinator=coordinator, num_processes=num, process_id=pid)


def _int(env, key: str, flag: str) -> int | None:
    text = env.get(ENV[key])
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} ({ENV[key]}): expected an integer, got {text!r}") from None


class StartupError(RuntimeError):
    """A process did not join the run, or did not reach a barrier, within the start-up timeout."""


def initialize(s: Settings, timeout: float = 300.0, reports: Path | None = None) -> None:
    """Start JAX's multi-process runtime for ``s`` (a no-op for one process), giving up after
    ``timeout`` seconds with one line naming the processes that never joined (``reports``: the
    run's progress folder, where this process writes its start-up report first)."""
    if not s.multi_process:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only used by the CPU backend
    if s.auto_detect:
        jax.distributed.initialize()
        return
    started = time.time()
    if reports is not None:
        progress.write(reports, progress.Report(rank=s.process_id, pid=os.getpid(), host=socket.gethostname(),
                                                started=started, since=started, updated=started))
    guard = threading.Timer(timeout, _never_joined, args=(s, timeout, reports, started))
    guard.daemon = True
    guard.start()
    try:
        jax.distributed.initialize(coordinator_address=s.coordinator, num_processes=s.num_processes,
                                   process_id=s.process_id, initialization_timeout=int(timeout) + 60)
    finally:
        guard.cancel()


def _never_joined(s: Settings, timeout: float, reports: Path | None, started: float) -> None:
    """The start-up timer fired: say who is missing, then end the process (the main thread is
    inside JAX's connect, which cannot be interrupted)."""
    seen = progress.read_all(reports, since=started - timeout) if reports is not None else {}
    missing = [i for i in range(s.num_processes) if i not in seen and i != s.process_id]
    host, _, port = s.coordinator.rpartition(":")
    if s.process_id != 0 and not _listening(host, int(port)):
        who = f"process 0 (the coordinator) is not listening at {s.coordinator}"
    elif reports is not None and missing:
        who = (f"process {', '.join(map(str, missing))} never joined the coordinator at {s.coordinator} "
               f"(no start-up report in {reports})")
    else:
        who = f"not every process joined the coordinator at {s.coordinator}"
    print(f"jzero: error: start-up: {who} within {timeout:g} s (jzero.watchdog.startup_timeout); "
          f"process {s.process_id} gives up", file=sys.stderr, flush=True)
    os._exit(progress.EXIT_STALLED)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _client() -> Any:
    """JAX's coordination-service client (None outside a multi-process run); JAX exposes it
    only privately, so this is the one place that reaches for it."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def joined() -> bool:
    """Whether this process has joined a multi-process JAX run (importing no JAX otherwise)."""
    return "jax" in sys.modules and _client() is not None


def is_primary() -> bool:
    """Process 0: the one that prints and writes files."""
    import jax

    return jax.process_index() == 0


def barrier(name: str, timeout: float = 300.0) -> None:
    """Wait until every process reaches ``name`` (no-op for one process); `StartupError` naming
    the processes that did not arrive within ``timeout`` seconds."""
    import jax

    if jax.process_count() == 1:
        return
    try:
        _client().wait_at_barrier(name, int(timeout * 1000))
    except Exception as e:
        found = re.search(r"timed out task names:\s*([\d\s,/a-z:_]*)", str(e))
        names = found.group(1) if found else ""
        ids = re.findall(r"task:(\d+)", names) or re.findall(r"\d+", names)
        who = f"process {', '.join(ids)} did not arrive" if ids else f"not every process arrived ({_first_line(e)})"
        raise StartupError(f"barrier '{name}': {who} within {timeout:g} s (jzero.watchdog.startup_timeout)") from None


def all_gather_json(value: Any) -> list[Any]:
    """``value`` (small, JSON) from every process, in process order; ``[value]`` for one process.
    A collective: every process must call it."""
    import jax

    if jax.process_count() == 1:
        return [value]
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    width = int(np.max(multihost_utils.process_allgather(np.array([data.size], np.int32))))
    padded = np.zeros(width, np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]

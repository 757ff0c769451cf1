"""Multi-process start-up: `jax.distributed.initialize` from flags, JZERO_* variables or the cluster.

Every process of a multi-host run executes the same program on its own devices (JAX's
multi-controller model); ZeRO's collectives then span all processes. Settings, first found wins:

1. explicit arguments (``jzero train --coordinator HOST:PORT --num-processes N --process-id I``);
2. ``JZERO_COORDINATOR``, ``JZERO_NUM_PROCESSES``, ``JZERO_PROCESS_ID`` (what `jzero launch` sets);
3. a cluster JAX detects by itself (SLURM, Open MPI, TPU pods): ``initialize()`` without arguments.

Nothing found (or one process) = a single-process run; nothing is started. On CPU the
collectives between processes go through gloo. Must run before any JAX computation.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jzero.config import ConfigError

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


def initialize(s: Settings) -> None:
    """Start JAX's multi-process runtime for ``s`` (a no-op for one process)."""
    if not s.multi_process:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only used by the CPU backend
    if s.auto_detect:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=s.coordinator, num_processes=s.num_processes,
                                   process_id=s.process_id)


def is_primary() -> bool:
    """Process 0: the one that prints and writes files."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches ``name`` (no-op for one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

"""`jzero launch`: run one command as N processes on this host, like torchrun / the deepspeed launcher.

Each process gets ``JZERO_COORDINATOR=127.0.0.1:PORT``, ``JZERO_NUM_PROCESSES`` and
``JZERO_PROCESS_ID`` (read by `jzero.runtime.distributed`) and, with ``devices_per_proc``, that many
simulated CPU devices. Their output is streamed line by line with a ``[rank i]`` prefix (only
process 0 prints progress: the others are silent by design). SIGINT and SIGTERM are forwarded
to every process. When one process dies, the survivors usually hang in their next collective,
so the launcher stops them (SIGTERM, then SIGKILL after ``GRACE_S``) and exits non-zero naming
the rank and how it ended; the whole run is down well within a minute.

The processes report their progress (`jzero.runtime.progress`) to a folder the launcher gives them
(``JZERO_PROGRESS_DIR``); the exit line of a failed run names the rank(s) furthest behind as the
likely cause. A process that stalls normally ends itself (its watchdog, `jzero.runtime.watchdog`); when
a rank has sat in one phase ``STALL_GRACE_S`` past its watchdog's timeout, or its reports stop,
the launcher stops the run itself.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jzero.runtime import progress
from jzero.runtime.progress import EXIT_STALLED

GRACE_S = 15.0  # after a failure: how long survivors get to exit on SIGTERM before SIGKILL
POLL_S = 0.1
STALL_GRACE_S = 30.0  # past a rank's watchdog timeout (or since its last report): the launcher steps in
# gloo's connection chatter at start-up (one line per device, written from several threads at
# once, so lines arrive in pieces): dropped from the stream
NOISE = re.compile(r"\[Gloo\] Rank|connected peer ranks is|^\s*\d* ?peer ranks\.")
# what is left of a split chatter line (": 7", a bare newline); dropped for ranks other than 0, which
# print nothing of their own but errors
FRAGMENT = re.compile(r"[\s:\d]*")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(rank: int, nproc: int, port: int, devices_per_proc: int | None,
              reports: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, JZERO_COORDINATOR=f"127.0.0.1:{port}", JZERO_NUM_PROCESSES=str(nproc),
               JZERO_PROCESS_ID=str(rank), PYTHONUNBUFFERED="1")
    if reports is not None:
        env[progress.ENV] = str(reports)
    if devices_per_proc:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_proc}"])
    return env


def _stream(rank: int, pipe, sink) -> None:
    for line in iter(pipe.readline, ""):
        if NOISE.search(line) or (rank and FRAGMENT.fullmatch(line)):
            continue
        sink.write(f"[rank {rank}] {line}")
        sink.flush()
    pipe.close()


def describe_exit(code: int) -> str:
    if code == EXIT_STALLED:
        return f"exit code {code} (its watchdog: stalled)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        return f"exit code {code} ({signal.Signals(code - 128).name})"
    return f"exit code {code}"


def run(cmd: Sequence[str], nproc: int, *, devices_per_proc: int | None = None, port: int = 0) -> int:
    """Start ``cmd`` ``nproc`` times and supervise; returns the exit code for the launcher."""
    port = port or free_port()
    reports = Path(tempfile.mkdtemp(prefix="jzero-launch-progress-"))
    procs: list[subprocess.Popen] = []
    threads = []
    for rank in range(nproc):
        proc = subprocess.Popen(list(cmd), env=child_env(rank, nproc, port, devices_per_proc, reports), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        print(f"jzero launch: rank {rank} pid {proc.pid}", file=sys.stderr, flush=True)
        for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_stream, args=(rank, pipe, sink), daemon=True)
            t.start()
            threads.append(t)

    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = _supervise(procs, forwarded, reports)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in threads:
            t.join(timeout=5)
        shutil.rmtree(reports, ignore_errors=True)
    return code


def _supervise(procs: list[subprocess.Popen], forwarded: list[int], reports: Path) -> int:
    started = time.time()
    while True:
        codes = [p.poll() for p in procs]
        # a killed or stalled rank is the cause; the others' collectives then fail with code 1,
        # possibly before the next poll, so the order decides and not who was seen first
        failed = sorted(((r, c) for r, c in enumerate(codes) if c not in (None, 0)),
                        key=lambda rc: (rc[1] > 0 and rc[1] != EXIT_STALLED, rc[0]))
        if all(c is not None for c in codes) and (forwarded or not failed):
            code = failed[0][1] if failed else 0
            return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number
        stuck = [] if failed or forwarded else stalled(progress.read_all(reports, since=started), codes)
        if (failed or stuck) and not forwarded:
            rank, code = failed[0] if failed else (stuck[0].rank, EXIT_STALLED)
            what = (f"rank {rank} {describe_exit(code)}" if failed
                    else f"ranks stopped advancing ({'; '.join(r.describe(time.time()) for r in stuck)})")
            print(f"jzero launch: {what}; stopping the other processes", file=sys.stderr, flush=True)
            # a dead rank is its own cause; a stall's cause is the rank furthest behind
            cause = "" if code != EXIT_STALLED else "; " + progress.likely_cause(
                progress.read_all(reports, since=started), len(procs))
            _stop(procs)
            print(f"jzero launch: run failed: {what}{cause}", file=sys.stderr, flush=True)
            return EXIT_STALLED if code == EXIT_STALLED else 1
        time.sleep(POLL_S)


def stalled(reports: dict[int, progress.Report], codes: list[int | None],
            now: float | None = None) -> list[progress.Report]:
    """Running ranks a watchdog should have ended by now: in one phase ``STALL_GRACE_S`` past
    their timeout, or watched and silent for ``STALL_GRACE_S`` (the watchdog itself is stuck)."""
    now = time.time() if now is None else now
    return [r for rank, r in reports.items() if rank < len(codes) and codes[rank] is None and r.timeout is not None
            and (now - r.since > r.timeout + STALL_GRACE_S or now - r.updated > STALL_GRACE_S)]


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the survivors (and their children), SIGKILL whoever is left after GRACE_S."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

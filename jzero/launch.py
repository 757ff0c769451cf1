"""`jzero launch`: run one command as N processes on this host, like torchrun / the deepspeed launcher.

Each process gets ``JZERO_COORDINATOR=127.0.0.1:PORT``, ``JZERO_NUM_PROCESSES`` and
``JZERO_PROCESS_ID`` (read by `jzero.distributed`) and, with ``devices_per_proc``, that many
simulated CPU devices. Their output is streamed line by line with a ``[rank i]`` prefix (only
process 0 prints progress: the others are silent by design). SIGINT and SIGTERM are forwarded
to every process. When one process dies, the survivors usually hang in their next collective,
so the launcher stops them (SIGTERM, then SIGKILL after ``GRACE_S``) and exits non-zero naming
the rank and how it ended; the whole run is down well within a minute.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

GRACE_S = 15.0  # after a failure: how long survivors get to exit on SIGTERM before SIGKILL
POLL_S = 0.1
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


def child_env(rank: int, nproc: int, port: int, devices_per_proc: int | None) -> dict[str, str]:
    env = dict(os.environ, JZERO_COORDINATOR=f"127.0.0.1:{port}", JZERO_NUM_PROCESSES=str(nproc),
               JZERO_PROCESS_ID=str(rank), PYTHONUNBUFFERED="1")
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
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code > 128 and code - 128 in {s.value for s in signal.Signals}:
        return f"exit code {code} ({signal.Signals(code - 128).name})"
    return f"exit code {code}"


def run(cmd: Sequence[str], nproc: int, *, devices_per_proc: int | None = None, port: int = 0) -> int:
    """Start ``cmd`` ``nproc`` times and supervise; returns the exit code for the launcher."""
    port = port or free_port()
    procs: list[subprocess.Popen] = []
    threads = []
    for rank in range(nproc):
        proc = subprocess.Popen(list(cmd), env=child_env(rank, nproc, port, devices_per_proc), text=True,
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
        code = _supervise(procs, forwarded)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in threads:
            t.join(timeout=5)
    return code


def _supervise(procs: list[subprocess.Popen], forwarded: list[int]) -> int:
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            bad = [(r, c) for r, c in enumerate(codes) if c != 0]
            return bad[0][1] if bad and bad[0][1] > 0 else (128 - bad[0][1] if bad else 0)
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and not forwarded:
            rank, code = failed[0]
            print(f"jzero launch: rank {rank} failed ({describe_exit(code)}); stopping the other processes",
                  file=sys.stderr, flush=True)
            _stop(procs)
            print(f"jzero launch: run failed: rank {rank} {describe_exit(code)}", file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL_S)


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

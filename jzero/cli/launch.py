"""``jzero launch --nproc N -- CMD``: N processes of CMD on this host (see `jzero.runtime.launch`)."""
from __future__ import annotations

import argparse

from jzero.cli.common import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser("launch", help="run a command as N processes on this host (like torchrun)")
    launch.add_argument("--nproc", type=int, required=True, help="processes to start")
    launch.add_argument("--devices-per-proc", type=int, help="simulated CPU devices per process")
    launch.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (default: a free one)")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. -- jzero train CONFIG")
    launch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jzero.runtime import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("launch: give the command after --, e.g. jzero launch --nproc 2 -- jzero train CONFIG")
    if args.nproc < 1:
        raise UsageError(f"--nproc: must be >= 1, got {args.nproc}")
    return launch.run(cmd, args.nproc, devices_per_proc=args.devices_per_proc, port=args.port)

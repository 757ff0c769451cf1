"""``jzero bench NAME [ARGS]``: run a benchmark script of this checkout's ``benchmarks/``."""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from jzero.cli.common import UsageError

BENCHMARKS = {"sweep": "sweep.py", "compile_time": "compile_time.py", "fused_adamw": "fused_adamw.py",
              "overhead": "overhead.py"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help=f"run a benchmark from benchmarks/ ({', '.join(BENCHMARKS)})")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``benchmarks/NAME.py`` of this checkout (benchmarks ship with the repository)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / BENCHMARKS[args.name]
    if not script.is_file():
        raise UsageError(f"bench {args.name}: {script} not found; benchmarks run from a repository checkout")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0

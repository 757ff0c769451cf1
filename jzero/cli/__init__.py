"""CLI: the ``jzero`` command line, one module per command, each with its own sub-parser
(`common` holds what they share). The top layer: may import any layer; nothing below imports it.

``train`` (`jzero.cli.train`), ``launch``, ``estimate``, ``profile``, ``autotune``, ``tune``,
``export``, ``generate``, ``serve`` and ``bench``. On a CPU-only host the devices a run asks for (``--devices`` or
``jzero.mesh.devices``) are simulated: the XLA flag is set before any JAX backend starts. Bad
input ends with one line on stderr and exit code 2, Ctrl-C with one line and exit code 130, a
process missing at start-up with one line and exit code 75 (as a stalled step does), and
every warning is one line, ``jzero: warning: ...`` (library users keep Python's warnings).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import Any

from jzero.analysis.target import quiet_platform
from jzero.cli import autotune, bench, estimate, evaluate, export, generate, launch, profile, serve, train, tune
from jzero.cli.common import UsageError

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
COMMANDS = (train, launch, autotune, tune, profile, export, generate, serve, evaluate, estimate, bench)


def main(argv: list[str] | None = None) -> int:
    quiet_platform()  # before any command starts JAX
    args = parser().parse_args(argv)
    warnings.showwarning = _one_line_warning
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("jzero: interrupted by Ctrl-C; stopped cleanly", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        print(f"jzero: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # ConfigError, CheckpointError, StartupError: one line, no traceback
        from jzero.config import ConfigError
        from jzero.runtime.checkpoint import CheckpointError
        from jzero.runtime.distributed import StartupError, joined
        from jzero.runtime.progress import EXIT_STALLED

        if isinstance(e, StartupError):
            # Straight out: JAX's shutdown barrier at exit would wait for the missing process.
            print(f"jzero: error: start-up: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(EXIT_STALLED)
        if isinstance(e, (ConfigError, CheckpointError)):
            print(f"jzero: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if joined():
            # A collective failed because a peer is gone: JAX's shutdown barrier at exit would
            # wait for it until the heartbeat times out (~80 s), so the traceback, then out.
            traceback.print_exc()
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
        raise


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="jzero", description="DeepSpeed's training engine on JAX/XLA.")
    sub = top.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return top


def _one_line_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                      line: str | None = None) -> None:
    """`warnings.showwarning` for the CLI: one line, no source location or code line."""
    text = " ".join(str(message).split())
    print(f"jzero: warning: {text}", file=sys.stderr if file is None else file)

"""``jzero export CHECKPOINT OUT.safetensors``: a checkpoint's params as one safetensors file."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser("export", help="write a checkpoint's params as one safetensors file")
    exp.add_argument("checkpoint", help="a checkpoint directory (its newest readable step) or one step directory")
    exp.add_argument("out", help="the .safetensors file to write")
    exp.add_argument("--dtype", choices=["fp32", "bf16"], help="cast floating params (default: as saved)")
    exp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jzero.runtime.monitor import mib
    from jzero.runtime.weights import export

    written = export(args.checkpoint, args.out, args.dtype)
    print(f"jzero: wrote {written['tensors']} tensors ({mib(written['bytes'])}) from step {written['step']} "
          f"of {args.checkpoint} to {written['path']}")
    return 0

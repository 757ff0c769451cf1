"""``jzero export CHECKPOINT OUT.safetensors``: a checkpoint's params as one safetensors file;
``jzero export CHECKPOINT --hf OUT``: as a Hugging Face directory, LoRA adapters merged
(`jzero.runtime.hfexport`); ``--peft OUT``: the adapters alone, as PEFT saves them
(`jzero.runtime.peftexport`)."""
from __future__ import annotations

import argparse

from jzero.cli.common import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser("export", help="write a checkpoint's params as a safetensors file or a Hugging Face directory")
    exp.add_argument("checkpoint", help="a checkpoint directory (its newest readable step) or one step directory")
    exp.add_argument("out", nargs="?", help="the .safetensors file to write (not with --hf)")
    exp.add_argument("--hf", metavar="DIR", help="write a Hugging Face directory (config.json, sharded safetensors "
                     "with the index, the tokenizer) of the architecture the checkpoint was trained from")
    exp.add_argument("--peft", metavar="DIR", help="write the LoRA adapters (jzero.lora) as a PEFT adapter folder "
                     "(adapter_config.json, adapter_model.safetensors) for the checkpoint's Hugging Face base model")
    exp.add_argument("--max-shard-size", default="5GB", help="with --hf: the largest shard (default 5GB)")
    exp.add_argument("--dtype", choices=["fp32", "bf16"], help="cast floating params (default: as saved)")
    exp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from jzero.runtime.monitor import mib

    if sum(x is not None for x in (args.out, args.hf, args.peft)) != 1:
        raise UsageError("jzero export: give OUT.safetensors, --hf DIR or --peft DIR (one of them)")
    if args.peft is not None:
        from jzero.runtime.peftexport import export_peft

        written = export_peft(args.checkpoint, args.peft)
        print(f"jzero: wrote {written['tensors']} adapter tensors ({', '.join(written['modules'])}) from step "
              f"{written['step']} of {args.checkpoint} to {written['path']}")
        return 0
    if args.hf is not None:
        from jzero.runtime.hfexport import export_hf, shard_bytes

        try:
            shard_bytes(args.max_shard_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        written = export_hf(args.checkpoint, args.hf, args.dtype, args.max_shard_size)
        print(f"jzero: wrote {written['tensors']} tensors ({mib(written['bytes'])}) in {written['shards']} shard(s) "
              f"from step {written['step']} of {args.checkpoint} to {written['path']}")
        return 0
    from jzero.runtime.weights import export

    written = export(args.checkpoint, args.out, args.dtype)
    print(f"jzero: wrote {written['tensors']} tensors ({mib(written['bytes'])}) from step {written['step']} "
          f"of {args.checkpoint} to {written['path']}")
    return 0

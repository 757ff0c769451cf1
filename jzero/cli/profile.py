"""``jzero profile CONFIG``: matmul FLOPs by model scope, bytes, arithmetic intensity and the top
collectives of the compiled step (with the dtype each moves); ``--trace DIR`` also runs steps
under `jax.profiler`; ``--quantization-error`` measures ZeRO++'s int8 blocks on the model's
initial weights and first gradient."""
from __future__ import annotations

import argparse
import json
from typing import Any

from jzero.cli.common import add_config_arguments, config_on_devices


def add_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="FLOPs by model scope, bytes, intensity and top collectives of a step")
    add_config_arguments(prof)
    prof.add_argument("--trace", metavar="DIR", help="also run a few steps under jax.profiler into DIR (TensorBoard)")
    prof.add_argument("--quantization-error", action="store_true",
                      help="ZeRO++: max and RMS per-block error of int8 weights and gradients (initialises the model)")
    prof.add_argument("--json", action="store_true", help="print JSON instead of tables")
    prof.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raw = config_on_devices(args)
    report = _report(raw, args.config)
    if args.trace:
        report["trace"] = _trace(raw, args.trace)
    if args.quantization_error:
        report["quantization_error"] = _quantization_error(raw)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, args.trace)
    return 0


def _report(raw: dict[str, Any], name: str) -> dict[str, Any]:
    from jzero.analysis import profile
    from jzero.analysis.estimate import compile_step
    from jzero.train.resolve import load_config

    compiled, state, _, model, compile_s = compile_step(load_config(raw))
    devices = state.plan.mesh.size
    batch = state.config.train_batch_size
    scopes = {k: v * devices for k, v in sorted(profile.matmul_flops_by_scope(compiled).items(),
                                                  key=lambda kv: -kv[1])}
    total = sum(scopes.values())
    nbytes = profile.bytes_accessed(compiled)
    collectives = sorted(profile.comm(compiled).collectives, key=lambda c: -c.ring_bytes * c.count)[:5]
    return {
        "config": name, "devices": devices, "tokens_per_step": batch * model.tokens_per_example,
        "compile_s": compile_s, "matmul_flops_by_scope": scopes, "matmul_flops": total,
        "analytic_flops": model.flops(batch), "xla_cost_analysis_flops_per_device": profile.xla_flops(compiled),
        "bytes_accessed_per_device": nbytes, "arithmetic_intensity": total / devices / nbytes,
        "top_collectives": [{"kind": c.kind, "dtype": c.dtype, "widened_to": c.widened_to, "elements": c.elements,
                             "group_size": c.group_size, "per_step": c.count,
                             "ring_bytes_per_step": c.ring_bytes * c.count, "name": c.name} for c in collectives]}


def _print(report: dict[str, Any], trace: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console, scopes, total = Console(), report["matmul_flops_by_scope"], report["matmul_flops"]
    table = Table(title=f"jzero profile: {report['config']}, {report['devices']} devices, "
                        f"{report['tokens_per_step']:,} tokens per step")
    for col in ("scope", "GFLOPs per step", "share"):
        table.add_column(col, justify="left" if col == "scope" else "right")
    for scope, value in scopes.items():
        table.add_row(scope, f"{value / 1e9:,.3f}", f"{value / total:.1%}")
    table.add_row("all matmuls", f"{total / 1e9:,.3f}", "100%")
    analytic = report["analytic_flops"]["total"]
    table.add_row("analytic 6*params*tokens + attention", f"{analytic / 1e9:,.3f}", f"{analytic / total:.1%}")
    console.print(table)
    console.print(f"bytes accessed per device {report['bytes_accessed_per_device'] / 2**20:,.1f} MiB (XLA cost "
                  f"analysis), arithmetic intensity {report['arithmetic_intensity']:.1f} FLOP/byte, "
                  f"compile {report['compile_s']:.1f} s")
    coll = Table(title="top collectives by bytes per step (ring algorithm, per device)")
    for col in ("kind", "dtype", "elements", "group", "per step", "MiB per step"):
        coll.add_column(col, justify="right")
    for c in report["top_collectives"]:
        dtype = f"{c['dtype']} (moved as {c['widened_to']})" if c["widened_to"] else c["dtype"]
        coll.add_row(c["kind"], dtype, f"{c['elements']:,}", str(c["group_size"]), str(c["per_step"]),
                     f"{c['ring_bytes_per_step'] / 2**20:,.3f}")
    console.print(coll)
    if "quantization_error" in report:
        q = report["quantization_error"]
        console.print(f"int8 blocks of {q['block']} (bound 1/254 = 0.0039 of max|block|): " + "; ".join(
            f"{name}: max {v['max_rel']:.4f}, RMS {v['rms_rel']:.4f} over {v['leaves']} leaves"
            for name, v in q.items() if name != "block"))
    if trace:
        console.print(f"trace: {report['trace']} (tensorboard --logdir {trace})")


def _trace(raw: dict[str, Any], directory: str) -> str:
    """Run three steps of the config under `jax.profiler.trace` into ``directory``."""
    import jax

    import jzero
    from jzero import models
    from jzero.train.resolve import load_config

    config = load_config(raw)
    model = models.build(config)
    state = jzero.init(model.init_fn, config, loss_fn=model.loss_fn, rng=0)
    batch = model.example_batch(state.config.train_batch_size)
    state, metrics = jzero.train_step(state, batch)  # compile outside the trace
    jax.block_until_ready(metrics)
    with jax.profiler.trace(directory):
        for _ in range(3):
            state, metrics = jzero.train_step(state, batch)
        jax.block_until_ready(metrics)
    return directory


def _quantization_error(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-block int8 error (relative to each block's max) of the initial weights and of one
    example batch's gradient, over the leaves that split into whole blocks (the others are
    sent unquantized)."""
    import jax
    import numpy as np

    from jzero import models
    from jzero.train.resolve import load_config
    from jzero.zero import quantize

    config = load_config(raw)
    model, block = models.build(config), config.jzero.quantization_block_size
    params = jax.jit(model.init_fn)(jax.random.key(config.seed))
    batch = model.example_batch(config.train_micro_batch_size_per_gpu)
    grads = jax.jit(jax.grad(lambda p: _loss(model.loss_fn(p, batch, jax.random.key(0)))))(params)
    out: dict[str, Any] = {"block": block}
    for name, tree in (("weights", params), ("gradients", grads)):
        stats = [quantize.error_stats(x, block) for x in jax.tree.leaves(tree) if x.size % block == 0]
        out[name] = {"leaves": len(stats), "max_rel": max((float(s["max_rel"]) for s in stats), default=0.0),
                     "rms_rel": float(np.sqrt(np.mean([float(s["rms_rel"]) ** 2 for s in stats]))) if stats else 0.0}
    return out


def _loss(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out

"""The overhead benchmark's compiled-cost mode (``overhead.py --target tpu:v5e:2x2``): jzero's step
against the hand-written ``jit`` + optax step as the TPU compiler builds them, nothing run.

For each model (jzero's scanned GPT, a plain-JAX GPT, a Flax Linen GPT: `user_models`), dtype,
clipping and ZeRO stage: FLOPs and bytes accessed (XLA's cost analysis of the TPU executable),
peak memory per device (its memory analysis) and the bytes each device sends in collectives
(ring accounting of the scheduled program's collectives), each as a ratio to the hand-written
step of the same group. XLA's cost analysis counts a while-loop body once, so the scanned GPT's
figures hold one layer; the plain and Linen models unroll theirs and count all.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

HAND = "hand-written"
QUANTITIES = ("flops", "bytes", "peak", "comm")


def _cost(compiled: Any) -> dict[str, float]:
    from jzero.analysis import profile

    mem = compiled.memory_analysis()
    return {"flops": profile.xla_flops(compiled), "bytes": profile.bytes_accessed(compiled),
            "peak": float(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                          - mem.alias_size_in_bytes),
            "comm": profile.comm(compiled).total_ring_bytes()}


def _hand(init_fn, loss_fn, devices, dtype: str, clip: float, batch: int, seq: int, lr: float, wd: float) -> Any:
    """The hand-written step (`overhead.hand_step`) compiled for ``devices``: replicated params,
    the batch split over them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from overhead import hand_step

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    tx = optax.adamw(lr, weight_decay=wd)
    params = jax.eval_shape(init_fn, jax.random.key(0))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                         (params, jax.eval_shape(tx.init, params)))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    step = hand_step(loss_fn, tx, dtype, norm=True, clip=clip)
    return jax.jit(step, donate_argnums=(0,)).lower(state, {"inputs": tokens, "targets": tokens}).compile()


def _jzero(init_fn, loss_fn, devices, dtype: str, clip: float, stage: int, batch: int, seq: int, lr: float,
           wd: float) -> Any:
    import jax
    import jax.numpy as jnp

    import jzero

    # bf16: gradients reduced in bf16, as the hand-written step's GSPMD all-reduce of its bf16
    # gradients is (jzero's default reduces them in fp32: twice the wire, more exact)
    same_math = {"communication_data_type": "bf16"} if dtype == "bf16" else {}
    cfg = jzero.load_config({
        "train_batch_size": batch, "gradient_clipping": clip, "bf16": {"enabled": dtype == "bf16"}, **same_math,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}}}, dp_size=len(devices))
    state = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, mesh=jzero.make_mesh(cfg, devices=devices))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=state.plan.batch)
    return jzero.train_step.lower(state, {"inputs": tokens, "targets": tokens}).compile()


def measure(target: str, models: list[str], sizes: dict[str, dict], size: str, dtypes: list[str],
            clips: list[float], stages: list[int], batch: int, seq: int, lr: float, wd: float, on_row) -> list[dict]:
    """A row per (model, dtype, clip, variant): the costs and their ratios to the hand-written step."""
    import jax
    import user_models

    from jzero.analysis import target as targets

    devices = targets.devices(target)
    rows: list[dict] = []
    for model in models:
        init_fn, loss_fn = user_models.make(model, vocab_size=256, seq_len=seq, **sizes[size])
        for dtype in dtypes:
            for clip in clips:
                group = {"target": target, "model": model, "size": size, "dtype": dtype, "clip": clip,
                         "devices": len(devices)}
                base = _cost(_hand(init_fn, loss_fn, devices, dtype, clip, batch, seq, lr, wd))
                rows.append({**group, "variant": HAND, **base})
                for stage in stages:
                    try:
                        cost = _cost(_jzero(init_fn, loss_fn, devices, dtype, clip, stage, batch, seq, lr, wd))
                    except Exception as e:  # one failing row must not end the table
                        rows.append({**group, "variant": f"stage {stage}", "error": f"{type(e).__name__}: {e}"[:300]})
                        continue
                    ratios = {f"{q}_ratio": cost[q] / base[q] if base[q] else None for q in QUANTITIES}
                    rows.append({**group, "variant": f"stage {stage}", **cost, **ratios})
                jax.clear_caches()
                on_row(rows)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| model | dtype | clip | variant | GFLOPs | GB accessed | peak MiB | comm MB | FLOPs x | bytes x | "
            "peak x | comm x |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        where = f"| {r['model']} {r['size']} | {r['dtype']} | {r['clip']:g} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{where} failed: {r['error'][:80]} | | | | | | | |")
            continue
        ratios = " | ".join("" if r.get(f"{q}_ratio") is None else f"{r[f'{q}_ratio']:.3f}" for q in QUANTITIES)
        lines.append(f"{where} {r['flops'] / 1e9:.2f} | {r['bytes'] / 1e9:.3f} | {r['peak'] / 2**20:.1f} | "
                     f"{r['comm'] / 1e6:.2f} | {ratios if r['variant'] != HAND else ' | | | '} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and r["variant"] != HAND]
    series = sorted({(r["model"], r["dtype"], r["clip"]) for r in ok})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(series), 1)
    for i, key in enumerate(series):
        sel = [r for r in ok if (r["model"], r["dtype"], r["clip"]) == key]
        ax.bar([int(r["variant"].split()[-1]) + i * width for r in sel], [r["bytes_ratio"] for r in sel], width,
               label=f"{key[0]} {key[1]} clip {key[2]:g}")
    ax.axhline(1.0, color="black", lw=1)
    ax.axhline(1.03, color="red", lw=0.8, ls="--")
    ax.set_xticks([s + 0.4 - width / 2 for s in range(4)], [f"ZeRO-{s}" for s in range(4)])
    ax.set_ylabel("bytes accessed / hand-written")
    ax.set_title(f"jzero step vs hand-written, TPU-compiled ({rows[0]['target']}, {rows[0]['devices']} devices)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


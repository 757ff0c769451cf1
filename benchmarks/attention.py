"""Attention that scales: `jzero.attention`'s naive and blockwise implementations and each
DeepSpeed sparse layout (blockwise), causal, forward + backward (the gradients of q, k, v: what a
training step runs per layer), for T = 256 ... 8192 on one CPU device (1 sequence, 4 heads of 64).

Per row: the compiled program's temporaries (``memory_analysis()``), its matmul FLOPs (loop trip
counts included), and the median time of interleaved repetitions. The naive -> blockwise
crossover on this machine is where ``jzero.model.attention.blockwise_from`` comes from.
Prints a table; writes ``benchmarks/results/attention.{json,md,png}``.

    python benchmarks/attention.py            # about ten minutes on 2 CPU cores
    python benchmarks/attention.py --fast     # T up to 2048, 2 reps
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jzero.analysis import profile
from jzero.config import SparseAttentionConfig
from jzero.models.attention import attention, layouts

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, HEAD_DIM = 4, 64
SPARSE = {  # DeepSpeed's modes with their ds_config defaults, unidirectional where the mode has it
    "fixed": SparseAttentionConfig(mode="fixed", attention="unidirectional"),
    "variable": SparseAttentionConfig(mode="variable", num_random_blocks=1, attention="unidirectional"),
    "bigbird": SparseAttentionConfig(mode="bigbird", num_random_blocks=1, attention="unidirectional"),
    "bslongformer": SparseAttentionConfig(mode="bslongformer", attention="unidirectional"),
}


def variants(t: int, naive_up_to: int) -> dict[str, dict]:
    """name -> attention keyword arguments at length ``t``."""
    out = {"naive": {"implementation": "naive"}} if t <= naive_up_to else {}
    out["blockwise"] = {"implementation": "blockwise"}
    for mode, section in SPARSE.items():
        if t // section.block >= 8:
            out[f"sparse {mode}"] = {"implementation": "blockwise",
                                     "layout": layouts.make_layout(section, HEADS, t)}
    return out


def compiled_step(t: int, kwargs: dict):
    q = jax.ShapeDtypeStruct((1, t, HEADS, HEAD_DIM), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True, **kwargs))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()


def measure(lengths: list[int], reps: int, naive_up_to: int) -> list[dict]:
    rows = []
    for t in lengths:
        keys = jax.random.split(jax.random.key(t), 3)
        args = [jax.random.normal(k, (1, t, HEADS, HEAD_DIM), jnp.float32) for k in keys]
        steps = {name: compiled_step(t, kw) for name, kw in variants(t, naive_up_to).items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(reps):  # interleaved: each rep times every variant once
            for name, step in steps.items():
                jax.block_until_ready(step(*args))
                start = time.perf_counter()
                jax.block_until_ready(step(*args))
                times[name].append(time.perf_counter() - start)
        for name, step in steps.items():
            layout = variants(t, naive_up_to)[name].get("layout")
            rows.append({"T": t, "variant": name, "temp_mib": profile.memory(step).temp / 2**20,
                         "gflops": profile.flops(step) / 1e9, "ms": 1e3 * statistics.median(times[name]),
                         "density": None if layout is None else layouts.density(layout)})
            print(f"T={t:5d} {name:20s} temp {rows[-1]['temp_mib']:9.1f} MiB  {rows[-1]['gflops']:8.2f} GFLOP  "
                  f"{rows[-1]['ms']:9.1f} ms", flush=True)
    return rows


def crossover(rows: list[dict]) -> int | None:
    """The shortest T from which blockwise is at least as fast as naive at every measured length."""
    by = {(r["T"], r["variant"]): r["ms"] for r in rows}
    lengths = sorted({t for t, v in by if v == "naive"})
    faster = [t for t in lengths if by[t, "blockwise"] <= by[t, "naive"]]
    return next((t for t in faster if all(u in faster for u in lengths if u >= t)), None)


def write(rows: list[dict], suffix: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    cross = crossover(rows)
    (RESULTS / f"attention{suffix}.json").write_text(json.dumps({"rows": rows, "crossover_T": cross}, indent=1))
    lines = ["| T | variant | density | temporaries (MiB) | matmul GFLOP | ms (median) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['variant']} | {_density(r)} | {r['temp_mib']:.1f} | {r['gflops']:.2f} | "
              f"{r['ms']:.1f} |" for r in rows]
    lines.append(f"\nblockwise at least as fast as naive from T = {cross} on this machine")
    (RESULTS / f"attention{suffix}.md").write_text("\n".join(lines) + "\n")
    _plot(rows, RESULTS / f"attention{suffix}.png")
    print("\n".join(lines))


def _density(row: dict) -> str:
    return "1 (causal)" if row["density"] is None else f"{row['density']:.3f}"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        for ax, key in zip(axes, ("temp_mib", "ms"), strict=True):
            ax.plot([r["T"] for r in mine], [r[key] for r in mine], marker="o", label=name)
    for ax, label in zip(axes, ("temporaries (MiB)", "fwd + bwd time (ms)"), strict=True):
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel=label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"causal attention, 1 x {HEADS} heads x {HEAD_DIM}, one CPU device")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="T up to 2048, 2 reps")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    lengths = [256, 512, 1024, 2048] if args.fast else [256, 512, 1024, 2048, 4096, 8192]
    rows = measure(lengths, args.reps or (2 if args.fast else 3), naive_up_to=8192)
    write(rows, "_fast" if args.fast else "")


if __name__ == "__main__":
    main()

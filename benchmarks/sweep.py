"""ZeRO sweep: stages x model sizes x device counts on simulated CPU devices.

For every point: per-device memory and communication read from the compiled step
(`jzero.analysis.profile`), and the step time as a ratio to a hand-written `jit` + optax data-parallel
step of the same model on the same devices, measured in the same run. Writes
`benchmarks/results/sweep.{json,md,png}`.

    python benchmarks/sweep.py            # or: jzero bench sweep
On CPU the times are ratios only (simulated devices share the host's cores); absolute times
mean something only on real accelerators.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jzero  # noqa: E402
from jzero.analysis import profile  # noqa: E402
from jzero.models import gpt  # noqa: E402
from jzero.zero.mesh import DATA_AXES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {
    "2L-d128": gpt.GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=512),
    "4L-d256": gpt.GPTConfig(vocab_size=256, seq_len=64, d_model=256, n_layers=4, n_heads=4, d_ff=1024),
}
BATCH, LR, STEPS = 16, 1e-3, 5


def batch_for(model: gpt.GPTConfig, mesh) -> dict:
    rng = np.random.default_rng(0)
    tok = rng.integers(0, model.vocab_size, (BATCH, model.seq_len + 1)).astype(np.int32)
    sharding = NamedSharding(mesh, P(DATA_AXES))
    return {"inputs": jax.device_put(tok[:, :-1], sharding), "targets": jax.device_put(tok[:, 1:], sharding)}


def timed(step, state, batch) -> tuple[float, object]:
    """Median seconds per step after one warm-up call."""
    state, out = step(state, batch)
    jax.block_until_ready(out)
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), state


def baseline_time(model: gpt.GPTConfig, devices) -> float:
    """The hand-written loop: replicated params, sharded batch, jit + optax.adamw."""
    init_fn, loss_fn = gpt.make(model)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, -1), DATA_AXES)
    params = jax.device_put(jax.jit(init_fn)(jax.random.key(0)), NamedSharding(mesh, P()))
    tx = optax.adamw(LR)
    opt_state = tx.init(params)

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    seconds, _ = timed(step, (params, opt_state), batch_for(model, mesh))
    return seconds


def jzero_point(model: gpt.GPTConfig, devices, stage: int) -> dict:
    init_fn, loss_fn = gpt.make(model)
    cfg = jzero.load_config({"train_batch_size": BATCH, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}}}, dp_size=len(devices))
    mesh = jzero.make_mesh(cfg, devices=devices)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0, mesh=mesh)
    batch = batch_for(model, mesh)
    compiled = jzero.train_step.lower(state, batch).compile()
    mem, comm = profile.memory(compiled), profile.comm(compiled)
    seconds, _ = timed(compiled, state, batch)
    n = len(devices)
    analytic = profile.analytic(mem.num_params, stage, mesh.shape["fsdp"])
    return {"stage": stage, "devices": n, "num_params": mem.num_params,
            "persistent_bytes_per_param": mem.per_param(mem.persistent),
            "analytic_bytes_per_param": analytic.jzero_bytes / mem.num_params,
            "peak_mib": mem.peak / 2**20, "temp_mib": mem.temp / 2**20,
            "comm_elements_per_param": comm.total_elements() / mem.num_params,
            "analytic_comm_per_param": analytic.comm_elements / mem.num_params,
            "step_s": seconds}


def run(sizes: list[str], device_counts: list[int]) -> list[dict]:
    rows = []
    for name in sizes:
        for n in device_counts:
            devices = jax.devices()[:n]
            base = baseline_time(SIZES[name], devices)
            for stage in range(4):
                row = {"model": name, **jzero_point(SIZES[name], devices, stage), "baseline_step_s": base}
                row["step_time_ratio"] = row["step_s"] / base
                rows.append(row)
                print(f"{name:8s} {n} dev ZeRO-{stage}: {row['persistent_bytes_per_param']:6.3f} B/param "
                      f"(formula {row['analytic_bytes_per_param']:.3f}), "
                      f"comm {row['comm_elements_per_param']:.2f} Psi, "
                      f"step x{row['step_time_ratio']:.2f} vs jit+optax", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| model | devices | stage | B/param (measured) | B/param (formula) | peak MiB | comm (xPsi) "
            "| ZeRO paper (xPsi) | step time / jit+optax |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['model']} | {r['devices']} | {r['stage']} | {r['persistent_bytes_per_param']:.3f} | "
        f"{r['analytic_bytes_per_param']:.3f} | {r['peak_mib']:.2f} | {r['comm_elements_per_param']:.2f} | "
        f"{r['analytic_comm_per_param']:.0f} | {r['step_time_ratio']:.2f} |\n" for r in rows)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["devices"]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(groups)
    for i, (model, n) in enumerate(groups):
        sel = [r for r in rows if r["model"] == model and r["devices"] == n]
        x = np.arange(4) + i * width
        ax.bar(x, [r["persistent_bytes_per_param"] for r in sel], width, label=f"{model}, {n} devices")
        ax.scatter(x, [r["analytic_bytes_per_param"] for r in sel], color="black", marker="_", s=200, zorder=3)
    ax.set_xticks(np.arange(4) + 0.4 - width / 2, [f"ZeRO-{s}" for s in range(4)])
    ax.set_ylabel("persistent bytes / param / device")
    ax.set_title("Measured per-device model state (bars) vs formula (black marks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--devices", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = run(args.sizes, args.devices)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps({"backend": jax.default_backend(), "rows": rows}, indent=2))
    table = markdown(rows)
    (args.out / "sweep.md").write_text(table)
    plot(rows, args.out / "sweep.png")
    print(table)
    print(f"wrote {args.out / 'sweep.json'}, sweep.md, sweep.png")


if __name__ == "__main__":
    main()

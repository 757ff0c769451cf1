"""Fused AdamW step vs optax.adamw vs jzero's XLA step: time, achieved bandwidth, copy roofline.

An AdamW step with fp32 master weights, m, v and grads must move 28 bytes/param (read grad, p,
m, v; write p, m, v). For each size the script times, in one run on one device:

- ``copy``: a device-to-device copy of the params (reads and writes 8 B/param): the roofline;
- ``optax``: ``optax.adamw`` under ``jax.jit`` with the grads unscaled and clipped first, donated;
- ``xla``: jzero's step arithmetic (`pallas_kernels.adamw.step_math`) under XLA, donated;
- ``pallas``: the fused Pallas kernel through `jzero.zero.fused` (Mosaic GPU on Hopper, Triton on
  older GPUs, Mosaic TPU), in place, and on Mosaic GPU a sweep of block rows x pipeline depth.

GB/s = 28 B/param / time; "of copy" = that over the copy's measured GB/s. Before timing, the
kernel is checked against optax (m, v max abs diff, params max rel diff to the leaf scale).
On CPU the sizes shrink and the kernel is only checked in interpret mode (it copies whole
buffers per block there, so timing it means nothing). Writes ``fused_adamw.{json,md}``.

    python benchmarks/fused_adamw.py [--out DIR]      # or: jzero bench fused_adamw
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jzero.zero import fused, optim  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BYTES_PER_PARAM = 28
ACCELERATOR_SIZES = {"64M": 64 << 20, "256M": 256 << 20, "1B": 1 << 30}
CPU_SIZES = {"1M": 1 << 20, "4M": 4 << 20, "16M": 16 << 20}
LR, B1, B2, EPS, WD, DIVISOR = 1e-3, 0.9, 0.95, 1e-8, 0.1, 3.0
REPEATS = 20


def single(n: int) -> dict:
    return {"w": (n // 128, 128)}


def odd_tree(total: int) -> dict:
    """148 leaves of GPT-like, mostly odd shapes (not all multiples of 128) adding up to ~total."""
    shapes, unit = {}, total // 148
    for i in range(148):
        cols = 1000 + 7 * i if i % 3 else 1024
        shapes[f"leaf{i:03d}"] = (max(unit // cols, 1), cols)
    return shapes


def make(shapes: dict, seed: int = 0) -> tuple[dict, dict]:
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(shapes)))
    params = {k: jax.random.normal(next(keys), s) for k, s in shapes.items()}
    grads = {k: jax.random.normal(next(keys), s) * DIVISOR for k, s in shapes.items()}
    return params, grads


def timed(fn, *args) -> tuple[float, tuple]:
    """Median seconds of ``fn(*args) -> args`` (state threaded through, donated) after warm-up."""
    args = fn(*args)
    jax.block_until_ready(args)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        args = fn(*args)
        jax.block_until_ready(args)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), args


def copy_time(params: dict) -> float:
    step = jax.jit(lambda p: jax.tree.map(lambda x: -x, p), donate_argnums=0)
    seconds, _ = timed(lambda p: (step(p),), params)
    return seconds


def optax_time(params: dict, grads: dict) -> float:
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        grads = jax.tree.map(lambda g: g / DIVISOR, grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, grads

    seconds, _ = timed(lambda p, s, g: step(p, s, g), params, tx.init(params), grads)
    return seconds


def fused_step(backend: str, **tuning):
    """The injected `jzero.zero.fused` transformation and a donated jitted in-place step of it."""
    tx = optax.inject_hyperparams(fused.fused_adamw, static_args=("backend", "kernel_options"))(
        learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, backend=backend, kernel_options=tuning)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        new, state = fused.apply(tx, grads, state, params, grad_divisor=jnp.float32(DIVISOR),
                                 skip=jnp.bool_(False), layout=None)
        return new, state, grads

    return tx, step


def fused_time(params: dict, grads: dict, backend: str, **tuning) -> float:
    tx, step = fused_step(backend, **tuning)
    seconds, _ = timed(lambda p, s, g: step(p, s, g), params, tx.init(params), grads)
    return seconds


def check(backend: str, shapes: dict) -> dict:
    """One step of the fused path vs optax.adamw: moments' and params' largest differences."""
    params, grads = make(shapes, seed=1)
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    state = ref.init(params)
    updates, want_state = jax.jit(ref.update)(jax.tree.map(lambda g: g / DIVISOR, grads), state, params)
    want = optax.apply_updates(params, updates)
    tx, step = fused_step(backend)
    got, got_state, _ = step(jax.tree.map(jnp.copy, params), tx.init(params), grads)
    diff = {"m_max_abs": 0.0, "v_max_abs": 0.0, "p_max_rel_to_scale": 0.0}
    for name in params:
        diff["m_max_abs"] = max(diff["m_max_abs"], float(jnp.max(jnp.abs(
            got_state.inner_state[0].mu[name] - want_state.inner_state[0].mu[name]))))
        diff["v_max_abs"] = max(diff["v_max_abs"], float(jnp.max(jnp.abs(
            got_state.inner_state[0].nu[name] - want_state.inner_state[0].nu[name]))))
        diff["p_max_rel_to_scale"] = max(diff["p_max_rel_to_scale"], float(
            jnp.max(jnp.abs(got[name] - want[name])) / jnp.max(jnp.abs(want[name]))))
    return diff


def accelerator_backend() -> str | None:
    platform = jax.default_backend()
    return None if platform == "cpu" else optim.pallas_backend(platform)


def _attempt(fn, *args, **kwargs):
    """``fn(...)``, or ``{"error": ...}`` when it raises: one failing backend (a lowering the
    installed jax does not have, a shape over shared memory) must not lose the other numbers."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        print(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def run(sizes: dict[str, int], save=lambda report: None) -> dict:
    """Every case; ``save(report)`` after each row, so a run cut short keeps what it measured."""
    backend = accelerator_backend()
    device = jax.devices()[0]
    report = {"device": f"{device.platform} {getattr(device, 'device_kind', '')}".strip(), "jax": jax.__version__,
              "backend": backend or "interpret (CPU: checked, not timed)", "rows": [], "checks": {}, "tuning": []}
    report["checks"]["interpret"] = check("interpret", {"a": (64, 128), "b": (7, 13)})
    if backend:  # the first backend whose kernel runs and checks out; none: time the XLA paths only
        for option in [backend, "triton"] if backend == "mosaic_gpu" else [backend]:
            report["checks"][option] = _attempt(check, option, {"a": (4096, 128), "b": (7, 13)})
            if "error" not in report["checks"][option]:
                backend = report["backend"] = option
                break
        else:
            backend = None
    cases = [(name, single(n)) for name, n in sizes.items()]
    cases.append((f"148 leaves (~{list(sizes)[0]})", odd_tree(list(sizes.values())[0])))
    for name, shapes in cases:
        params, grads = make(shapes)
        n = sum(int(np.prod(s)) for s in shapes.values())
        row = {"case": name, "params": n, "copy_ms": 1e3 * copy_time(jax.tree.map(jnp.copy, params))}
        copy_gbs = 8 * n / row["copy_ms"] / 1e6
        row["copy_gbs"] = copy_gbs
        methods = {"optax": optax_time, "xla": functools.partial(fused_time, backend="xla")}
        if backend:
            methods["pallas"] = functools.partial(fused_time, backend=backend)
        for method, time_it in methods.items():
            seconds = _attempt(time_it, jax.tree.map(jnp.copy, params), grads)
            if isinstance(seconds, dict):
                row[method] = seconds
                continue
            gbs = BYTES_PER_PARAM * n / (1e3 * seconds) / 1e6
            row[method] = {"ms": 1e3 * seconds, "gbs": gbs, "of_copy": gbs / copy_gbs}
        if backend and "ms" in row["pallas"] and "ms" in row["optax"]:
            row["pallas_vs_optax"] = row["optax"]["ms"] / row["pallas"]["ms"]
        report["rows"].append(row)
        print(_row_line(row), flush=True)
        save(report)
        del params, grads
    if backend == "mosaic_gpu":
        params, grads = make(single(list(sizes.values())[1]))
        for block_rows in (8, 16, 32, 64):
            for steps in (1, 2, 3):
                try:
                    ms = 1e3 * fused_time(jax.tree.map(jnp.copy, params), grads, backend, block_rows=block_rows,
                                          steps_in_flight=steps)
                    report["tuning"].append({"block_rows": block_rows, "steps_in_flight": steps, "ms": ms,
                                             "gbs": BYTES_PER_PARAM * params["w"].size / ms / 1e6})
                except Exception as e:  # a shape that does not fit shared memory: recorded, skipped
                    report["tuning"].append({"block_rows": block_rows, "steps_in_flight": steps,
                                             "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return report


def _row_line(row: dict) -> str:
    parts = [f"{row['case']:>22} copy {row['copy_gbs']:7.1f} GB/s"]
    for method in ("optax", "xla", "pallas"):
        if method in row and "ms" in row[method]:
            r = row[method]
            parts.append(f"{method} {r['ms']:8.2f} ms {r['gbs']:7.1f} GB/s ({r['of_copy']:.0%} of copy)")
    return " | ".join(parts)


def markdown(report: dict) -> str:
    methods = [m for m in ("optax", "xla", "pallas") if m in report["rows"][0]]
    head = "| case | params | copy GB/s | " + " | ".join(f"{m} ms | {m} GB/s (of copy)" for m in methods)
    head += " | pallas vs optax |" if "pallas" in methods else " |"
    lines = [f"Device: {report['device']}, jax {report['jax']}, kernel backend: {report['backend']}. "
             f"GB/s counts the {BYTES_PER_PARAM} B/param an fp32 AdamW step must move.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for row in report["rows"]:
        cells = [row["case"], f"{row['params'] / 1e6:.1f}M", f"{row['copy_gbs']:.0f}"]
        for m in methods:
            r = row[m]
            cells += [f"{r['ms']:.2f}", f"{r['gbs']:.0f} ({r['of_copy']:.0%})"] if "ms" in r else ["failed", "-"]
        if "pallas" in methods:
            cells.append(f"{row['pallas_vs_optax']:.2f}x" if "pallas_vs_optax" in row else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Kernel checks against optax.adamw (one step): " + json.dumps(report["checks"])]
    if report["tuning"]:
        lines += ["", "Mosaic GPU tuning (second size):", "",
                  "| block rows | steps in flight | ms | GB/s |", "|---|---|---|---|"]
        lines += [f"| {t['block_rows']} | {t['steps_in_flight']} | " +
                  (f"{t['ms']:.2f} | {t['gbs']:.0f} |" if "ms" in t else f"failed | {t['error'][:60]} |")
                  for t in report["tuning"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for fused_adamw.{json,md}")
    args = parser.parse_args(argv)
    sizes = CPU_SIZES if jax.default_backend() == "cpu" else ACCELERATOR_SIZES
    args.out.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> None:
        (args.out / "fused_adamw.json").write_text(json.dumps(report, indent=2))
        (args.out / "fused_adamw.md").write_text(markdown(report))

    report = run(sizes, save)
    save(report)
    print(markdown(report))


if __name__ == "__main__":
    main()

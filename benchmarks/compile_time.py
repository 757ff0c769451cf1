"""Compile time vs depth: with scan_layers the step is traced once per block, so compiling a
32-layer GPT should cost about what a 4-layer one does (target: <= 1.3x). ZeRO-3, 8 simulated
devices; writes `benchmarks/results/compile_time.json`.

    python benchmarks/compile_time.py
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jzero  # noqa: E402
from jzero.models import gpt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def compile_seconds(layers: int, stage: int = 3) -> float:
    """Seconds to trace, lower and compile the train step (abstract shapes, nothing allocated)."""
    model = gpt.GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=layers, n_heads=4, d_ff=512)
    init_fn, loss_fn = gpt.make(model)
    cfg = jzero.load_config({"train_batch_size": 16, "zero_optimization": {"stage": stage}})
    t = time.perf_counter()
    state = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn)
    batch = {k: jax.ShapeDtypeStruct((16, model.seq_len), jnp.int32, sharding=state.plan.batch)
             for k in ("inputs", "targets")}
    jzero.train_step.lower(state, batch).compile()
    return time.perf_counter() - t


def main() -> None:
    compile_seconds(2)  # warm the tracing caches of jax/flax once, outside the measurement
    rows = []
    for layers in (4, 32):
        best = min(compile_seconds(layers) for _ in range(2))
        rows.append({"layers": layers, "compile_s": best})
        print(f"{layers:3d} layers: {best:.2f} s", flush=True)
    ratio = rows[1]["compile_s"] / rows[0]["compile_s"]
    print(f"32 layers / 4 layers = {ratio:.2f}x (target <= 1.3x)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_time.json").write_text(json.dumps({"rows": rows, "ratio_32_over_4": ratio}, indent=2))


if __name__ == "__main__":
    main()

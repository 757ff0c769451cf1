"""ZeRO++ on the small GPT at ZeRO-3 (8 simulated CPU devices, bf16): the wire bytes of the
compiled step with qwZ + qgZ against the unquantized step, the quantization error by block
size (on the model's initial weights and its first gradient), and `jzero train
configs/gpt_small_zero3.json` for 300 steps with and without quantization (held-out loss).
Prints tables; writes ``benchmarks/results/zeropp.{json,md}``.

    python benchmarks/zeropp.py                # about fifteen minutes on 2 CPU cores
    python benchmarks/zeropp.py --reuse-runs   # the wire and error tables only (the last runs kept)
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "configs" / "gpt_small_zero3.json"
QUANTIZED = ["--set", "zero_optimization.zero_quantized_weights=true",
             "--set", "zero_optimization.zero_quantized_gradients=true"]
BLOCKS = (256, 512, 1024, 2048, 4096, 8192)


def wire() -> dict:
    """Per-device wire bytes per step from the compiled step, ZeRO accounting, by quantization."""
    from jzero.analysis import profile
    from jzero.analysis.estimate import compile_step
    from jzero.train.resolve import load_config

    raw = json.loads(CONFIG.read_text())
    out = {}
    for name, flags in (("unquantized", {}), ("qwZ + qgZ", {"zero_quantized_weights": True,
                                                            "zero_quantized_gradients": True})):
        cfg = load_config({**raw, "zero_optimization": {**raw["zero_optimization"], **flags}})
        comm = profile.comm(compile_step(cfg).compiled)
        out[name] = {"wire_bytes": comm.total_wire_bytes(), "by_dtype": {
            f"{k} {d}": v for (k, d), v in sorted(comm.wire_bytes_by_kind_dtype().items())}}
    return out


def errors() -> list[dict]:
    """Relative L2 error ||x - q(x)|| / ||x|| by block size, over the same leaves for every size
    (those that split into blocks of the largest), and the scales' share of the wire."""
    import jax
    import numpy as np

    from jzero import models
    from jzero.train.resolve import load_config
    from jzero.zero import quantize

    model = models.build(load_config(CONFIG, dp_size=8))
    params = jax.jit(model.init_fn)(jax.random.key(0))
    batch = model.example_batch(8)
    grads = jax.jit(jax.grad(lambda p: model.loss_fn(p, batch, jax.random.key(0))))(params)
    rows = []
    for block in BLOCKS:
        row = {"block": block, "scale_overhead": 4 / block}
        for name, tree in (("weights", params), ("gradients", grads)):
            num = den = 0.0
            for x in jax.tree.leaves(tree):
                if x.size % max(BLOCKS) == 0:
                    back = quantize.dequantize(quantize.quantize(x, block), x.shape, np.float32)
                    num += float(np.sum((np.asarray(back) - np.asarray(x)) ** 2))
                    den += float(np.sum(np.asarray(x) ** 2))
            row[f"{name}_rel_l2"] = (num / den) ** 0.5
        rows.append(row)
    return rows


def train(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "jzero.cli", "train", str(CONFIG), "--out", out, "--no-resume",
                               "--steps", "300", *extra], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1])
        evals = [float(r["eval_loss"]) for r in csv.DictReader(open(Path(out) / "metrics.csv")) if r["eval_loss"]]
    return {"first_eval_loss": evals[0], "eval_loss": evals[-1]}


def main() -> int:
    w, e = wire(), errors()
    if "--reuse-runs" in sys.argv:  # re-table the wire and errors, keeping the last training runs
        runs = json.loads((RESULTS / "zeropp.json").read_text())["runs"]
    else:
        runs = {"unquantized": train([]), "qwZ + qgZ": train(QUANTIZED)}
    base = w["unquantized"]["wire_bytes"]
    lines = ["| run | wire MiB per step per device | vs unquantized | held-out loss after 300 steps |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {w[name]['wire_bytes'] / 2**20:.2f} | {w[name]['wire_bytes'] / base:.3f} | "
              f"{runs[name]['first_eval_loss']:.3f} -> {runs[name]['eval_loss']:.4f} |" for name in runs]
    drift = runs["qwZ + qgZ"]["eval_loss"] / runs["unquantized"]["eval_loss"] - 1
    lines += ["", f"held-out loss, quantized vs unquantized: {drift:+.2%}", "",
              "| block | scales on the wire | weights rel. L2 error | gradients rel. L2 error |", "|---|---|---|---|"]
    lines += [f"| {r['block']} | {r['scale_overhead']:.2%} | {r['weights_rel_l2']:.4f} | {r['gradients_rel_l2']:.4f} |"
              for r in e]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zeropp.json").write_text(json.dumps({"wire": w, "errors": e, "runs": runs, "drift": drift}, indent=2))
    (RESULTS / "zeropp.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

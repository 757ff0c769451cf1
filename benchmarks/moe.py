"""The MoE demo end to end, with and without the load-balancing loss: `jzero train
configs/gpt_moe_tiny.json` (8 experts, top-1, expert parallelism 4 on 4 simulated CPU devices),
once as configured and once with ``moe.aux_loss_coef`` 0. Prints a table of the held-out loss
(first and last evaluation), the expert load (max / mean routes per expert), the dropped
fraction and the wall time; writes ``benchmarks/results/moe.{json,md,png}`` (load over steps).

    python benchmarks/moe.py        # about five minutes on 2 CPU cores
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "configs/gpt_moe_tiny.json"
RUNS = {"aux loss on (0.01)": [], "aux loss off": ["--set", "moe.aux_loss_coef=0.0"]}


def run(name: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jzero.cli", "train", CONFIG, "--out", out, "--no-resume",
                               *extra], capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: {proc.stderr.strip().splitlines()[-1]}")
        rows = list(csv.DictReader(open(Path(out) / "metrics.csv")))
    evals = [r for r in rows if r["eval_loss"]]
    return {"run": name, "steps": int(rows[-1]["step"]), "first_eval_loss": float(evals[0]["eval_loss"]),
            "eval_loss": float(evals[-1]["eval_loss"]), "load": float(rows[-1]["moe_load"]),
            "dropped": float(rows[-1]["moe_dropped"]), "aux_loss": float(rows[-1]["moe_aux_loss"]),
            "seconds": seconds, "curve": [(int(r["step"]), float(r["moe_load"])) for r in rows]}


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in rows:
        ax.plot(*zip(*r["curve"], strict=True), label=r["run"])
    ax.axhline(1.5, color="gray", linestyle=":", label="acceptance (1.5)")
    ax.set(xlabel="step", ylabel="expert load (max / mean)", title=CONFIG)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "moe.png", dpi=120)


def main() -> int:
    rows = [run(name, extra) for name, extra in RUNS.items()]
    lines = ["| run | steps | held-out loss | drop | expert load (max/mean) | dropped routes | aux loss | wall (s) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['steps']} | {r['first_eval_loss']:.3f} -> {r['eval_loss']:.3f} | "
              f"{1 - r['eval_loss'] / r['first_eval_loss']:.0%} | {r['load']:.2f} | {r['dropped']:.1%} | "
              f"{r['aux_loss']:.3f} | {r['seconds']:.0f} |" for r in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "moe.md").write_text(table)
    plot(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

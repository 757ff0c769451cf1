"""Does `jzero tune lr` suggest a good learning rate? For the GPT (`configs/gpt_tiny.json`), the
ViT (`configs/vit_digits.json`) and the plain MLP (`configs/mlp_digits.json`): the range test's
suggestion, then 200-step runs at the suggestion x 1/10, 1/3, 1, 3, 10 (each with the tuned
config's warmup), five seeds each, and their held-out loss.

The band where a 200-step run reaches its best held-out loss is the set of multiples whose loss
cannot be told from the lowest mean: the paired difference to it (same seed) averages less than
two standard errors. One seed's final loss is too noisy to rank nearby lrs (on the MLP a lucky
seed put x10 first by a factor 6, two others put it last), and a flat basin has no single best
lr. The suggestion is good when the band holds x1 or a neighbour (x1/3, x3): an lr within 3x of
the suggestion trains as well as any. Prints a table; writes
``benchmarks/results/lr_sweep.{json,md}`` and the GPT's range test (plot, curve, tuned config)
under ``benchmarks/results/lr_find/``; exits 1 when a suggestion misses.

    python benchmarks/lr_sweep.py        # about 45 minutes on 2 CPU cores
"""
from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ("gpt_tiny", "vit_digits", "mlp_digits")
PLOTTED = "gpt_tiny"  # its range test is the plot in docs/tuning.md
FACTORS = (0.1, 1 / 3, 1.0, 3.0, 10.0)
STEPS = 200
SEEDS = (0, 1, 2, 3, 4)


def jzero(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return proc.stdout


def train(tuned: dict, lr: float, seed: int, tmp: Path) -> float:
    """The held-out loss after `STEPS` steps of the tuned config at ``lr`` with ``seed``."""
    config = json.loads(json.dumps(tuned))
    config["seed"] = seed
    config["optimizer"]["params"]["lr"] = lr
    config["scheduler"]["params"]["warmup_max_lr"] = lr
    path, out = tmp / f"lr_{lr:g}_{seed}.json", tmp / f"run_{lr:g}_{seed}"
    path.write_text(json.dumps(config))
    jzero("train", str(path), "--out", str(out), "--steps", str(STEPS), "--no-resume",
          "--set", f"jzero.train.eval_interval={STEPS}")
    evals = [float(r["eval_loss"]) for r in csv.DictReader(open(out / "metrics.csv")) if r["eval_loss"]]
    return evals[-1]


def sweep(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        jzero("tune", "lr", f"configs/{name}.json", "--out", tmp)
        suggestion = json.loads((Path(tmp) / "lr_find.json").read_text())["suggestion"]
        if name == PLOTTED:
            (RESULTS / "lr_find").mkdir(parents=True, exist_ok=True)
            for file in ("lr_find.png", "lr_find.json", "tuned_lr.json"):
                shutil.copy(Path(tmp) / file, RESULTS / "lr_find" / file)
        tuned = json.loads((Path(tmp) / "tuned_lr.json").read_text())
        runs = []
        for factor in FACTORS:
            losses = [train(tuned, suggestion * factor, seed, Path(tmp)) for seed in SEEDS]
            runs.append({"factor": factor, "lr": suggestion * factor, "eval_loss": sum(losses) / len(losses),
                         "per_seed": losses})
    best = min(runs, key=lambda r: r["eval_loss"])
    band = [r["factor"] for r in runs if near(r["per_seed"], best["per_seed"])]
    return {"config": name, "suggestion": suggestion, "runs": runs, "best_lr": best["lr"],
            "best_factor": best["factor"], "band": band,
            "in_band": any(1 / 3 - 1e-9 <= f <= 3 + 1e-9 for f in band)}


def near(losses: list[float], best: list[float]) -> bool:
    """Whether ``losses`` cannot be told from ``best`` (seed by seed): the mean paired difference
    is under two standard errors."""
    diffs = [a - b for a, b in zip(losses, best, strict=True)]
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    return mean <= 2 * sd / math.sqrt(len(diffs))


def main() -> int:
    rows = [sweep(name) for name in CONFIGS]
    lines = ["| config | suggested lr | " + " | ".join(f"x{f:.2g}" for f in FACTORS) + " | best lr | within 3x |",
             "|---|---|" + "---|" * len(FACTORS) + "---|---|"]
    for r in rows:
        cells = [f"**{x['eval_loss']:.3f}**" if x["factor"] in r["band"] else f"{x['eval_loss']:.3f}"
                 for x in r["runs"]]
        lines.append(f"| {r['config']} | {r['suggestion']:.2e} | " + " | ".join(cells)
                     + f" | {r['best_lr']:.2e} | {'yes' if r['in_band'] else 'NO'} |")
    table = "\n".join(lines) + (f"\n\nheld-out loss after {STEPS} steps at each multiple of the suggestion, mean of "
                                 f"{len(SEEDS)} seeds; bold: the band (not told from the best, paired over seeds)\n")
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lr_sweep.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "lr_sweep.md").write_text(table)
    return 0 if all(r["in_band"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

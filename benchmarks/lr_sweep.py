"""Does `jzero tune lr` suggest a good learning rate? For the GPT (`configs/gpt_tiny.json`) and
the ViT (`configs/vit_digits.json`): the range test's suggestion, then 200-step runs at the
suggestion x 1/10, 1/3, 1, 3, 10 (each with the tuned config's warmup), and their held-out
loss. Prints a table; writes ``benchmarks/results/lr_sweep.{json,md}``.

    python benchmarks/lr_sweep.py        # about six minutes on 2 CPU cores
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ("gpt_tiny", "vit_digits")
FACTORS = (0.1, 1 / 3, 1.0, 3.0, 10.0)
STEPS = 200


def jzero(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return proc.stdout


def sweep(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        jzero("tune", "lr", f"configs/{name}.json", "--out", tmp)
        suggestion = json.loads((Path(tmp) / "lr_find.json").read_text())["suggestion"]
        tuned = json.loads((Path(tmp) / "tuned_lr.json").read_text())
        runs = []
        for factor in FACTORS:
            lr = suggestion * factor
            config = json.loads(json.dumps(tuned))
            config["optimizer"]["params"]["lr"] = lr
            config["scheduler"]["params"]["warmup_max_lr"] = lr
            path = Path(tmp) / f"lr_{factor:g}.json"
            path.write_text(json.dumps(config))
            out = Path(tmp) / f"run_{factor:g}"
            jzero("train", str(path), "--out", str(out), "--steps", str(STEPS), "--no-resume",
                  "--set", f"jzero.train.eval_interval={STEPS}")
            evals = [float(r["eval_loss"]) for r in csv.DictReader(open(out / "metrics.csv")) if r["eval_loss"]]
            runs.append({"factor": factor, "lr": lr, "eval_loss": evals[-1]})
    best = min(runs, key=lambda r: r["eval_loss"])
    return {"config": name, "suggestion": suggestion, "runs": runs, "best_lr": best["lr"],
            "suggestion_loss_vs_best": next(r for r in runs if r["factor"] == 1.0)["eval_loss"] / best["eval_loss"]}


def main() -> int:
    rows = [sweep(name) for name in CONFIGS]
    lines = ["| config | suggested lr | " + " | ".join(f"x{f:.2g}" for f in FACTORS) + " | best lr |",
             "|---|---|" + "---|" * len(FACTORS) + "---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['suggestion']:.2e} | "
                     + " | ".join(f"{x['eval_loss']:.3f}" for x in r["runs"]) + f" | {r['best_lr']:.2e} |")
    table = "\n".join(lines) + f"\n\nheld-out loss after {STEPS} steps at each multiple of the suggestion\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lr_sweep.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "lr_sweep.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

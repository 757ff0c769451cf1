"""The vision demos end to end: `jzero train configs/vit_digits.json` and
`configs/clip_digits.json` (ZeRO-2 on 2 simulated CPU devices), each timed from the command's
start to its end (start-up and compile included), with the final held-out metrics. Prints a
table; writes ``benchmarks/results/vision.{json,md}``.

    python benchmarks/vision.py        # about four minutes on 2 CPU cores
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
RUNS = {  # config -> (metric, target, time budget in minutes): issue 18's acceptance
    "vit_digits": ("eval_accuracy", 0.95, 3.0),
    "clip_digits": ("zeroshot_accuracy", 0.85, 4.0),
}


def run(name: str) -> dict:
    metric, target, minutes = RUNS[name]
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jzero.cli", "train", f"configs/{name}.json", "--out", out,
                               "--no-resume"], capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: {proc.stderr.strip().splitlines()[-1]}")
        rows = [r for r in csv.DictReader(open(Path(out) / "metrics.csv")) if r[metric]]
    final = float(rows[-1][metric])
    return {"config": name, "steps": int(rows[-1]["step"]), "metric": metric, "value": final, "target": target,
            "seconds": seconds, "budget_s": minutes * 60, "ok": final >= target and seconds <= minutes * 60,
            "curve": [(int(r["step"]), float(r[metric])) for r in rows]}


def main() -> int:
    rows = [run(name) for name in RUNS]
    lines = ["| config | steps | held-out metric | value | target | wall time (s) | budget (s) | met |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['steps']} | {r['metric']} | {r['value']:.3f} | {r['target']:.2f} | "
              f"{r['seconds']:.0f} | {r['budget_s']:.0f} | {'yes' if r['ok'] else 'no'} |" for r in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vision.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "vision.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""int8 weights against fp32 on a trained model: held-out loss and logit error.

    python benchmarks/int8_quality.py [--checkpoint runs/jzero/checkpoints]

Trains the README's tiny byte-level GPT first when the checkpoint is missing (`jzero train
configs/gpt_tiny.json`, about 1.5 minutes). For block sizes 32, 64 and 128 it stores the weights as
the engine does (`jzero.inference.storage`: int8 with an fp32 scale per block) and runs the full
forward on what the engine computes with (the dequantized weights; tests/test_inference.py
shows the engine's logits equal them): the held-out cross entropy over the first 64 windows of
the bundled corpus's held-out split, against the fp32 weights', and the largest logit error
relative to the largest |logit|. Writes ``benchmarks/results/int8_quality.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jzero import load_config
from jzero.inference import storage
from jzero.models import gpt
from jzero.runtime.weights import read_params
from jzero.tasks import text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "configs" / "gpt_tiny.json"
WINDOWS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "runs" / "jzero" / "checkpoints"))
    args = parser.parse_args()
    if not Path(args.checkpoint).exists():
        subprocess.run([sys.executable, "-m", "jzero.cli", "train", str(CONFIG), "--out",
                        str(Path(args.checkpoint).parent)], check=True, cwd=ROOT)
    config = load_config(json.loads(CONFIG.read_text()))
    cfg = gpt.gpt_config(config.jzero.model, "none", config)
    params = read_params(args.checkpoint)
    heldout = text.load_corpus(config.jzero.data).heldout
    windows = np.stack([heldout[i * cfg.seq_len: i * cfg.seq_len + cfg.seq_len + 1] for i in range(WINDOWS)])
    inputs, targets = jnp.asarray(windows[:, :-1], jnp.int32), jnp.asarray(windows[:, 1:], jnp.int32)
    forward = jax.jit(lambda p: gpt.GPT(cfg).apply({"params": p}, inputs))
    base = forward(params)
    rows = [{"weights": "fp32", "bytes": storage.weight_bytes(params), "loss": float(gpt.cross_entropy(base, targets)),
             "max_logit_error": 0.0}]
    for block in (32, 64, 128):
        stored = storage.stored(params, jnp.float32, block)
        logits = forward(storage.dequantized(stored, jnp.float32))
        rows.append({"weights": f"int8, block {block}", "bytes": storage.weight_bytes(stored),
                     "loss": float(gpt.cross_entropy(logits, targets)),
                     "max_logit_error": float(jnp.abs(logits - base).max() / jnp.abs(base).max())})
    for row in rows:
        row["loss_change_pct"] = 100 * (row["loss"] / rows[0]["loss"] - 1)
        row["bytes_ratio"] = row["bytes"] / rows[0]["bytes"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "int8_quality.json").write_text(json.dumps({"checkpoint": args.checkpoint, "rows": rows}, indent=1))
    lines = [f"tiny byte-level GPT ({args.checkpoint}), held-out loss over {WINDOWS} windows of {cfg.seq_len}", "",
             "| weights | bytes (x fp32) | held-out loss | change | max logit error / max abs logit |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['weights']} | {r['bytes_ratio']:.3f} | {r['loss']:.4f} | {r['loss_change_pct']:+.2f}% | "
              f"{r['max_logit_error']:.4f} |" for r in rows]
    (RESULTS / "int8_quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Compiled measurements of tensor and sequence parallelism in a fresh process with XLA's full
pipeline, as `jzero estimate` and training compile (tests/test_model_parallel.py runs it: the
suite's cheap pipeline leaves unfused temporaries that are no program's real peak, and a big
optimized compile in a long-lived test worker is one more program in the hundreds XLA:CPU has
crashed after). ``python split_probe.py memory|long``: one JSON line."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402

import jzero  # noqa: E402
from jzero import models  # noqa: E402
from jzero.analysis import estimate, profile  # noqa: E402

from helpers import token_batches  # noqa: E402

LAYER = {"name": "gpt", "size": "tiny", "n_layers": 3, "n_heads": 8, "d_model": 128, "d_ff": 512,
         "vocab_size": 256, "seq_len": 2048, "positions": "rotary"}  # rotary: learned positions stay whole
LONG = {"name": "gpt", "n_layers": 1, "n_heads": 8, "d_model": 16, "d_ff": 32, "seq_len": 16384,
        "vocab_size": 64, "positions": "rotary"}


def config(model, tp=1, sp=1, msp=False, devices=8):
    return jzero.load_config({
        "train_micro_batch_size_per_gpu": 2 if model is LAYER else 1, "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "tensor_parallel": {"autotp_size": tp}, "sequence_parallel_size": sp,
        "jzero": {"mesh": {"devices": devices, "megatron_sequence_parallel": msp}, "remat": "full", "model": model}})


def memory() -> dict:
    """Per-device temporaries and stored params at each split, T 2048, blockwise attention."""
    out = {}
    for tp, sp, msp in ((1, 1, False), (4, 1, True), (1, 2, False), (1, 4, False)):
        m = profile.memory(estimate.compile_step(config(LAYER, tp, sp, msp)).compiled)
        out[f"{tp}x{sp}"] = {"temp": m.temp, "params": m.params}
    return out


def long() -> dict:
    """The T 16384 GPT's compiled peak on one device and over sp 8, and three steps at sp 8."""
    peaks = {sp: profile.memory(estimate.compile_step(config(LONG, sp=sp, devices=sp)).compiled).peak
             for sp in (1, 8)}
    cfg = config(LONG, sp=8)
    model = models.build(cfg)
    state = jzero.init(model.init_fn, cfg, loss_fn=model.loss_fn, rng=0)
    losses = []
    for batch in token_batches(3, 1, LONG["seq_len"], LONG["vocab_size"]):
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return {"peak_sp1": peaks[1], "peak_sp8": peaks[8], "losses": losses, "devices": jax.device_count()}


if __name__ == "__main__":
    print(json.dumps({"memory": memory, "long": long}[sys.argv[1]]()))

"""A ResNet-style CNN with BatchNorm, written as any Flax user writes one, trained by
`jzero.train_step` at ZeRO-2 on 2 devices on scikit-learn's bundled digits (8x8, 10 classes).

Nothing here is jzero's but the three calls a user makes: `jzero.from_linen` (the model's
``batch_stats`` become the TrainState's model state), `jzero.init` and `jzero.train_step`.
Evaluation is plain Flax: the trained params and running statistics, ``train=False``.

    python examples/resnet_digits.py              # 300 steps: held-out accuracy and wall time
    python examples/resnet_digits.py --steps 200
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "jax" not in sys.modules:  # 2 simulated devices on a CPU-only host (set before JAX starts)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jzero


class ResBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x, train: bool):
        norm = dict(use_running_average=not train, momentum=0.9)
        y = nn.relu(nn.BatchNorm(**norm)(nn.Conv(self.channels, (3, 3), use_bias=False)(x)))
        y = nn.BatchNorm(**norm, scale_init=nn.initializers.zeros)(nn.Conv(self.channels, (3, 3), use_bias=False)(y))
        return nn.relu(x + y)  # each block starts as the identity (its last norm's scale is 0)


class ResNet(nn.Module):
    channels: int = 32
    blocks: int = 2
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.channels, (3, 3), use_bias=False)(x)  # no bias before a BatchNorm
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        for _ in range(self.blocks):
            x = ResBlock(self.channels)(x, train)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def cross_entropy(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def digits(heldout_fraction: float = 0.2) -> tuple[np.ndarray, ...]:
    """(train images, train labels, held-out images, held-out labels): 8x8x1 in [0, 1]."""
    from sklearn.datasets import load_digits  # reads the file inside scikit-learn's wheel

    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    cut = int(len(x) * (1 - heldout_fraction))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def train(steps: int = 300, batch: int = 64, devices: int = 2, seed: int = 0) -> dict:
    """Train the ResNet; returns the held-out accuracy, the final train loss and the seconds."""
    start = time.perf_counter()
    x_train, y_train, x_test, y_test = digits()
    cfg = jzero.load_config({
        "train_batch_size": batch, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 1e-4}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": steps // 10}},
    })
    model = ResNet()
    init_fn, loss_fn = jzero.from_linen(model, jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32), cross_entropy)
    mesh = jzero.make_mesh(cfg, devices=jax.devices()[:devices])
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=seed, mesh=mesh)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = rng.choice(len(x_train), batch, replace=False)
        state, metrics = jzero.train_step(state, {"inputs": x_train[rows], "labels": y_train[rows]})
        loss = float(metrics["loss"])  # one step in flight: XLA:CPU's collectives stall under a deep queue
    variables = {"params": jax.device_get(state.params), **jax.device_get(state.model_state)}
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x_test)
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == y_test))
    return {"steps": steps, "devices": devices, "stage": 2, "heldout_accuracy": accuracy,
            "final_train_loss": loss, "seconds": time.perf_counter() - start, "state": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    result = train(args.steps)
    print(f"ResNet on digits, ZeRO-2 on {result['devices']} devices, {result['steps']} steps: held-out accuracy "
          f"{result['heldout_accuracy']:.3f}, final train loss {result['final_train_loss']:.4f}, "
          f"{result['seconds']:.0f} s wall (compile included)")


if __name__ == "__main__":
    main()

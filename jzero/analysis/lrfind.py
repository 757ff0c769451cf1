"""`jzero tune lr`: the learning-rate range test (Smith 2015; Lightning's ``lr_find``) on the
config's own model, data and ZeRO stage.

The lr grows exponentially from ``min_lr`` to ``max_lr`` over ``steps`` optimizer steps (the
config's scheduler is set aside; its optimizer and everything else run as configured), the
training loss is smoothed by a debiased exponential moving average, and the test stops early
once the smoothed loss passes ``diverge`` x its best (or is not finite). The suggestion is
found where the smoothed loss falls fastest per unit of log-lr (steepest descent of the curve,
Lightning's rule): below it the loss barely moves, past it the descent slows and turns into
divergence, so it is the largest lr still in the region of fast, stable progress. A point of
the smoothed curve does not describe the lr logged beside it, though: each loss is measured
before its step's update, and the moving average's weights have a mean age of beta / (1 - beta)
steps, so the curve runs ``delay(beta)`` steps behind the sweep (9 + 1 at beta 0.9: a factor 5
in lr for 100 steps over 1e-7..1). The suggestion is the lr of the step the steepest point
describes; Lightning's rule without this correction lands 5x high, past the best lr of a
200-step run (`benchmarks/lr_sweep.py`). Warmup for the written config: DeepSpeed's WarmupLR
to the suggestion over ``steps / 10`` steps.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jzero.config import ConfigError
from jzero.zero import optim


@dataclass
class RangeTest:
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    suggestion: float = float("nan")
    diverged_at: float | None = None  # the lr where the test stopped (None: it ran to max_lr)

    def config(self, raw: dict[str, Any], warmup: int) -> dict[str, Any]:
        """``raw`` with the suggested lr, reached by a linear WarmupLR over ``warmup`` steps."""
        out = copy.deepcopy(raw)
        out.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})["lr"] = self.suggestion
        out["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": self.suggestion,
                                                          "warmup_num_steps": warmup, "warmup_type": "linear"}}
        return out


def schedule(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """``steps`` lrs from ``min_lr`` to ``max_lr``, evenly spaced in log-lr."""
    if not 0 < min_lr < max_lr:
        raise ConfigError(f"--min / --max: need 0 < min < max, got min {min_lr}, max {max_lr}")
    if steps < 5:
        raise ConfigError(f"--steps: the range test needs at least 5 steps, got {steps}")
    return [min_lr * (max_lr / min_lr) ** (i / (steps - 1)) for i in range(steps)]


def delay(beta: float) -> int:
    """Steps the smoothed loss runs behind the lr: one (a loss is measured before its step's
    update) plus the mean age of the moving average's weights, beta / (1 - beta)."""
    return 1 + round(beta / (1 - beta))


def suggest(lrs: list[float], smoothed: list[float], beta: float = 0.9, skip: int = 3) -> float:
    """The lr the steepest descent of the smoothed loss per unit of log-lr describes: the lr
    `delay` steps before that point (the first and last ``skip`` points, where the average is
    least settled, left out of the search)."""
    if len(lrs) < 2 * skip + 2:
        raise ConfigError(f"jzero tune lr: the loss diverged after {len(lrs)} steps, too early to suggest an lr; "
                          "lower --max or --min")
    slopes = np.gradient(np.asarray(smoothed), np.log(np.asarray(lrs)))
    steepest = skip + int(np.argmin(slopes[skip:len(lrs) - skip]))
    return float(lrs[max(0, steepest - delay(beta))])


def range_test(raw: dict[str, Any], min_lr: float = 1e-7, max_lr: float = 1.0, steps: int = 100,
               beta: float = 0.9, diverge: float = 4.0) -> RangeTest:
    """Run the range test on the config ``raw`` (a DeepSpeed/jzero dict)."""
    from jzero import tasks
    from jzero.train.resolve import load_config
    from jzero.train.state import init
    from jzero.train.step import train_step
    from jzero.zero.mesh import make_mesh

    lrs = schedule(min_lr, max_lr, steps)
    optimizer = dict(raw.get("optimizer", {"type": "AdamW"}))
    optimizer["params"] = {**optimizer.get("params", {}), "lr": min_lr}
    config = load_config({**{k: v for k, v in raw.items() if k != "scheduler"}, "optimizer": optimizer})
    task = tasks.build(config)
    state = init(task.model.init_fn, config, loss_fn=task.model.loss_fn, rng=jax.random.key(config.seed),
                 mesh=make_mesh(config), stages=task.model.stages)
    ratio = max_lr / min_lr
    sweep = optim.build(config, lr=lambda t: min_lr * ratio ** (jnp.asarray(t, jnp.float32) / (steps - 1)))
    box = [state.replace(tx=sweep.tx)]  # the same optimizer state, the lr of the sweep

    def step(i: int) -> float:
        state = box[0]
        box[0], metrics = train_step(state, task.batch("train", i, state.config.train_batch_size, state.plan.batch))
        return float(metrics["loss"])

    return run(step, lrs, beta, diverge)


def run(step: Any, lrs: list[float], beta: float = 0.9, diverge: float = 4.0) -> RangeTest:
    """The range test's loop: ``step(i)`` trains one step at ``lrs[i]`` and returns its loss; the
    debiased moving average, the early stop and the suggestion."""
    out, avg, best = RangeTest(), 0.0, math.inf
    for i, lr in enumerate(lrs):
        loss = step(i)
        avg = beta * avg + (1 - beta) * loss
        smooth = avg / (1 - beta ** (i + 1))
        out.lrs.append(lr)
        out.losses.append(loss)
        out.smoothed.append(smooth)
        best = min(best, smooth)
        if not math.isfinite(smooth) or smooth > diverge * best:
            out.diverged_at = lr
            break
    usable = len(out.lrs) - (1 if out.diverged_at is not None else 0)
    out.suggestion = suggest(out.lrs[:usable], out.smoothed[:usable], beta)
    return out


def plot(test: RangeTest, path: str, title: str) -> None:
    """Loss (raw and smoothed) against lr, log scale, the suggestion marked (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(test.lrs, test.losses, color="lightgray", label="loss")
    ax.plot(test.lrs, test.smoothed, label="smoothed loss")
    ax.axvline(test.suggestion, color="red", linestyle="--", label=f"suggested lr {test.suggestion:.2e}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss", title=title)
    top = min(max(test.smoothed), 2 * min(test.smoothed) + 1)
    ax.set_ylim(min(test.losses) * 0.9, max(top, min(test.losses) * 1.1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""DeepSpeed's LR schedulers as optax schedules, with DeepSpeed's formulas and step alignment.

Each schedule maps ``t`` -- the number of optimizer steps already taken (optax's ``count``) -- to
the lr optimizer step ``t`` applies, exactly as under DeepSpeed's engine: the scheduler is built
at ``last_batch_iteration = -1`` and stepped only *after* each optimizer step, so step 0 runs
with the value the constructor set (`INITIAL`) and step ``t >= 1`` with the formula at ``t - 1``
(``get_lr()`` with ``last_batch_iteration = t - 1``). The ``formula`` functions below are
``get_lr()``; `build` shifts them. OneCycle also cycles beta1 inversely (optimizers with betas;
DeepSpeed leaves SGD's and Adagrad's momentum alone); `build` returns that schedule too.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from jzero.config import Config, ConfigError, ConfigWarning, SchedulerConfig
from jzero.config.paramtable import REQUIRED, Choice, canonical, resolve

Schedule = Callable[[Any], Any]
WARMUP = Choice(("log", "linear"), "log")

# type -> {param: default}; DeepSpeed's signatures (deepspeed/runtime/lr_schedules.py).
PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": WARMUP, "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": WARMUP, "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": WARMUP, "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
                 "cycle_first_step_size": 2000, "cycle_second_step_size": None,
                 "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
                 "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0, "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000,
                    "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
                    "last_batch_iteration": -1},
}


class Schedules(NamedTuple):
    lr: Schedule
    momentum: Schedule | None  # OneCycle's beta1 cycle (optimizers with betas), else None


def validate(cfg: Config) -> SchedulerConfig | None:
    """``cfg.scheduler`` with its canonical type and every param checked, defaults filled in and
    ``"auto"`` resolved (``warmup_max_lr`` <- the optimizer's lr, ``total_num_steps`` <-
    ``jzero.train.steps``). Needs the resolved optimizer section (its lr)."""
    sched = cfg.scheduler
    if sched is None:
        return None
    name = canonical("scheduler", sched.type, PARAMS)

    def auto(key: str) -> Any:
        sources = {"warmup_max_lr": cfg.optimizer.params["lr"], "total_num_steps": cfg.jzero.train.steps}
        if key not in sources:
            raise ConfigError(f"scheduler.params.{key}: 'auto' has no source in jzero; set a number")
        return sources[key]

    params = resolve("scheduler", name, PARAMS[name], sched.params, auto=auto)
    if params["last_batch_iteration"] != -1:
        raise ConfigError("scheduler.params.last_batch_iteration: jzero resumes schedules from checkpoints; "
                          "valid: -1")
    for key in ("warmup_num_steps", "lr_range_test_step_size", "cycle_first_step_size"):
        zero_ok = key == "warmup_num_steps"  # DeepSpeed warms up max(2, n) steps: HF's default 0 is valid
        value = params.get(key, 1)
        if not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"scheduler.params.{key}: must be a {'non-negative' if zero_ok else 'positive'} "
                              f"number, got {value!r}")
    if params.get("warmup_max_lr", 0) is None:
        params["warmup_max_lr"] = cfg.optimizer.params["lr"]
    return SchedulerConfig(type=name, params=params)


def build(cfg: Config, base_lr: float, *, cycles_betas: bool = True) -> Schedules:
    """The lr (and beta1) applied at each optimizer step for the resolved ``cfg.scheduler``
    (`validate`); constant ``base_lr`` when absent. ``cycles_betas``: the optimizer has betas for OneCycle to cycle."""
    if cfg.scheduler is None:
        return Schedules(lambda t: jnp.asarray(base_lr, jnp.float32), None)
    name, p = cfg.scheduler.type, dict(cfg.scheduler.params)
    if p.get("warmup_max_lr", 0) is None:
        p["warmup_max_lr"] = base_lr
    formula = _BUILDERS[name](p, base_lr)
    momentum = None
    if formula.momentum is not None and cycles_betas:
        momentum = _after_each_step(formula.momentum, formula.momentum0)
    elif formula.momentum is not None:
        warnings.warn(f"scheduler.params.cycle_momentum: {cfg.optimizer.type} has no betas; as in DeepSpeed, "
                      "OneCycle cycles the lr only", ConfigWarning, stacklevel=3)
    return Schedules(_after_each_step(formula.lr, formula.lr0), momentum)


def _after_each_step(formula: Schedule, initial: float) -> Schedule:
    """DeepSpeed's alignment: step 0 applies the constructor's value, step t the formula at t-1."""
    def applied(t):
        t = jnp.asarray(t, jnp.float32)
        return jnp.where(t < 1, jnp.float32(initial), formula(jnp.maximum(t - 1, 0.0)))

    return applied


class _Formula(NamedTuple):
    """A scheduler's ``get_lr()`` (and momentum) as a function of ``last_batch_iteration``, and
    the values its constructor writes into the optimizer (``last_batch_iteration = -1``)."""

    lr: Schedule
    lr0: float
    momentum: Schedule | None = None
    momentum0: float | None = None


def _warmup_gamma(t: Any, warmup: int, kind: str) -> Any:
    """DeepSpeed's warmup fraction at t < warmup: log(t+1)/log(W) or t/W."""
    if kind == "log":
        return jnp.log(t + 1.0) / math.log(warmup)
    return t / warmup


def _warmup_lr(p: Mapping[str, Any], _base: float) -> Schedules:
    """WarmupLR, and WarmupDecayLR when ``total_num_steps`` is present (linear decay after)."""
    warmup, total = max(2, p["warmup_num_steps"]), p.get("total_num_steps")
    lo, hi = p["warmup_min_lr"], p["warmup_max_lr"]

    def lr(t):
        t = jnp.asarray(t, jnp.float32)
        after = 1.0 if total is None else jnp.maximum(0.0, (total - t) / max(1.0, total - warmup))
        gamma = jnp.where(t < warmup, _warmup_gamma(t, warmup, p["warmup_type"]), after)
        return lo + (hi - lo) * gamma

    return _Formula(lr, lo)


def _warmup_cosine_lr(p: Mapping[str, Any], base: float) -> Schedules:
    warmup, total = max(2, p["warmup_num_steps"]), p["total_num_steps"]
    wmin, cmin = p["warmup_min_ratio"], p["cos_min_ratio"]

    def lr(t):
        t = jnp.asarray(t, jnp.float32)
        warm = wmin + _warmup_gamma(t, warmup, p["warmup_type"]) * (1.0 - wmin)
        progress = jnp.minimum(1.0, (t - warmup + 1) / max(1, total - warmup))
        # (1 + cos(pi p)) / 2 written as cos(pi p / 2)^2: no cancellation near the end, where
        # the ratio is small and float32 would otherwise lose ~7 ulps against DeepSpeed's float64.
        cos = jnp.maximum(0.0, cmin + (1.0 - cmin) * jnp.cos(0.5 * math.pi * progress) ** 2)
        return base * jnp.where(t < warmup, warm, cos)

    return _Formula(lr, 0.0)  # DeepSpeed's constructor sets 0.0, whatever warmup_min_ratio is


def _one_cycle(p: Mapping[str, Any], _base: float) -> Schedules:
    first = float(p["cycle_first_step_size"])
    second = float(p["cycle_second_step_size"] if p["cycle_second_step_size"] is not None else first)
    total, ratio = first + second, first / (first + second)
    stairs1 = p["cycle_first_stair_count"]
    stairs2 = stairs1 if p["cycle_second_stair_count"] is None else p["cycle_second_stair_count"]
    decay_steps = p["decay_step_size"]

    def scale(t):
        it = t + 1.0
        x = 1.0 + it / total - jnp.floor(1 + it / total)
        rising = x <= ratio
        s = jnp.where(rising, x / ratio, (x - 1) / (ratio - 1))
        pos_in = jnp.mod(it, total)
        if stairs1 > 0 or stairs2 > 0:
            up = jnp.floor(pos_in * stairs1 / first) / max(stairs1, 1)
            down = jnp.floor((total - pos_in) * stairs2 / second) / max(stairs2, 1)
            stair_rising = pos_in <= first
            stair = jnp.where(stair_rising, up, down)
            use = jnp.where(stair_rising, stairs1 > 0, stairs2 > 0)
            s = jnp.where(use, stair, s)
        return s

    def decay_factor(t, rate):
        if decay_steps == 0 or rate == 0:
            return None
        return 1 + rate * (t - total + 1) / decay_steps

    def lr(t):
        t = jnp.asarray(t, jnp.float32)
        lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
        cyc = lo + (hi - lo) * scale(t)
        f = decay_factor(t, p["decay_lr_rate"])
        after = lo if f is None else lo / f
        return jnp.where(t < total, cyc, after)

    def momentum(t):
        t = jnp.asarray(t, jnp.float32)
        lo, hi = p["cycle_min_mom"], p["cycle_max_mom"]
        cyc = hi - (hi - lo) * scale(t)
        f = decay_factor(t, p["decay_mom_rate"])
        after = hi if f is None else hi * f
        return jnp.where(t < total, cyc, after)

    if not p["cycle_momentum"]:
        return _Formula(lr, p["cycle_min_lr"])
    return _Formula(lr, p["cycle_min_lr"], momentum, p["cycle_min_mom"])


def _lr_range_test(p: Mapping[str, Any], _base: float) -> Schedules:
    lo, size, rate = p["lr_range_test_min_lr"], p["lr_range_test_step_size"], p["lr_range_test_step_rate"]

    def lr(t):
        interval = (jnp.asarray(t, jnp.float32) + 1.0) / size
        if p["lr_range_test_staircase"]:
            interval = jnp.floor(interval)
        return lo * (1 + rate * interval)

    return _Formula(lr, lo)


_BUILDERS: dict[str, Callable[[Mapping[str, Any], float], _Formula]] = {
    "WarmupLR": _warmup_lr,
    "WarmupDecayLR": _warmup_lr,
    "WarmupCosineLR": _warmup_cosine_lr,
    "OneCycle": _one_cycle,
    "LRRangeTest": _lr_range_test,
}

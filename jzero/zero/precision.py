"""Dtype policy and the fp16 dynamic loss scaler.

Policy: fp32 master params, compute in the policy's dtype, grads accumulated in fp32. The step
casts the floating params to the compute dtype before calling the user's loss, so one code path
serves every model (Linen, NNX, plain functions) and the gradient flows back to the fp32 master
through the cast.

Loss scaler: DeepSpeed's `DynamicLossScaler` rule as a pure ``(init, update)`` pair over a
NamedTuple state kept in the TrainState. Two deliberate differences, both in the metrics: at
``min_loss_scale`` an overflow skips the step and the run goes on (DeepSpeed raises), and the
scale never grows past ``jzero.max_loss_scale`` (default 2**24), so it cannot reach inf.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jzero.config import Config

DYNAMIC_KEYS = ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                "min_loss_scale")

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class Policy(NamedTuple):
    param_dtype: Any
    compute_dtype: Any
    grad_accum_dtype: Any
    comm_dtype: Any  # gradients are reduced across devices in this dtype


def policy(config: Config) -> Policy:
    """bf16.enabled -> bf16 compute; fp16.enabled -> fp16; else fp32 (jzero.compute_dtype overrides).
    Gradient reductions in ``communication_data_type`` (default fp32, as DeepSpeed for bf16)."""
    if config.jzero.compute_dtype is not None:
        compute = config.jzero.compute_dtype
    else:
        compute = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    return Policy(jnp.float32, DTYPES[compute], DTYPES[config.data_types.grad_accum_dtype],
                  DTYPES[config.communication_data_type or "fp32"])


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast every floating leaf of ``tree`` to ``dtype``; integer leaves are left alone."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree.map(cast, tree)


class LossScaleState(NamedTuple):
    scale: jax.Array  # f32: the current loss scale
    hysteresis: jax.Array  # int32: overflows still tolerated before the scale halves
    last_overflow: jax.Array  # int32: step index of the last overflow (-1: none yet)
    iteration: jax.Array  # int32: steps seen by the scaler (DeepSpeed's cur_iter)
    skipped: jax.Array  # int32: running count of skipped (overflowed) steps


class LossScaler(NamedTuple):
    """Static settings of the scaler; ``dynamic=False`` is DeepSpeed's static ``loss_scale``."""

    dynamic: bool
    initial_scale: float
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    max_scale: float

    def init(self) -> LossScaleState:
        return LossScaleState(scale=jnp.float32(min(self.initial_scale, self.max_scale)),
                              hysteresis=jnp.int32(self.hysteresis), last_overflow=jnp.int32(-1),
                              iteration=jnp.int32(0), skipped=jnp.int32(0))

    def update(self, state: LossScaleState, overflow: jax.Array) -> LossScaleState:
        """DeepSpeed's update_scale(overflow), with jzero's floor/cap behaviour."""
        skipped = state.skipped + overflow.astype(jnp.int32)
        if not self.dynamic:
            return state._replace(iteration=state.iteration + 1, skipped=skipped)
        shrink = (self.hysteresis == 1) | (state.hysteresis == 1)
        on_overflow_scale = jnp.where(shrink, jnp.maximum(state.scale / 2, self.min_scale), state.scale)
        on_overflow_hyst = jnp.where(shrink, state.hysteresis, state.hysteresis - 1)
        grow = (state.iteration - state.last_overflow) % self.window == 0
        clean_hyst = state.hysteresis
        if self.consecutive_hysteresis:
            clean_hyst = jnp.int32(self.hysteresis)
        clean_hyst = jnp.where(grow, jnp.int32(self.hysteresis), clean_hyst)
        clean_scale = jnp.where(grow, jnp.minimum(state.scale * 2, self.max_scale), state.scale)
        return LossScaleState(scale=jnp.where(overflow, on_overflow_scale, clean_scale),
                              hysteresis=jnp.where(overflow, on_overflow_hyst, clean_hyst),
                              last_overflow=jnp.where(overflow, state.iteration, state.last_overflow),
                              iteration=state.iteration + 1, skipped=skipped)


def loss_scaler(config: Config) -> LossScaler | None:
    """The scaler for ``fp16.enabled`` (None otherwise). When none of DeepSpeed's dynamic keys
    is given, DeepSpeed's class defaults apply: initial scale 2**32 (capped here), hysteresis 1."""
    fp16 = config.fp16
    if not fp16.enabled:
        return None
    given = config.source.get("fp16", {})
    max_scale = config.jzero.max_loss_scale
    if fp16.loss_scale > 0:
        return LossScaler(False, fp16.loss_scale, 1, 1, False, fp16.loss_scale, fp16.loss_scale)
    if not any(k in given for k in DYNAMIC_KEYS):
        return LossScaler(True, 2.0**32, 1000, 1, False, 1.0, max_scale)
    return LossScaler(True, 2.0**fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
                      fp16.consecutive_hysteresis, fp16.min_loss_scale, max_scale)

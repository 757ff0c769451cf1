"""Model state: a model's non-parameter variables (BatchNorm's running statistics, counters),
the third thing a step carries beside params and optimizer state. DeepSpeed's buffers.

The contract (docs/api.md): a stateful model's ``init_fn(rng)`` returns ``Variables(params,
state)`` and its ``loss_fn(params, batch, rng, state)`` returns ``(out, new_state)``, where
``out`` is what a stateless loss returns (``loss`` or ``(loss, aux)``). ``from_linen`` (the
non-``params`` collections) and ``from_nnx`` (the non-``Param``, non-RNG variables) build it.

The rules, and why:
- *Layout*: replicated on every device at every ZeRO stage, as DeepSpeed keeps buffers: it is
  small, every device's forward reads all of it, and sharding it would buy nothing.
- *Micro-batches*: each device threads the state through its micro-batches in order, the
  update of one feeding the next, as torch's in-place buffers do under DeepSpeed's gradient
  accumulation.
- *Devices*: once per step the new state is averaged over the data axes (Flax's ImageNet
  example, ``cross_replica_mean``), so every replica holds the same statistics. For BatchNorm
  the running mean and variance are linear in each micro-batch's statistics, so averaging once
  per step equals averaging after every micro-batch. Non-floating leaves (counters) take the
  largest value over the devices, which is every device's value when they advance together.
- *fp16 overflow*: a skipped step still keeps the new state, as torch's forward has already
  updated the buffers when DeepSpeed skips the optimizer step.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jzero.zero.mesh import live


class Variables(NamedTuple):
    """What a stateful ``init_fn`` returns: the trained ``params`` and the model ``state``."""

    params: Any
    state: Any


def is_stateful(init_output: Any) -> bool:
    """Whether ``init_fn`` returned `Variables` (the model has state) rather than bare params."""
    return isinstance(init_output, Variables)


def synchronized(state: Any, axes: tuple[str, ...]) -> Any:
    """``state`` made equal on every device of ``axes``: floating leaves averaged, others the
    largest value (inside a ``shard_map`` over ``axes``)."""
    axes = live(axes)
    if not axes:
        return state

    def one(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axes)
        return jax.lax.pmax(x, axes)

    return jax.tree.map(one, state)

"""One-line adapters from Flax modules to jzero's ``init_fn(rng)`` / ``loss_fn(params, batch, rng)``.

Both adapters share the contract: ``loss(outputs, batch) -> loss | (loss, aux)`` and
``inputs(batch) -> model input`` (default: ``batch["inputs"]`` for a dict, ``batch[0]`` for a
tuple, else the batch itself). Params are a plain nested dict, so Plans, checkpoints and exports
see the same tree whichever Flax API built it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

Loss = Callable[[Any, Any], Any]


def default_inputs(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return batch["inputs"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


def from_linen(module: nn.Module, sample_input: Any, loss: Loss, *,
               inputs: Callable[[Any], Any] = default_inputs,
               apply_kwargs: Mapping[str, Any] | None = None) -> tuple[Callable, Callable]:
    """(init_fn, loss_fn) for a Linen module. ``sample_input`` (arrays or ShapeDtypeStructs, any
    pytree) fixes the input shapes for ``init``; the RNG of each step is passed as the
    ``dropout`` stream."""
    kwargs = dict(apply_kwargs or {})

    def init_fn(rng):
        sample = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sample_input)
        return module.init({"params": rng, "dropout": rng}, sample, **kwargs)["params"]

    def loss_fn(params, batch, rng):
        out = module.apply({"params": params}, inputs(batch), rngs={"dropout": rng}, **kwargs)
        return loss(out, batch)

    return init_fn, loss_fn


def from_nnx(make_model: Callable[[nnx.Rngs], nnx.Module], loss: Loss, *,
             inputs: Callable[[Any], Any] = default_inputs) -> tuple[Callable, Callable]:
    """(init_fn, loss_fn) for an NNX model built by ``make_model(rngs)``.

    Params are the model's ``nnx.Param`` variables. Other state (RNG streams of dropout
    layers) is rebuilt from the step's rng on every call, so it is never stale; mutable
    non-Param state (e.g. BatchNorm statistics) is not carried between steps.
    """
    graphdef, abstract_params, abstract_rest = nnx.split(
        nnx.eval_shape(lambda: make_model(nnx.Rngs(0))), nnx.Param, ...)
    has_rest = bool(jax.tree.leaves(abstract_rest))

    def init_fn(rng):
        return nnx.to_pure_dict(nnx.state(make_model(nnx.Rngs(rng)), nnx.Param))

    def loss_fn(params, batch, rng):
        state = jax.tree.map(lambda x: x, abstract_params)
        nnx.replace_by_pure_dict(state, params)
        rest = nnx.split(make_model(nnx.Rngs(rng)), nnx.Param, ...)[2] if has_rest else abstract_rest
        return loss(nnx.merge(graphdef, state, rest)(inputs(batch)), batch)

    return init_fn, loss_fn

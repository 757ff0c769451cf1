"""What the step's collectives move and the once-per-step gradient reduction, shared by the
plain step (`jzero.train.step`) and the pipelined one (`jzero.train.pipeline`): the config's wire
(`wire`), the model axes it traces under (`model_axes`), and each device's accumulated gradient
reduced over the data devices into its ZeRO layout (`reduce_once`).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jzero.zero import buckets, dots, hooks, modelaxes, precision
from jzero.zero.mesh import model_parallel, platform


def zeros_like_shard(g: jax.Array, layout: Any) -> jax.Array:
    """A frozen leaf's gradient as this device's block of ``layout``: zeros, never reduced
    (stages 0-1 accumulate full local gradients; the reduction would make the shard)."""
    return jnp.zeros(layout.shard_shape(g.shape), g.dtype)


def reduce_once(g: jax.Array, layout: Any, frozen: bool, on_wire: hooks.Wire) -> jax.Array:
    """A device's accumulated gradient summed over the data devices as ``on_wire`` says, laid
    out as ``layout``: reduce-scattered along its ZeRO dimension, else all-reduced; a frozen
    leaf's is zeros, never reduced."""
    if frozen:
        return zeros_like_shard(g, layout)
    return hooks.reduce([g], [hooks.reduction(layout.spec)], on_wire)[0].astype(g.dtype)


def wire(cfg: Any, mesh: Any) -> hooks.Wire:
    """What the config's collectives move: params in the compute dtype, gradients in
    ``communication_data_type``; int8 blocks of ``jzero.quantization_block_size`` elements
    with ZeRO++'s ``zero_quantized_weights`` / ``zero_quantized_gradients``; weight gradients
    unfolded where ``mesh``'s backend needs it (`jzero.zero.dots`); on TPU leaves moved as they
    are (`jzero.zero.buckets.rows_are_free`)."""
    pol, zero, block = precision.policy(cfg), cfg.zero_optimization, cfg.jzero.quantization_block_size
    on = platform(mesh)
    return hooks.Wire(pol.compute_dtype, pol.comm_dtype, block if zero.zero_quantized_weights else None,
                      block if zero.zero_quantized_gradients else None, dots.applies(on),
                      leafwise=model_parallel(mesh), native=not buckets.rows_are_free(on))


def model_axes(cfg: Any) -> modelaxes.ModelAxes:
    """The config's model axes: the activation layout the loss is traced under."""
    return modelaxes.ModelAxes(cfg.sequence_parallel_size, cfg.tensor_parallel.size,
                               cfg.jzero.mesh.megatron_sequence_parallel)

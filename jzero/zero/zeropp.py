"""ZeRO++'s quantized collectives (arXiv 2306.10209), written for the per-layer hooks (`jzero.zero.hooks`).

* qwZ (``zero_quantized_weights``, stage 3): a param shard is quantized in blocks
  (`jzero.zero.quantize`: int8 + one fp32 scale per block), all-gathered as int8 and scales, and
  dequantized to the compute dtype on arrival: 1 byte per param on the wire instead of 2 (bf16).
* qgZ (``zero_quantized_gradients``, stages 1-3): a gradient is cut into one chunk per device
  of its ZeRO group, each chunk quantized, sent with one ``all_to_all`` (every device receives
  its chunk from every device) and summed locally in fp32: 1 byte per param instead of 4.
  Across the groups (hpZ's replicas, which keep replicated optimizer state and so need the
  sum on every replica) the group's reduced chunk, 1/Z of the gradient, is all-reduced in the
  communication dtype: shard_map's types can only prove a value replicated through a psum
  (an all-gather + local sum is typed as varying), so that hop is not quantized.

A value that does not split into whole blocks (its shard, or its per-device chunk) takes the
plain collective instead, as DeepSpeed falls back to a plain reduce-scatter. The stored master
params and the fp32 accumulator are never quantized: only the wire is.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jzero.zero import buckets
from jzero.zero.quantize import Quantized, dequantize, fits, quantize


def can_gather(shard: jax.Array, block: int | None) -> bool:
    return fits(shard, block)


def gather(shard: jax.Array, dim: int, axes: tuple[str, ...], dtype: Any, block: int) -> jax.Array:
    """The full param from its shard (sharded along ``dim`` over ``axes``), moved as int8
    blocks; in ``dtype``."""
    q = quantize(shard, block)
    values = jax.lax.all_gather(q.values, axes, axis=0, tiled=False)
    scales = jax.lax.all_gather(q.scales, axes, axis=0, tiled=False)
    parts = dequantize(Quantized(values, scales), (buckets.group_size(axes), *shard.shape), dtype)
    return buckets.in_place(parts, dim)  # device-major along dim, as a tiled gather


def can_reduce(ct: jax.Array, dim: int | None, axes: tuple[str, ...], block: int | None) -> bool:
    """Whether each device's chunk of ``ct`` (along ``dim`` over ``axes``) is whole blocks."""
    if dim is None or not block:
        return False
    n = buckets.group_size(axes)
    return ct.shape[dim] % n == 0 and (ct.size // n) % block == 0


def reduce_scatter(ct: jax.Array, dim: int, scatter: tuple[str, ...], over: tuple[str, ...],
                   block: int, comm: Any) -> jax.Array:
    """This device's chunk (along ``dim``) of the sum of ``ct`` over every device of ``scatter``
    and ``over``, in fp32: int8 chunks through one all-to-all inside the group, summed; then
    summed across ``over`` in ``comm`` (no data moves when ``over`` is trivial)."""
    n = buckets.group_size(scatter)
    pieces = buckets.chunks(ct, dim, n).reshape(n, *buckets.shard_shape(ct.shape, dim, n))
    q = quantize(pieces, block, leading=1)
    values = jax.lax.all_to_all(q.values, scatter, split_axis=0, concat_axis=0, tiled=True)
    scales = jax.lax.all_to_all(q.scales, scatter, split_axis=0, concat_axis=0, tiled=True)
    total = dequantize(Quantized(values, scales), pieces.shape, jnp.float32).sum(0)
    return jax.lax.psum(total.astype(comm), over).astype(jnp.float32) if over else total

"""Gradient buckets: the gradients that share a reduction summed in one collective, not one each.

DeepSpeed copies gradients into ``reduce_bucket_size`` buckets before reducing them; jzero's
hooks see one layer at a time (`jzero.zero.hooks`), so a layer's gradients (or those of every leaf
outside the layer stacks) make one bucket: a fixed size, one layer's worth, that never holds a
full gradient. A collective is a rendezvous of every device of its group, and each one is paid
for in latency and in the devices waiting for each other: one per leaf made the 25M GPT's stage-2
step ~8% slower than one per layer on XLA:CPU (docs/design.md, "Engine overhead"); XLA:GPU
combines them itself, XLA:CPU does not.

A leaf reduce-scattered along dimension ``d`` over ``n`` devices is sent as ``n`` rows, row i its
i-th chunk along ``d`` (`chunks`), so every device's part of the bucket is its chunks of each leaf,
one after another, each already laid out as the leaf's shard. XLA:CPU, asked to reduce-scatter
or all-gather along an inner dimension, transposes the whole array element by element to make
that dimension the outermost and back after; rows move chunks as runs of contiguous memory, and
nothing moves back. On TPU none of this applies (`rows_are_free`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jzero.zero.mesh import psum


def rows_are_free(platform: str) -> bool:
    """Whether ``platform`` (a device's ``.platform``) turns a leaf into rows and back for free:
    row-major layouts (CPU, GPU) reshape by a bitcast. TPU arrays are laid out in tiles, so there
    each reshape is a copy of the whole leaf (and the bitcast of 16-bit values to raw bits another,
    `jzero.zero.bits`), while its collectives take any dimension of any dtype: on TPU the leaves
    move as they are, one collective each, and its compiler combines them."""
    return platform != "tpu"


def all_reduce(gs: Sequence[jax.Array], over: tuple[str, ...]) -> list[jax.Array]:
    """Every ``gs`` summed over the ``over`` axes: one all-reduce of them all."""
    return list(psum(tuple(gs), over))


def reduce_scatter(gs: Sequence[jax.Array], dims: Sequence[int], scatter: tuple[str, ...],
                   over: tuple[str, ...]) -> list[jax.Array]:
    """This device's chunk of each of ``gs`` (along its ``dims`` entry) of their sums over the
    ``scatter`` axes, then summed over ``over``: one reduce-scatter (and one all-reduce) of them all."""
    n = group_size(scatter)
    rows = [chunks(g, d, n) for g, d in zip(gs, dims, strict=True)]
    flat = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0], scatter,
                                scatter_dimension=0, tiled=True)[0]
    if over:
        flat = jax.lax.psum(flat, over)
    pieces = jnp.split(flat, np.cumsum([r.shape[1] for r in rows])[:-1]) if len(rows) > 1 else [flat]
    return [p.reshape(shard_shape(g.shape, d, n)) for p, g, d in zip(pieces, gs, dims, strict=True)]


def reduce_scatter_each(gs: Sequence[jax.Array], dims: Sequence[int], scatter: tuple[str, ...],
                        over: tuple[str, ...]) -> list[jax.Array]:
    """`reduce_scatter` one collective a leaf, each along its own dimension, never reshaped: a
    leaf split over a model axis the compiler partitions cannot be flattened into a bucket (the
    compiler would gather it whole first)."""
    out = [jax.lax.psum_scatter(g, scatter, scatter_dimension=d, tiled=True) for g, d in zip(gs, dims, strict=True)]
    return all_reduce(out, over)


def all_gather(shard: jax.Array, dim: int, axes: tuple[str, ...]) -> jax.Array:
    """The full array from its chunks along ``dim`` over ``axes``: gathered device-major, then
    each device's chunk put in place."""
    parts = jax.lax.all_gather(shard.reshape(1, -1), axes, axis=0, tiled=True)
    return in_place(parts.reshape(parts.shape[0], *shard.shape), dim)


def chunks(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``x`` as ``n`` rows, row i its i-th chunk along ``dim``: the chunks move whole (runs of
    everything after ``dim``), never element by element, and each row is laid out as the chunk."""
    pre, post = x.shape[:dim], x.shape[dim + 1:]
    return jnp.moveaxis(x.reshape(*pre, n, x.shape[dim] // n, *post), dim, 0).reshape(n, -1)


def in_place(parts: jax.Array, dim: int) -> jax.Array:
    """The full array from its ``n`` chunks along ``dim``, stacked device-major (the inverse of `chunks`)."""
    full = list(parts.shape[1:])
    full[dim] *= parts.shape[0]
    return jnp.moveaxis(parts, 0, dim).reshape(full)


def shard_shape(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    """One chunk's shape: ``shape`` with ``dim`` divided by ``n``."""
    return (*shape[:dim], shape[dim] // n, *shape[dim + 1:])


def group_size(axes: tuple[str, ...]) -> int:
    """How many devices the mesh ``axes`` span (inside a ``shard_map``)."""
    return math.prod(jax.lax.axis_size(a) for a in axes)

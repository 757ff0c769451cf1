"""The global batch inside a loss: what a loss that couples examples (CLIP's contrastive loss)
needs when the jzero step gives it only one device's rows (`jzero.gather_rows`, `jzero.row_offset`).

The step runs the user's loss under ``shard_map`` over the data axes (`jzero.train.step`), one
device's rows at a time, and declares those axes here while it traces. `gather_rows` stacks a value
computed per row over every device (``all_gather``, whose backward is a reduce-scatter, so the
gradient is the global batch's), `row_offset` is this device's first row in that stacking. Outside
the step (a plain loop, evaluation by hand) both are the identity: the batch is already global.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jzero.zero.mesh import axis_index, live

_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("jzero_rows", default=None)


@contextlib.contextmanager
def split_over(axes: tuple[str, ...]) -> Iterator[None]:
    """While tracing, the loss sees one device's rows of a batch split over ``axes``."""
    token = _AXES.set(axes)
    try:
        yield
    finally:
        _AXES.reset(token)


def gather_rows(x: jax.Array) -> jax.Array:
    """``x`` (leading dim = this device's rows) for every row of the global batch, in order."""
    axes = live(_AXES.get() or ())
    return jax.lax.all_gather(x, axes, axis=0, tiled=True) if axes else x


def row_offset(local_rows: int) -> jax.Array:
    """Index of this device's first row in `gather_rows`' order (0 outside the step)."""
    axes = _AXES.get()
    return jnp.int32(0) if axes is None else axis_index(axes) * local_rows

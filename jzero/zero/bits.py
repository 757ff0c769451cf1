"""16-bit floats as their raw bits (uint16), where XLA:CPU would otherwise widen them to fp32.

XLA:CPU computes most bf16 operations in fp32 (its float normalization), collectives and
dynamic slices included: a bf16 all-gather travels as fp32 (twice the bytes on the wire), and a
bf16 slice of a stacked array converts the whole array. Integers pass untouched, so moving a
16-bit value as `raw` bits and turning it back with `restored` keeps both exact and narrow.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def raw(x: jax.Array) -> jax.Array:
    """A 16-bit value as its raw bits (uint16); any other value as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def restored(x: jax.Array, dtype: Any) -> jax.Array:
    """The ``dtype`` value whose bits `raw` returned (``x`` itself unless it is uint16)."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x

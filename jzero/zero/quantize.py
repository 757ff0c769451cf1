"""Blockwise symmetric int8 quantization: ZeRO++'s wire format (qwZ weights, qgZ gradients).

A value is cut into blocks of ``block`` consecutive elements (of its flattened form); each block
is sent as int8 ``round(x / s)`` with one fp32 scale ``s = max|block| / 127``, so the error of an
element is at most ``s / 2 = max|block| / 254`` (DeepSpeed's ``CUDAQuantizer``, symmetric). An
all-zero block has scale 0 and comes back exactly zero. Only the wire is quantized: what is
stored (master params, the gradient accumulator) never is.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

QMAX = 127.0


class Quantized(NamedTuple):
    values: jax.Array  # int8 (..., blocks, block)
    scales: jax.Array  # fp32 (..., blocks)


def fits(x: Any, block: int | None, leading: int = 0) -> bool:
    """Whether ``x`` (its dims after the first ``leading``) splits into whole blocks."""
    if not block:
        return False
    size = 1
    for n in x.shape[leading:]:
        size *= n
    return size % block == 0 and size > 0


def quantize(x: jax.Array, block: int, leading: int = 0) -> Quantized:
    """``x`` as int8 blocks + fp32 scales; the first ``leading`` dims are kept (quantized
    separately, e.g. one row per destination device), the rest flattened into blocks."""
    lead = x.shape[:leading]
    flat = x.astype(jnp.float32).reshape(*lead, -1, block)
    scales = jnp.max(jnp.abs(flat), axis=-1) / QMAX
    safe = jnp.where(scales > 0, scales, 1.0)[..., None]
    values = jnp.clip(jnp.round(flat / safe), -QMAX, QMAX).astype(jnp.int8)
    return Quantized(values, scales)


def dequantize(q: Quantized, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The value of ``shape`` (the kept leading dims included) that `quantize` encoded."""
    return (q.values.astype(jnp.float32) * q.scales[..., None]).reshape(shape).astype(dtype)


def error_stats(x: jax.Array, block: int) -> dict[str, jax.Array]:
    """Quantization error of ``x`` relative to each block's max |value|: the largest and the
    RMS over blocks (the bound is 1 / 254 = 0.0039), and the largest absolute error."""
    flat = x.astype(jnp.float32).reshape(-1, block)
    err = jnp.abs(dequantize(quantize(flat, block), flat.shape, jnp.float32) - flat)
    peak = jnp.max(jnp.abs(flat), axis=-1)
    rel = jnp.where(peak > 0, jnp.max(err, axis=-1) / jnp.where(peak > 0, peak, 1.0), 0.0)
    return {"max_rel": jnp.max(rel), "rms_rel": jnp.sqrt(jnp.mean(rel ** 2)), "max_abs": jnp.max(err)}

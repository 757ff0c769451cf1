"""Rotary position embeddings as Hugging Face's Llama family computes them: the rotate-half
layout (the first half of each head's features pairs with the second), inverse frequencies by
``rope_type`` (transformers' ``modeling_rope_utils``), and a scale on cos and sin (YaRN's).

Supported types: ``default``, ``linear`` (positions divided by ``factor``), ``llama3`` (Llama
3.1's band-wise rescaling) and ``yarn``. ``dynamic`` (NTK scaling recomputed from each batch's
length), ``longrope`` and the rest are refused by name (`check`): their frequencies depend on
the sequence at hand, not on the config alone.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RoPE:
    """A config's rotary settings (transformers' ``rope_parameters``)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: the scale of cos and sin (None: from factor, mscale)
    mscale: float = 0.0  # yarn
    mscale_all_dim: float = 0.0  # yarn
    truncate: bool = True  # yarn


def _base(rope: RoPE, dim: int) -> np.ndarray:
    return 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))


def _default(rope: RoPE, dim: int) -> tuple[np.ndarray, float]:
    return _base(rope, dim), 1.0


def _linear(rope: RoPE, dim: int) -> tuple[np.ndarray, float]:
    return _base(rope, dim) / np.float32(rope.factor), 1.0


def _llama3(rope: RoPE, dim: int) -> tuple[np.ndarray, float]:
    inv = _base(rope, dim)
    old, low, high = rope.original_max_position_embeddings, rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / rope.factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(rope: RoPE, dim: int) -> tuple[np.ndarray, float]:
    factor, old = rope.factor, rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        attention = (_mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim)
                     if rope.mscale and rope.mscale_all_dim else _mscale(factor))

    def correction(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv = (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation
    return inv.astype(np.float32), float(attention)


# rope_type -> (settings, rotated dims) -> (inverse frequencies [dim / 2], scale of cos and sin)
TYPES: dict[str, Callable[[RoPE, int], tuple[np.ndarray, float]]] = {
    "default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn}
NEEDS = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
         "yarn": ("factor", "original_max_position_embeddings")}


def frequencies(rope: RoPE, dim: int) -> tuple[np.ndarray, float]:
    """The inverse frequencies of ``dim`` rotated features and the scale of cos and sin."""
    return TYPES[rope.type](rope, dim)


def apply(x: jax.Array, positions: jax.Array, rope: RoPE) -> jax.Array:
    """``x`` ``[b, T, heads, d]`` rotated by ``positions`` ``[b or 1, T]`` (rotate-half, in fp32,
    returned in x's dtype)."""
    inv, scale = frequencies(rope, x.shape[-1])
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    h = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return (h * cos + rotated * sin).astype(x.dtype)

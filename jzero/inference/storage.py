"""Where and how the engine keeps a model's weights, and what a layer does to use them.

Two independent choices:

* ``PLACEMENTS``, named policies: ``"device"`` keeps every weight whole on every device;
  ``"sharded"`` splits each over the devices by ZeRO-3's rule and all-gathers a layer's right
  before it runs (a model too big for one device, served by several); ``"host"`` is
  ZeRO-Inference: the weights live in pinned host memory (JAX memory kinds, as training's
  ``offload_param``) and each layer's are brought to the device inside the layer loop, right
  before that layer runs, so the device holds about two layers' weights (the one in use and
  the next in flight) plus the KV cache, whatever the depth.
* int8 weight-only quantization (``int8_block``): every floating weight of two or more dims (a
  layer's: the stacked layer dim aside)
  whose last dim splits into blocks of ``int8_block`` is stored as int8 with one fp32 scale per
  block (`jzero.zero.quantize`, ZeRO++'s symmetric format: error at most max|block| / 254) and
  dequantized to the compute dtype by the layer that uses it, so quantized weights are what
  sits in memory and crosses from the host.

`fetcher` builds the function a `jzero.models.kvcache.Decoder` applies to each layer's params (and once
to the params outside the layers) before use: the policy's transfer or gather, then the
dequantization.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.zero import quantize, sharding, treepath
from jzero.zero.sharding import STACKED_KEY


class Int8(NamedTuple):
    """A weight ``[..., n]`` as int8 ``values [..., n / block, block]`` and fp32 ``scales [..., n / block]``."""

    values: jax.Array
    scales: jax.Array


def _is_int8(x: Any) -> bool:
    return isinstance(x, Int8)


def quantized(params: Any, block: int) -> Any:
    """``params`` with every weight that fits (module docstring) as `Int8`; a stacked leaf's
    leading layer dim does not count (a layer's LayerNorm scale ``[layers, d]`` stays as it is)."""
    def one(path, x):
        return Int8(*quantize.quantize(x, block, leading=x.ndim - 1)) if _fits(path, x, block) else x

    return jax.tree_util.tree_map_with_path(one, params)


def quantizable(params: Any, block: int) -> list[str]:
    """The names of the weights `quantized` turns into int8 blocks of ``block``."""
    found = jax.tree_util.tree_flatten_with_path(params)[0]
    return [treepath.SEP.join(map(treepath.key_name, path)) for path, x in found if _fits(path, x, block)]


def _fits(path: tuple, x: Any, block: int) -> bool:
    dims = x.ndim - any(treepath.key_name(k) == STACKED_KEY for k in path)
    return dims >= 2 and jnp.issubdtype(x.dtype, jnp.floating) and x.shape[-1] % block == 0


def dequantized(params: Any, dtype: Any) -> Any:
    """``params`` with each `Int8` back as a ``dtype`` array."""
    def one(x):
        if not _is_int8(x):
            return x
        shape = (*x.values.shape[:-2], x.values.shape[-2] * x.values.shape[-1])
        return quantize.dequantize(quantize.Quantized(*x), shape, dtype)

    return jax.tree.map(one, params, is_leaf=_is_int8)


def stored(params: Any, dtype: Any, int8_block: int = 0) -> Any:
    """``params`` as the engine keeps them: `Int8` where they fit ``int8_block`` (0: none), every
    other floating weight in ``dtype``."""
    if int8_block:
        params = quantized(params, int8_block)

    def cast(x):
        return x if _is_int8(x) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    return jax.tree.map(cast, params, is_leaf=_is_int8)


def weight_bytes(params: Any) -> int:
    """Bytes of ``params`` as stored (int8 values and their scales for quantized weights)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


class Placement(NamedTuple):
    """Where a policy keeps the weights: the memory kind, and whether each is split over the
    devices (ZeRO-3's layout, gathered a layer at a time) or whole on every device."""

    memory_kind: str
    sharded: bool


PLACEMENTS: dict[str, Placement] = {
    "device": Placement("device", False),  # whole on every device
    "sharded": Placement("device", True),  # ZeRO-3 style: 1/N on each device, all-gathered per layer
    "host": Placement("pinned_host", False),  # ZeRO-Inference: host memory, moved per layer
}


def checked_placement(name: str) -> Placement:
    """Placement ``name``; ValueError naming the valid ones."""
    if name not in PLACEMENTS:
        raise ValueError(f"engine weights: {name!r} is not one of {', '.join(PLACEMENTS)}")
    return PLACEMENTS[name]


def shardings(params: Any, placement: str, mesh: Mesh) -> Any:
    """Each stored leaf's `NamedSharding` on ``mesh`` (one axis) under ``placement``: ZeRO's rule
    for a split leaf (`jzero.zero.sharding.zero_spec`: its largest dim that divides, never a
    stacked leaf's layer dim), replicated otherwise."""
    place, axis = checked_placement(placement), mesh.axis_names[0]

    def one(path, x):
        spec = sharding.zero_spec(x.shape, P(), mesh.shape[axis], stacked=sharding.is_stacked(path), axes=(axis,))
        return NamedSharding(mesh, spec if place.sharded else P(), memory_kind=place.memory_kind)

    return jax.tree_util.tree_map_with_path(one, params)


def fetcher(placement: str, dtype: Any, mesh: Mesh) -> Callable[[Any], Any]:
    """What a layer applies to its params: to the device (from the host under ``"host"``),
    gathered whole (under ``"sharded"``), then dequantized to ``dtype``."""
    place = checked_placement(placement)
    whole = NamedSharding(mesh, P())

    def fetch(params: Any) -> Any:
        if place.memory_kind != "device":
            params = jax.device_put(params, jax.memory.Space.Device)
        if place.sharded:
            params = jax.lax.with_sharding_constraint(params, jax.tree.map(lambda _: whole, params))
        return dequantized(params, dtype)

    return fetch

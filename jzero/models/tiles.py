"""Token-wise work in tiles of tokens, each tile recomputed in the backward, so the large
per-token intermediates of the language-model loss and the feed-forward never exist whole.

A GPT's activations are ``tokens x d_model``; its logits are ``vocab / d_model`` times larger
(x 25 for the 1.3B GPT), in fp32, and their gradient as large again: at 16k tokens a device that
is 6.6 GB. The feed-forward's hidden is ``d_ff / d_model`` (x 4) times larger, and a layer's
backward holds several such arrays at once. DeepSpeed's long-sequence training (Arctic long
sequence training: the tiled fused logits+loss and ``TiledMLP``) computes both per tile of tokens
and recomputes each tile in the backward; this is that: `map_tiles` runs a function over tiles
of ``tile`` tokens under ``lax.map``, each tile under ``jax.checkpoint`` (the backward recomputes
its intermediates from the tile's inputs), the params' gradients summed over tiles by the scan.
One tile's intermediates live at a time. With no more than ``tile`` tokens it is the plain
computation.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def map_tiles(fn: Callable[..., Any], arrays: tuple[jax.Array, ...], tile: int) -> Any:
    """``fn(*tiles, valid)`` for each tile of ``tile`` rows of ``arrays`` (their leading axis,
    zero-padded at the end; ``valid`` marks the real rows), stacked along a new leading axis."""
    n = arrays[0].shape[0]
    steps = -(-n // tile)
    pad = steps * tile - n
    tiled = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(steps, tile, *a.shape[1:])
                  for a in arrays)
    valid = (jnp.arange(steps * tile) < n).reshape(steps, tile)
    one = jax.checkpoint(fn)
    return jax.lax.map(lambda xs: one(*xs), (*tiled, valid))


def params_of(dense: nn.Dense, width: int, dtype: Any) -> dict[str, jax.Array]:
    """A Linen ``Dense``'s params, bound by applying it to one row of ``width`` zeros (at init
    that creates them), for computing with them outside Linen (inside `map_tiles`)."""
    dense(jnp.zeros((1, width), dtype))
    return dense.variables["params"]


def _tile_sum(x: jax.Array, targets: jax.Array, scale: jax.Array, weight: jax.Array, bias: jax.Array | None,
              tied: bool) -> jax.Array:
    """Cross entropy of one tile summed with per-token ``scale`` (0 on padding): ``x`` ``[n, d]``
    through the head (``weight`` ``[vocab, d]`` when ``tied`` to the embedding, else ``[d, vocab]``;
    ``bias`` ``[vocab]`` or None), in fp32."""
    logits = x @ (weight.T if tied else weight)
    if bias is not None:
        logits = logits + bias
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * scale)


def tiled_cross_entropy(x: jax.Array, weight: jax.Array, targets: jax.Array, *, bias: jax.Array | None = None,
                        tied: bool = True, tile: int = 1024, weights: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross entropy of the logits ``x @ head`` (``x`` ``[..., d]``, ``targets``
    ``x.shape[:-1]``), ``tile`` tokens at a time; equal to the whole-logits loss and gradients.
    ``weights`` (``targets``' shape): the mean of ``weights x cross entropy`` instead
    (`jzero.models.packing`: loss masks, normalized over the global batch)."""
    d = x.shape[-1]
    x, targets = x.reshape(-1, d), targets.reshape(-1)
    n = x.shape[0]
    scale = jnp.ones(n, jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    if n <= tile:
        return _tile_sum(x, targets, scale, weight, bias, tied) / n
    sums = map_tiles(lambda xt, tt, st, _: _tile_sum(xt, tt, st, weight, bias, tied), (x, targets, scale), tile)
    return jnp.sum(sums) / n


def mlp(x: jax.Array, fc: dict[str, jax.Array], out: dict[str, jax.Array]) -> jax.Array:
    """The GPT feed-forward ``gelu(x @ fc + b) @ out + b`` on two ``Dense`` param dicts."""
    return jax.nn.gelu(x @ fc["kernel"] + fc["bias"]) @ out["kernel"] + out["bias"]


def tiled_mlp(x: jax.Array, fc: dict[str, jax.Array], out: dict[str, jax.Array], *, tile: int) -> jax.Array:
    """`mlp` of ``x`` ``[..., d]``, ``tile`` tokens at a time (`map_tiles`); the same values and
    gradients, with one tile's hidden (``tile x d_ff``) alive at a time."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    y = map_tiles(lambda xt, _: mlp(xt, fc, out), (flat,), tile)
    return y.reshape(-1, y.shape[-1])[: flat.shape[0]].reshape(*x.shape[:-1], y.shape[-1])

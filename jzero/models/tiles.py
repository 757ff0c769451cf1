"""The language-model loss in tiles of tokens, so the ``tokens x vocab`` logits never exist whole.

A GPT's last activation is small (``tokens x d_model``); its logits are ``vocab / d_model``
times larger (x 25 for the 1.3B GPT), in fp32, and their gradient as large again: at 16k
tokens a device that is 6.6 GB, more than the rest of the step's temporaries. DeepSpeed's
long-sequence training fuses the output projection and the cross entropy per tile and recomputes
them in the backward; this is that: `tiled_cross_entropy` scans over tiles of ``tile`` tokens,
each tile's projection + cross entropy under ``jax.checkpoint`` (the backward recomputes its
logits from the tile's activations), the head's gradient summed over tiles by the scan. One
tile of logits lives at a time. With no more than ``tile`` tokens it is the plain computation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _tile_sum(x: jax.Array, targets: jax.Array, valid: jax.Array, weight: jax.Array, bias: jax.Array | None,
              tied: bool) -> jax.Array:
    """Summed cross entropy of one tile: ``x`` ``[n, d]`` through the head (``weight`` ``[vocab, d]``
    when ``tied`` to the embedding, else ``[d, vocab]``; ``bias`` ``[vocab]`` or None), in fp32."""
    logits = x @ (weight.T if tied else weight)
    if bias is not None:
        logits = logits + bias
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(jnp.where(valid, ce, 0.0))


def tiled_cross_entropy(x: jax.Array, weight: jax.Array, targets: jax.Array, *, bias: jax.Array | None = None,
                        tied: bool = True, tile: int = 1024) -> jax.Array:
    """Mean next-token cross entropy of the logits ``x @ head`` (``x`` ``[..., d]``, ``targets``
    ``x.shape[:-1]``), ``tile`` tokens at a time; equal to the whole-logits loss and gradients."""
    d = x.shape[-1]
    x, targets = x.reshape(-1, d), targets.reshape(-1)
    n = x.shape[0]
    if n <= tile:
        return _tile_sum(x, targets, jnp.ones(n, bool), weight, bias, tied) / n
    steps = -(-n // tile)
    pad = steps * tile - n
    x = jnp.pad(x, ((0, pad), (0, 0))).reshape(steps, tile, d)
    targets = jnp.pad(targets, (0, pad)).reshape(steps, tile)
    valid = (jnp.arange(steps * tile) < n).reshape(steps, tile)
    one = jax.checkpoint(lambda xt, tt, vt: _tile_sum(xt, tt, vt, weight, bias, tied))
    _, sums = jax.lax.scan(lambda carry, xs: (carry, one(*xs)), None, (x, targets, valid))
    return jnp.sum(sums) / n

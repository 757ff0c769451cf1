"""The key/value cache of a decoder and the decode interface the inference engine drives.

A cache holds, per layer and per row (a decode slot, or one request being prefilled), the keys
and values of every position written so far: ``[layers, rows, max_len, kv_heads, head_dim]`` in
the compute dtype (MaxText's and JetStream's layout). A forward over new tokens takes each
token's absolute position: it writes the token's key and value at that position and lets the
token attend to positions up to its own. Position ``max_len`` is the sentinel of a token that is
not there (prompt padding, an idle slot): its write is dropped and its output is ignored, so
one compiled shape serves every mix of lengths.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values ``[layers, rows, max_len, kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(layers: int, rows: int, max_len: int, kv_heads: int, head_dim: int, dtype: Any) -> KVCache:
        shape = (layers, rows, max_len, kv_heads, head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[-3]


class Decoding(NamedTuple):
    """What a block needs to decode: the whole stacked cache, the index of the block's layer in
    it and the new tokens' positions ``[rows, T]``. Carried through the layer loop, so each layer
    writes only its new tokens into the one cache buffer (updated in place, never copied whole)."""

    cache: KVCache
    layer: jax.Array
    positions: jax.Array

    def written(self, k: jax.Array, v: jax.Array) -> Decoding:
        """With ``k`` / ``v`` ``[rows, T, kv_heads, head_dim]`` written at this layer and the
        positions (the sentinel ``max_len`` writes nothing)."""
        rows = jnp.arange(k.shape[0])[:, None]
        at = (self.layer, rows, self.positions)
        return self._replace(cache=KVCache(self.cache.k.at[at].set(k.astype(self.cache.k.dtype), mode="drop"),
                                           self.cache.v.at[at].set(v.astype(self.cache.v.dtype), mode="drop")))

    def keys_values(self) -> tuple[jax.Array, jax.Array]:
        """This layer's cached keys and values ``[rows, max_len, kv_heads, head_dim]``."""
        return self.cache.k[self.layer], self.cache.v[self.layer]

    def visible(self) -> jax.Array:
        """``[rows, 1, T, max_len]`` bool: the cached positions each new token attends to (its
        own and every earlier one: causal over absolute positions)."""
        return (jnp.arange(self.cache.max_len)[None, None, :] <= self.positions[:, :, None])[:, None]


class Decoder(NamedTuple):
    """What a model exposes to be served by `jzero.inference` (the reference GPT's is
    `jzero.models.gpt.decoder`).

    ``forward(params, tokens, positions, cache, fetch) -> (logits, cache)``: tokens and positions
    ``[rows, T]`` int32, logits ``[rows, T, vocab]`` fp32, the cache with the new keys and values
    written; ``fetch`` maps each layer's params, inside the layer loop, and the params outside
    the layers to what they compute with (`jzero.inference.storage`: from host memory, int8
    dequantized); ``cache(rows, dtype)``: an empty `KVCache` for ``rows`` rows; ``max_len``: the
    longest sequence (prompt and generated tokens) a row holds; ``vocab_size``: the logits' width.
    """

    forward: Callable[[Any, jax.Array, jax.Array, KVCache, Callable[[Any], Any]], tuple[jax.Array, KVCache]]
    cache: Callable[[int, Any], KVCache]
    max_len: int
    vocab_size: int

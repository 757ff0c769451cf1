"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), per row.

Every row of a decode batch is its own request, so each row has its own settings and its own
PRNG key: a request's tokens depend on its seed and its position only, never on which slot it
sits in or what shares the batch (``key = fold_in(request_key, token_index)`` is the engine's).
The filters follow Hugging Face's order: the logits are divided by the temperature, cut to the
``top_k`` largest, then to the smallest set whose probability (renormalized over what top-k
kept) reaches ``top_p``. Temperature 0 is greedy (the argmax of the raw logits).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingParams(NamedTuple):
    """One request's sampling. ``temperature`` 0: greedy; ``top_k`` 0: no cut; ``top_p`` 1: no cut."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def checked(self) -> SamplingParams:
        """Itself, or ValueError naming the field and its valid range."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0 (0: greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k: must be an integer >= 0 (0: no cut), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1] (1: no cut), got {self.top_p}")
        return self


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    return logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]


def kept(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``[b, V]`` bool: the tokens each row may draw after top-k and top-p (``temperature``,
    ``top_k``, ``top_p``: ``[b]``)."""
    return _kept(_scaled(logits, temperature), top_k, top_p)


def _kept(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    in_k = jnp.arange(vocab)[None] < jnp.where(top_k > 0, top_k, vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass ranked above each token
    keep_ranked = in_k & (before < top_p[:, None])
    return jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """``[b]`` int32 tokens from ``logits`` ``[b, V]``, row ``i`` drawn with ``keys[i]`` and its
    own settings (each ``[b]``); rows at temperature 0 take the argmax."""
    scaled = _scaled(logits, temperature)
    masked = jnp.where(_kept(scaled, top_k, top_p), scaled, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def as_arrays(params: list[SamplingParams]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row ``(temperature, top_k, top_p)`` arrays of a batch's checked requests."""
    checked = [p.checked() for p in params]
    return (jnp.array([p.temperature for p in checked], jnp.float32), jnp.array([p.top_k for p in checked], jnp.int32),
            jnp.array([p.top_p for p in checked], jnp.float32))

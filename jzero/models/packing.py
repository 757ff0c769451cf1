"""How a batch of text reaches a language model: tokens, next-token targets, per-token loss
weights, and packed documents' segment ids and per-document positions.

Packing puts several documents in one row (`jzero.tasks.packer`); the model must then treat
each as if it ran alone: attention never crosses a segment boundary (``segments`` reach
`jzero.attention`, which masks tile by tile), and positions restart at every document (learned
tables and RoPE read ``positions``). A batch says so with its keys: ``{"inputs", "targets"}`` and
optionally ``"weights"`` (float, the token's share of the loss), ``"segments"`` (int ids, equal
within one document) and ``"positions"`` (int). `text_of` turns such a batch into the one
argument the reference models take.

Loss weights are normalized over the global batch before the step sees them (`normalized`):
the model's loss is the plain mean of ``weight x cross entropy`` over its micro-batch's tokens,
and gradient accumulation and data parallelism average those means over equal-sized slices, so
the step's loss is ``sum(w x ce) / sum(w)`` over the whole global batch: one big batch's loss,
however the batch is split.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

KEYS = ("weights", "segments", "positions")  # the optional batch keys, besides inputs and targets


class Packed(NamedTuple):
    """Packed documents in a row: int ``segments`` and ``positions``, both ``[b, T]``."""

    segments: jax.Array
    positions: jax.Array


class Text(NamedTuple):
    """A language model's input: ``tokens`` ``[b, T]``; for the loss its ``targets``, and the
    optional ``weights`` (None: every token weighs 1) and ``packed`` documents."""

    tokens: jax.Array
    targets: jax.Array | None = None
    weights: jax.Array | None = None
    packed: Packed | None = None


def text_of(batch: Mapping[str, Any], *, targets: bool = True) -> Text:
    """The `Text` of a batch dict (``targets`` False: the logits are wanted, not the loss)."""
    segments, positions = batch.get("segments"), batch.get("positions")
    if (segments is None) != (positions is None):
        raise ValueError("a packed batch needs both 'segments' and 'positions' (one [batch, seq] int array each)")
    packed = None if segments is None else Packed(segments, positions)
    return Text(batch["inputs"], batch["targets"] if targets else None, batch.get("weights"), packed)


def as_text(inputs: Any) -> Text:
    """A model's argument as `Text`: tokens alone, a ``(tokens, targets, ...)`` tuple, or Text."""
    return inputs if isinstance(inputs, Text) else Text(*inputs) if isinstance(inputs, tuple) else Text(inputs)


def shared_of(batch: Mapping[str, Any] | None) -> tuple[Packed, ...]:
    """A pipeline chunk's extra layer argument: ``(Packed,)`` for a packed micro-batch, else ()."""
    text = None if batch is None else text_of(batch, targets=False)
    return () if text is None or text.packed is None else (text.packed,)


def packed(batch: Any) -> bool:
    """Whether ``batch`` is a dict of packed documents (it has segment ids)."""
    return isinstance(batch, Mapping) and "segments" in batch


def normalized(weights: jax.Array) -> jax.Array:
    """``weights`` scaled so that their mean over the whole array is 1 (all-zero weights stay
    zero): each slice's mean of ``w x ce``, averaged over equal slices, is then the global
    weighted mean. Run on the global batch (a sharded array), before any split."""
    weights = weights.astype(jnp.float32)
    return weights * (weights.size / jnp.maximum(jnp.sum(weights), 1e-9))

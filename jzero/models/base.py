"""`Model`: what the engine, `jzero estimate`, autotune and profile need from a reference model."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jzero.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Model:
    """A reference model built from a config: its ``init_fn`` / ``loss_fn`` pair for `jzero.init`,
    its own resolved settings (``spec``), and functions of the global batch size for the batch's
    shapes, an example batch (values that do not change the step's cost) and the analytic
    training FLOPs of one step, all devices (forward + backward, no recompute)."""

    name: str
    spec: Any
    init_fn: Callable[[Any], Any]
    loss_fn: Callable[[Any, Any, Any], Any]
    batch_spec: Callable[[int], dict[str, Any]]  # batch size -> {key: jax.ShapeDtypeStruct}
    example_batch: Callable[[int], dict[str, Any]]  # batch size -> {key: numpy array}
    flops: Callable[[int], dict[str, float]]  # batch size -> FLOPs of one step by part, "total" included
    tokens_per_example: int
    step_metrics: tuple[str, ...] = ()  # scalars of the loss's aux dict shown and logged every step
    forward: Callable[[Any, Any], Any] | None = None  # (params, inputs) -> outputs, for held-out metrics
    stages: Stages | None = None  # the model cut for a pipeline (None: it cannot be pipelined)
    decoder: Any = None  # its KV-cached `jzero.models.kvcache.Decoder` (None: it cannot be served)


class Stages(NamedTuple):
    """A model cut for a pipeline (`jzero.train.pipeline`): its layer stack, the params under
    ``params[stack]["stacked"]`` (leading dim = blocks), and its two ends, the rest of the
    params. The first stage embeds, every stage runs its own blocks, the last computes the loss;
    the ends' params are every stage's, so tied embeddings are one leaf whose gradient sums
    the first stage's and the last's (DeepSpeed's ``TiedLayerSpec``)."""

    stack: str  # the params key of the layer stack
    block: str  # the blocks' class name, which ``pipeline.partition: "type:REGEX"`` searches
    embed: Callable[[Any, Any], Any]  # (ends' params, micro-batch) -> the first block's input
    layers: Callable[[Any, Any], Any]  # (params[stack] of any number of blocks, x) -> x
    head: Callable[[Any, Any, Any], Any]  # (ends' params, last block's output, micro-batch) -> loss


def token_batches(seq_len: int, vocab_size: int) -> tuple[Callable[[int], dict], Callable[[int], dict]]:
    """A language model's (batch_spec, example_batch): ``{"inputs", "targets"}`` int32 token
    arrays of shape (batch, seq_len), the example's targets its inputs shifted by one."""
    def batch_spec(batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32) for k in ("inputs", "targets")}

    def example_batch(batch_size: int) -> dict[str, np.ndarray]:
        tokens = np.random.default_rng(0).integers(0, vocab_size, (batch_size, seq_len + 1))
        return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}

    return batch_spec, example_batch


def logits_fn(module: Any) -> Callable[[Any, Any], Any]:
    """(params, tokens [b, T]) -> fp32 logits [b, T, vocab] of a Linen language model."""
    return lambda params, tokens: module.apply({"params": params}, tokens)


def from_section(section: ModelConfig, sizes: dict[str, Any], remat: str, positive: tuple[str, ...]) -> Any:
    """The preset ``section.size`` of ``sizes`` with the section's other keys (those the preset
    has) overriding it, and ``remat``; ConfigError naming the key for an unknown size or a
    non-positive ``positive`` field, or one the model does not have."""
    if section.size not in sizes:
        raise ConfigError(f"jzero.model.size: unknown size '{section.size}'; valid: {', '.join(sizes)}")
    preset = sizes[section.size]
    names = {f.name for f in dataclasses.fields(preset)}
    given = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
             if f.name not in ("name", "size") and getattr(section, f.name) is not None}
    for key in given:
        if key not in names:
            raise ConfigError(f"jzero.model.{key}: the {section.name} model has no such setting; "
                              f"valid: {', '.join(sorted(names - {'remat'}))}")
    cfg = dataclasses.replace(preset, remat=remat, **given)
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"jzero.model.{key}: must be >= 1, got {getattr(cfg, key)}")
    if hasattr(cfg, "n_heads") and cfg.d_model % cfg.n_heads:
        raise ConfigError(f"jzero.model.n_heads: {cfg.n_heads} does not divide d_model {cfg.d_model}")
    return cfg

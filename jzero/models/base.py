"""`Model`: what the engine, `jzero estimate`, autotune and profile need from a reference model."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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

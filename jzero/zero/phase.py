"""Training or evaluation: what a layer whose forward differs between them reads while tracing.

DeepSpeed's modules follow torch's ``model.train()`` / ``model.eval()``; a jitted JAX function
has no such state, so the step declares the phase while it traces: `jzero.train_step` traces
in training (the default, as torch's modules start), `jzero.eval_step` and sampling under
`evaluating`. The MoE gate reads it (``eval_capacity_factor``, no gate noise in evaluation).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("jzero_training", default=True)


@contextlib.contextmanager
def evaluating() -> Iterator[None]:
    """While tracing, layers compute their evaluation forward."""
    token = _TRAINING.set(False)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def training() -> bool:
    return _TRAINING.get()

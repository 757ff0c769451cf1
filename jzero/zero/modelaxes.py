"""Where activations live on the model axes: the few constraints that make the compiler's
collectives Megatron's and Ulysses', set by the step while it traces the loss.

The step's ``shard_map`` is manual over the data axes only when the model is split
(`jzero.zero.mesh.manual_axes`): "sequence" and "tensor" belong to the compiler, which follows
the params' specs (`jzero.zero.autotp`) and these constraints on a layer's activations:

    where                       | layout                                   | what it makes
    ----------------------------+------------------------------------------+--------------------------
    residual stream [b, T, d]   | T over "sequence" (and "tensor" under    | Ulysses: every op but
      (`residual`)              | ``jzero.mesh.megatron_sequence_parallel``) | attention on local tokens
    sublayer input (`gathered`) | whole tokens over "tensor"               | Megatron-SP's all-gather
    column output (`hidden`)    | features over "tensor"                   | the row matmul's input;
                                |                                          | after it, a reduce-scatter
    attention q, k, v (`heads`) | heads over ("tensor", "sequence"),       | Ulysses' all-to-alls in
      and out (`tokens`)        | T whole; then T back over "sequence"     | and out; local heads

Outside the step (inference, a plain ``apply``) nothing is active and every function here is the
identity. Heads the split does not divide are left to the compiler (the config check refuses
them for the GPT: `jzero.models.gpt.gpt_config`).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jzero.zero.mesh import SEQUENCE, TENSOR


class ModelAxes(NamedTuple):
    """The model axes' sizes and whether the tensor group also splits the residual's tokens."""

    sequence: int = 1
    tensor: int = 1
    megatron_sp: bool = False

    def token_axes(self) -> tuple[str, ...]:
        """The axes a residual stream's tokens are split over."""
        return ((SEQUENCE,) if self.sequence > 1 else ()) + ((TENSOR,) if self.megatron_sp and self.tensor > 1 else ())


_ACTIVE: contextvars.ContextVar[ModelAxes | None] = contextvars.ContextVar("jzero_model_axes", default=None)


@contextlib.contextmanager
def active(axes: ModelAxes | None) -> Iterator[None]:
    """Make ``axes`` the model axes while tracing (None or trivial axes: no constraints)."""
    trivial = axes is None or (axes.sequence == 1 and axes.tensor == 1)
    token = _ACTIVE.set(None if trivial else axes)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> ModelAxes | None:
    return _ACTIVE.get()


def keeping(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced under the model axes active now, whenever it is traced: a custom VJP's
    backward (a remat's recompute) is traced after the step has left the loss, and its
    activations would otherwise lose their layout (the recomputed layer whole on every device)."""
    axes = current()
    if axes is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with active(axes):
            return fn(*args, **kwargs)

    return run


def _constrain(x: jax.Array, *entries) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, P(*entries))


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def residual(x: jax.Array) -> jax.Array:
    """A ``[b, T, d]`` residual stream with its tokens on the token axes (identity when none)."""
    axes = current()
    if axes is None or not axes.token_axes() or x.shape[1] % (axes.sequence * (axes.tensor if axes.megatron_sp
                                                                                  else 1)):
        return x
    return _constrain(x, None, _entry(axes.token_axes()), None)


def gathered(x: jax.Array) -> jax.Array:
    """A sublayer's ``[b, T, d]`` input with whole tokens over the tensor group (still split over
    "sequence"): Megatron-SP's all-gather, placed before the column matmuls (identity without it)."""
    axes = current()
    if axes is None or not (axes.megatron_sp and axes.tensor > 1):
        return x
    return _constrain(x, None, SEQUENCE if axes.sequence > 1 and x.shape[1] % axes.sequence == 0 else None, None)


def hidden(x: jax.Array) -> jax.Array:
    """A column matmul's ``[b, T, f]`` output with its features over "tensor" (and tokens over
    "sequence"): what the row matmul after it reads (identity without tensor parallelism)."""
    axes = current()
    if axes is None or axes.tensor == 1 or x.shape[-1] % axes.tensor:
        return x
    seq = SEQUENCE if axes.sequence > 1 and x.shape[1] % axes.sequence == 0 else None
    return _constrain(x, None, seq, *([None] * (x.ndim - 3)), TENSOR)


def heads(x: jax.Array, axis: int = 2) -> jax.Array:
    """``[b, T, ..., h, d]`` (heads at ``axis``) with whole sequences and the heads over
    ("tensor", "sequence"): from token shards, the all-to-all of DeepSpeed-Ulysses (identity when
    the model is not split or h does not divide)."""
    axes = current()
    if axes is None or x.shape[axis] % (axes.sequence * axes.tensor):
        return x
    split = tuple(a for a, n in ((TENSOR, axes.tensor), (SEQUENCE, axes.sequence)) if n > 1)
    entries = [None] * x.ndim
    entries[axis] = _entry(split)
    return _constrain(x, *entries)


def tokens(x: jax.Array, axis: int = 2) -> jax.Array:
    """``[b, T, ..., h, d]`` on token shards over "sequence", the heads (at ``axis``) over
    "tensor": where Ulysses' q, k and v come from and its output goes back to (identity without
    sequence parallelism)."""
    axes = current()
    if axes is None or axes.sequence == 1 or x.shape[1] % axes.sequence or x.shape[axis] % axes.tensor:
        return x
    entries = [None] * x.ndim
    entries[1], entries[axis] = SEQUENCE, TENSOR if axes.tensor > 1 else None
    return _constrain(x, *entries)

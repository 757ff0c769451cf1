"""Where activations live on the model axes: the few constraints that make the compiler's
collectives Megatron's and Ulysses', set by the step while it traces the loss.

The step's ``shard_map`` is manual over the data axes only when the model is split
(`jzero.zero.mesh.manual_axes`): "sequence" and "tensor" belong to the compiler, which follows
the params' specs (`jzero.zero.autotp`) and these constraints on a layer's activations:

    where                    | layout                                      | what it makes
    -------------------------+---------------------------------------------+------------------------------
    residual stream [b,T,d]  | T over "sequence" (and "tensor" with        | Ulysses: every op but attention
      (`residual`)           | ``jzero.mesh.megatron_sequence_parallel``)  | on the local tokens; Megatron-SP:
                             |                                             | all-gather before qkv / fc,
                             |                                             | reduce-scatter after proj / out
    attention q, k, v, out   | heads over ("tensor", "sequence"), T whole  | Ulysses' all-to-all in (q, k, v)
      (`heads`)              | then back to T over "sequence" (`tokens`)   | and out; tensor: local heads

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

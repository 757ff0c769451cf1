"""Per-layer ZeRO hooks inside the scanned layer stack (docs/design.md, "Per-layer hooks"): the
collectives of stages 2-3 written out explicitly, because GSPMD left to itself gathers
activations instead of weights, keeps fp32 on the wire, and reduces full gradients where a
reduce-scatter is due.

While the jzero step traces the loss at stages 2-3 it activates a `HookContext`; `scan_layers`
then runs each layer under ``jax.shard_map`` over the data axes (activations stay batch-sharded,
each device computes its local slice) and feeds the block its params through one of three
custom-VJP hooks, chosen per leaf by the ZeRO table (`jzero.sharding.leaf_specs`):

* ``gather`` (stored sharded, stage 3): all-gather the shard over "fsdp" in the compute dtype,
  moved as its raw 16-bit pattern so no backend can widen it; backward: reduce-scatter the
  gradient over "fsdp" (then sum over "replica") in the communication dtype (fp32 unless
  ``communication_data_type`` says otherwise), back to fp32 after.
* ``sink`` (stored replicated, gradient sharded: stage 2, or stage-3 persistent params): use the
  local replica; backward: the same reduce-scatter into the gradient's shard.
* ``replicate`` (nothing divisible): use the local replica; backward: all-reduce (communication dtype).

``communication_data_type`` governs these collectives only. Params outside the stack (and every
param at stage 0) are reduced where GSPMD places the reduction: at the matmul that produces the
gradient, in that matmul's dtype (the compute dtype), whatever a later cast asks for.

The layer body is rematerialized with a policy that never saves a hook's output, so a gathered
layer is dropped after use and gathered again for the backward pass (stage 3 moves 3Ψ).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import DATA_AXES
from jzero.sharding import FSDP, LeafSpecs, leaf_specs

REPLICA = DATA_AXES[0]


@dataclass(frozen=True)
class HookContext:
    mesh: Mesh
    stage: int
    persistence_threshold: int
    compute_dtype: Any
    comm_dtype: Any = jnp.float32  # gradients are reduced in this dtype (communication_data_type)


_ACTIVE: contextvars.ContextVar[HookContext | None] = contextvars.ContextVar("jzero_hooks", default=None)


@contextlib.contextmanager
def active(ctx: HookContext | None) -> Iterator[None]:
    """Make ``ctx`` the hook context while tracing (None: no hooks)."""
    token = _ACTIVE.set(ctx)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> HookContext | None:
    return _ACTIVE.get()


def fsdp_dim(spec: P) -> int | None:
    """The dimension a spec shards over "fsdp" (None: not sharded over it)."""
    return next((d for d, axis in enumerate(spec) if axis == FSDP), None)


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Type a value that is the same on every device of ``axes`` as varying over them, so its
    cotangent reaches the hook's backward unreduced (instead of through an automatic psum)."""
    return jax.lax.pcast(x, axes, to="varying")


def _to_wire(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _from_wire(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


def reduce_scatter(ct: jax.Array, dim: int, comm: Any) -> jax.Array:
    """Sum the local gradients in ``comm``: scatter inside the ZeRO group, then add across
    replicas (a group of one device when replica = 1: no data moves); fp32 after."""
    shard = jax.lax.psum_scatter(ct.astype(comm), FSDP, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(shard, REPLICA).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather(shard: jax.Array, dim: int, dtype: Any, comm: Any) -> jax.Array:
    full = jax.lax.all_gather(_to_wire(shard.astype(dtype)), FSDP, axis=dim, tiled=True)
    return _varying(_from_wire(full, dtype), (REPLICA,))  # all_gather output already varies over fsdp


def _gather_fwd(shard, dim, dtype, comm):
    return gather(shard, dim, dtype, comm), None


def _gather_bwd(dim, dtype, comm, _, ct):
    return (reduce_scatter(ct, dim, comm),)


gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def sink(replica: jax.Array, shard: jax.Array, dim: int, dtype: Any, comm: Any) -> jax.Array:
    return _varying(replica.astype(dtype), DATA_AXES)


def _sink_fwd(replica, shard, dim, dtype, comm):
    return sink(replica, shard, dim, dtype, comm), None


def _sink_bwd(dim, dtype, comm, _, ct):
    return None, reduce_scatter(ct, dim, comm)


sink.defvjp(_sink_fwd, _sink_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def replicate(replica: jax.Array, dtype: Any, comm: Any) -> jax.Array:
    return _varying(replica.astype(dtype), DATA_AXES)


def _replicate_fwd(replica, dtype, comm):
    return replicate(replica, dtype, comm), None


def _replicate_bwd(dtype, comm, _, ct):
    return (jax.lax.psum(ct.astype(comm), DATA_AXES).astype(jnp.float32),)


replicate.defvjp(_replicate_fwd, _replicate_bwd)


def _never_save_hooks(base: Callable | None) -> Callable:
    """``base`` remat policy, except that no custom-VJP output (the hooks') is ever saved."""
    def policy(prim, *args, **params):
        if prim.name.startswith("custom_vjp_call"):
            return False
        return True if base is None else base(prim, *args, **params)

    return policy


def _leaf_hook(shape: tuple[int, ...], ctx: HookContext, n: int) -> tuple[str, int | None, P]:
    """(hook, fsdp dim, input spec) of one stacked leaf, from its row of the ZeRO table (per layer):
    stored sharded -> "gather"; replicated with a sharded gradient -> "sink"; else "replicate"."""
    full = leaf_specs(shape, ctx.stage, n, ctx.persistence_threshold, stacked=True)
    layer = LeafSpecs(*(P(*spec[1:]) for spec in full))
    if (dim := fsdp_dim(layer.params)) is not None:
        return "gather", dim, layer.params
    if (dim := fsdp_dim(layer.grads)) is not None:
        return "sink", dim, layer.grads
    return "replicate", None, P()


def scan(ctx: HookContext, apply_layer: Callable, policy: Callable | None, x: Any, stacked: Any,
         extra: Any) -> Any:
    """``lax.scan`` of ``apply_layer(layer_params, carry, layer_extra)`` over the stacked layers,
    one layer per device under ``shard_map`` with the hooks above, chosen per leaf from the ZeRO
    table for the stacked leaf. Each leaf's per-layer view is laid out before the loop, so GSPMD
    has nothing to re-gather inside it."""
    n = ctx.mesh.shape[FSDP]
    checkpoint_policy = _never_save_hooks(policy)
    leaves, treedef = jax.tree.flatten(stacked)
    plans = [_leaf_hook(leaf.shape, ctx, n) for leaf in leaves]  # each leaf classified once
    inputs, in_specs = [], []

    def pinned(v: jax.Array, spec: P) -> jax.Array:
        return jax.lax.with_sharding_constraint(v, NamedSharding(ctx.mesh, P(None, *spec)))

    for leaf, (kind, _, spec) in zip(leaves, plans, strict=True):
        if kind == "sink":  # the replicated value for the forward pass, the shard that takes the gradient
            inputs += [pinned(jax.lax.stop_gradient(leaf), P()), pinned(leaf, spec)]
            in_specs += [P(), spec]
        else:
            inputs.append(pinned(leaf, spec))
            in_specs.append(spec)
    apply_hook = {
        "gather": lambda it, dim: gather(next(it), dim, ctx.compute_dtype, ctx.comm_dtype),
        "sink": lambda it, dim: sink(next(it), next(it), dim, ctx.compute_dtype, ctx.comm_dtype),
        "replicate": lambda it, dim: replicate(next(it), ctx.compute_dtype, ctx.comm_dtype),
    }

    def local(carry, layer_extra, *layer_inputs):
        it = iter(layer_inputs)
        ws = [apply_hook[kind](it, dim) for kind, dim, _ in plans]
        return apply_layer(jax.tree.unflatten(treedef, ws), carry, layer_extra)

    local = jax.checkpoint(local, policy=checkpoint_policy, prevent_cse=False)

    def body(carry, xs):
        layer_extra, layer_inputs = xs
        carry_specs = jax.tree.map(lambda _: P(DATA_AXES), carry)
        extra_specs = jax.tree.map(lambda _: P(), layer_extra)
        out = jax.shard_map(local, mesh=ctx.mesh, in_specs=(carry_specs, extra_specs, *in_specs),
                            out_specs=carry_specs)(carry, layer_extra, *layer_inputs)
        return out, None

    return jax.lax.scan(body, x, (extra, tuple(inputs)))[0]

"""ZeRO's collectives written out explicitly (docs/design.md, "Per-layer hooks"): GSPMD left to
itself gathers activations instead of weights, keeps fp32 on the wire, and all-reduces full
gradients where a reduce-scatter is due.

At stages 2-3 the jzero step computes every micro-batch's gradient under one ``jax.shard_map``
over the data axes (`jzero.train.step`): each device runs the model on its own rows and differentiates
with respect to its *target*, the param's local view in the reduced-gradient layout
(``Plan.grads``). `bind` turns the stored params and the targets into the tree the model sees,
each leaf through one of three hook kinds chosen by the ZeRO table (`hook_kind`), whose backward
is `reduce` as the leaf's gradient layout says (`reduction`):

* ``gather`` (stored sharded, stage 3): all-gather the shard over its ZeRO group in the compute
  dtype, moved as its raw 16-bit pattern so no backend can widen it; backward: reduce-scatter
  the gradient over the group (then sum over "replica") in the communication dtype (fp32 unless
  ``communication_data_type`` says otherwise), back to fp32 after.
* ``sink`` (stored replicated, gradient sharded: stage 2, or stage-3 persistent params): use the
  local replica; backward: the same reduce-scatter into the target shard.
* ``replicate`` (nothing divisible): use the local replica; backward: all-reduce.

One custom VJP (`hook`) serves every leaf of a layer (and, once, every leaf outside the
stacks), so a layer's gradients leave in one bucket per reduction (`jzero.zero.buckets`), not
one collective per leaf; frozen leaves get a hook of their own, whose backward never runs.

The ZeRO group is "fsdp" (with "expert" for non-expert leaves under MoE); an expert leaf's
gradient is never summed over "expert" (`jzero.zero.sharding`: each device's experts are its own).
Under ZeRO++ (`Wire`: ``zero_quantized_weights`` / ``_gradients``) the gather and the
reduce-scatter move int8 blocks instead (`jzero.zero.zeropp`).

Leaves outside a layer stack are hooked once, before the model runs. Leaves of a `scan_layers`
stack are hooked per layer inside the scan (`scan`), so a gathered layer lives for one layer
only and a full gradient never exists: `bind` hands the model the stacked leaf (the stored
replica, or a placeholder of the gathered shape at stage 3, never materialized) and records, by the
leaf's identity, what the scan needs. The layer body is rematerialized with a policy that never
saves a hook's output, so a gathered layer is gathered again for the backward pass (stage 3
moves 3 Psi).

Stages 0-1 reduce once per step, so their stacks need no collective; under gradient
accumulation `bind_accumulators` gives each stack its slice of the fp32 accumulator instead,
and `accumulate_stack` adds each layer's gradient into it in place (one gradient buffer, as
torch's in-place ``.grad`` gives DeepSpeed).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.zero import bits, buckets, dots, modelaxes, remat, zeropp
from jzero.zero.mesh import DATA_AXES, FSDP, live, model_spec, on_model_blocks
from jzero.zero.sharding import is_stacked


class Reduce(NamedTuple):
    """How a leaf's gradient is summed over the data devices, read from its layout (`reduction`):
    reduce-scattered along ``dim`` over the ``scatter`` axes (None: not scattered), then summed
    over the ``over`` axes (the data axes the layout does not name)."""
    dim: int | None
    scatter: tuple[str, ...]
    over: tuple[str, ...]
    model: P = P()  # the leaf's split over the model axes (`jzero.zero.mesh.MODEL_AXES`), if any

    def layer(self) -> "Reduce":
        """The same reduction for one layer of a stacked leaf (its leading dim dropped)."""
        model = P(*tuple(self.model)[1:])
        return self._replace(model=model) if self.dim is None else self._replace(dim=self.dim - 1, model=model)


class LeafHook(NamedTuple):
    """A leaf's hook (`hook_kind`), how its gradient is reduced, and whether it is frozen (it
    gets no gradient, so it stays out of the others' bucket)."""
    kind: str
    reduce: Reduce
    frozen: bool = False


def leaf_hooks(stored: Any, grads: Any, frozen: Any = None) -> Any:
    """A `LeafHook` per leaf from its stored and reduced-gradient layouts (the Plan's) and the
    ``frozen`` mask (`jzero.zero.groups.frozen_mask`; None: nothing frozen)."""
    frozen = jax.tree.map(lambda _: False, stored) if frozen is None else frozen
    return jax.tree.map(lambda s, g, f: LeafHook(hook_kind(s, g), reduction(g.spec), f), stored, grads, frozen)


class Bound(NamedTuple):
    """What `scan` needs of one stacked leaf: its hook, the reduction of one layer and the hook's
    inputs (stacked)."""
    kind: str
    reduce: Reduce | None
    inputs: tuple[jax.Array, ...]
    frozen: bool = False


class Wire(NamedTuple):
    """What the hooks move: params in the ``compute`` dtype (int8 blocks of ``weights`` elements
    under ZeRO++'s qwZ), gradients reduced in ``comm`` (int8 blocks of ``grads`` elements under
    qgZ; `jzero.zero.zeropp`)."""
    compute: Any
    comm: Any = jnp.float32
    weights: int | None = None
    grads: int | None = None
    unfold: bool = False  # keep weight-gradient dots out of XLA:CPU's slow form (`jzero.zero.dots`)
    leafwise: bool = False  # the model axes are the compiler's: reduce leaf by leaf, never flattened
    native: bool = False  # TPU: every leaf moves as it is, in its dtype (`buckets.rows_are_free`)


@dataclass(frozen=True, eq=False)
class HookContext:
    wire: Wire  # what the hooks move, in which dtypes
    on_host: bool = False  # stored values live in host memory (offload_param): each hook brings its own
    bound: dict[int, tuple[jax.Array, Bound]] = field(default_factory=dict)  # id(model's leaf) -> hooks
    used: set[int] = field(default_factory=set)  # ids of bound leaves a layer stack consumed


class StackedOutsideScan(ValueError):
    """A loss read params under a "stacked" key other than through `scan_layers`."""


def check_used(ctx: HookContext) -> None:
    """`StackedOutsideScan` unless every bound stacked leaf reached a layer stack: one the model
    used any other way would get no gradient (or, at stage 3, a placeholder)."""
    if set(ctx.bound) - ctx.used:
        raise StackedOutsideScan("params under a 'stacked' key must be used through jzero.scan_layers inside the loss: "
                         "at ZeRO stages 2-3 (and 0-1 with gradient accumulation) the step hands them to the "
                         "layer stack's hooks, not to other code")


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


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def fsdp_dim(spec: P) -> int | None:
    """The dimension a spec shards over its ZeRO group (None: not sharded over it)."""
    return next((d for d, entry in enumerate(spec) if FSDP in _axes(entry)), None)


def reduction(spec: P) -> Reduce:
    """The `Reduce` of a gradient laid out as ``spec``."""
    dim = fsdp_dim(spec)
    named = {a for entry in spec for a in _axes(entry)}
    return Reduce(dim, () if dim is None else _axes(spec[dim]), tuple(a for a in DATA_AXES if a not in named),
                  model_spec(spec))


def hook_kind(stored: NamedSharding, grads: NamedSharding) -> str:
    """A leaf's hook from its stored and reduced-gradient layouts (the Plan's)."""
    if fsdp_dim(stored.spec) is not None:
        return "gather"
    return "sink" if fsdp_dim(grads.spec) is not None else "replicate"


def vary(x: jax.Array) -> jax.Array:
    """Type ``x`` as varying over every data axis (those it does not vary over yet), so its
    cotangent reaches the hook's backward unreduced (instead of through an automatic psum)."""
    missing = tuple(a for a in live(DATA_AXES) if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def reduce(cts: Sequence[jax.Array], reds: Sequence[Reduce], wire: Wire) -> list[jax.Array]:
    """Sum each device's local gradients over the data devices, as their ``reds`` say: scatter
    inside the ZeRO group, then add over the other axes (a trivial axis moves no data), in the
    wire's communication dtype, the leaves that share a reduction as one bucket
    (`jzero.zero.buckets`), or as int8 blocks (qgZ) where the chunks are whole blocks; fp32."""
    out: list[Any] = [None] * len(cts)
    shared: dict[tuple, list[int]] = {}
    for i, (ct, red) in enumerate(zip(cts, reds, strict=True)):
        if zeropp.can_reduce(ct, red.dim, red.scatter, wire.grads):
            out[i] = zeropp.reduce_scatter(ct, red.dim, red.scatter, red.over, wire.grads, wire.comm)
        else:
            shared.setdefault((red.dim is None, red.scatter, red.over), []).append(i)
    for (whole, scatter, over), idx in shared.items():
        gs = [cts[i].astype(wire.comm) for i in idx]
        dims = [reds[i].dim for i in idx]
        if (wire.leafwise or wire.native) and not whole:
            summed = [on_model_blocks(functools.partial(buckets.reduce_scatter_each, dims=[d], scatter=scatter,
                                                        over=over), reds[i].model)([g])[0]
                      for g, d, i in zip(gs, dims, idx, strict=True)]
        else:
            summed = (buckets.all_reduce(gs, over) if whole else buckets.reduce_scatter(gs, dims, scatter, over))
        for i, g in zip(idx, summed, strict=True):
            out[i] = g.astype(jnp.float32)
    return out


HOOK = "jzero_hook"  # the name on every hook's output: remat never saves it (`_never_save_hooks`)


# The hook takes (values, targets): ``values`` are what the forward uses (the stored shards or
# replicas, never differentiated), ``targets`` what receive the reduced gradients (fp32, in the
# reduced-gradient layout; their values are never read).

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def hook(values: tuple, targets: tuple, kinds: tuple[str, ...], reds: tuple[Reduce, ...], wire: Wire) -> tuple:
    """The compute-dtype values the model uses, each through its ``kinds`` hook; backward:
    their gradients reduced together (`reduce`: one bucket per reduction)."""
    return tuple(_use(v, kind, red, wire) for v, kind, red in zip(values, kinds, reds, strict=True))


def _use(value: jax.Array, kind: str, red: Reduce, wire: Wire) -> jax.Array:
    """``gather``: the full param from its ZeRO shard, moved as its raw 16-bit pattern, or as
    int8 blocks (qwZ); ``sink`` / ``replicate``: the local replica; in the compute dtype."""
    if kind != "gather":
        full = value.astype(wire.compute)
    elif zeropp.can_gather(value, wire.weights):
        full = zeropp.gather(value, red.dim, red.scatter, wire.compute, wire.weights)
    elif wire.native:
        full = on_model_blocks(lambda x: jax.lax.all_gather(x, red.scatter, axis=red.dim, tiled=True),
                               red.model)(value.astype(wire.compute))
    else:
        moved = on_model_blocks(lambda x: jax.lax.all_gather(x, red.scatter, axis=red.dim, tiled=True),
                                red.model)(bits.raw(value.astype(wire.compute)))
        full = bits.restored(moved, wire.compute)
    return checkpoint_name(vary(full), HOOK)


def _hook_fwd(values, targets, kinds, reds, wire):
    return hook(values, targets, kinds, reds, wire), None


def _hook_bwd(kinds, reds, wire, _, cts):
    if wire.unfold:
        cts = [dots.unfold(ct) for ct in cts]
    return tuple(None for _ in cts), tuple(reduce(cts, reds, wire))


hook.defvjp(_hook_fwd, _hook_bwd)


def _apply(ctx: HookContext, kinds: Sequence[str], reds: Sequence[Reduce], frozen: Sequence[bool],
           inputs: Sequence[tuple[jax.Array, jax.Array]]) -> list[jax.Array]:
    """The compute-dtype values the model uses, through one `hook` for the trained leaves and
    one for the frozen (whose gradients are never computed, so never reduced)."""
    out: list[Any] = [None] * len(inputs)
    for group in (False, True):
        idx = [i for i, f in enumerate(frozen) if f == group]
        if not idx:
            continue
        values = [inputs[i][0] for i in idx]
        if ctx.on_host:  # one layer's (or the loose leaves') shards to the device, right before use
            values = [jax.device_put(v, jax.memory.Space.Device) for v in values]
        used = hook(tuple(values), tuple(inputs[i][1] for i in idx), tuple(kinds[i] for i in idx),
                    tuple(reds[i] for i in idx), ctx.wire)
        for i, u in zip(idx, used, strict=True):
            out[i] = u
    return out


def _gathered(shape: tuple[int, ...], red: Reduce) -> tuple[int, ...]:
    """The shape `gather` makes of a shard of ``shape`` (an expert leaf stays split over "expert")."""
    size = math.prod(jax.lax.axis_size(a) for a in red.scatter)
    return tuple(n * size if d == red.dim else n for d, n in enumerate(shape))


def bind(ctx: HookContext, hooked: Any, stored: Any, targets: Any) -> Any:
    """The params tree the model sees inside the step's ``shard_map``: leaves outside a stack
    through one hook (compute dtype); stacked leaves as themselves (or a gathered-shape
    placeholder at stage 3), recorded in ``ctx.bound`` for `scan`. ``hooked``: `leaf_hooks`;
    ``stored`` / ``targets``: each device's views in the stored / reduced-gradient layouts."""
    paths_hooks, treedef = jax.tree_util.tree_flatten_with_path(hooked, is_leaf=lambda x: isinstance(x, LeafHook))
    leaves, loose = [], []
    for i, ((path, (kind, red, frozen)), value, target) in enumerate(
            zip(paths_hooks, treedef.flatten_up_to(stored), treedef.flatten_up_to(targets), strict=True)):
        inputs = (jax.lax.stop_gradient(value), target)
        if not is_stacked(path):
            leaves.append(None)
            loose.append((i, kind, red, frozen, inputs))
            continue
        leaf = jnp.zeros(_gathered(value.shape, red), value.dtype) if kind == "gather" else value
        ctx.bound[id(leaf)] = (leaf, Bound(kind, red.layer(), inputs, frozen))
        leaves.append(leaf)
    if loose:
        idx, kinds, reds, frozen, inputs = zip(*loose, strict=True)
        for i, used in zip(idx, _apply(ctx, kinds, reds, frozen, inputs), strict=True):
            leaves[i] = used
    return treedef.unflatten(leaves)


def bind_accumulators(ctx: HookContext, params: Any, accs: Any) -> Any:
    """Stages 0-1 with accumulation: the params tree the model sees, leaves outside a stack cast
    to the compute dtype, stacked leaves as themselves, recorded in ``ctx.bound`` with their fp32
    accumulator for `scan` (see `accumulate_stack`)."""
    def one(path, p, acc):
        if not is_stacked(path):
            return p.astype(ctx.wire.compute) if jnp.issubdtype(p.dtype, jnp.floating) else p
        ctx.bound[id(p)] = (p, Bound("accumulate", None, (p, acc)))
        return p

    return jax.tree_util.tree_map_with_path(one, params, accs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def accumulate_stack(layer: Callable, x: Any, ws: Any, extra: Any, accs: Any) -> Any:
    """``lax.scan`` of ``layer(w, h, e)`` over the stacked ``ws`` / ``extra``, whose backward adds
    each layer's weight gradient into ``accs`` in place, layer by layer, and returns the result
    as the cotangent of ``accs`` (``accs`` + the gradient: the running sum over micro-batches);
    ``ws`` gets none. No full gradient buffer besides the accumulator ever exists. Each layer's
    forward is recomputed in the backward from its saved input (the "full" remat policy; 16-bit
    floats saved as raw bits, as `jzero.zero.remat.full` does)."""
    return _stack_forward(layer, x, ws, extra)[0]


def _stack_forward(layer, x, ws, extra):
    def body(h, xs):
        return layer(xs[0], h, xs[1]), h

    return jax.lax.scan(body, x, (ws, extra))


def _accumulate_fwd(layer, x, ws, extra, accs):
    out, inputs = _stack_forward(layer, x, ws, extra)
    return out, (ws, extra, jax.tree.map(bits.raw, inputs), accs)


def _accumulate_bwd(layer, res, ct):
    ws, extra, inputs, accs = res

    def body(carry, xs):
        ct_h, accs = carry
        w, e, h, i = xs
        h = jax.tree.map(lambda v, c: bits.restored(v, c.dtype), h, ct_h)
        _, pull = jax.vjp(lambda w, h: layer(w, h, e), w, h)
        ct_w, ct_h = pull(ct_h)
        accs = jax.tree.map(lambda a, g: a.at[i].add(g.astype(a.dtype)), accs, ct_w)
        return (ct_h, accs), None

    n = jax.tree.leaves(ws)[0].shape[0]
    (ct_x, accs), _ = jax.lax.scan(body, (ct, accs), (ws, extra, inputs, jnp.arange(n)), reverse=True)
    return ct_x, None, None, accs


accumulate_stack.defvjp(_accumulate_fwd, _accumulate_bwd)


def _is_hook(prim: Any, params: dict) -> bool:
    """Whether ``prim`` is a hook's custom VJP: its forward carries the `HOOK` name."""
    if not prim.name.startswith("custom_vjp_call"):
        return False
    return any(e.primitive.name == "name" and e.params.get("name") == HOOK for e in params["call_jaxpr"].jaxpr.eqns)


def _never_save_hooks(base: Callable | None) -> Callable:
    """``base`` remat policy, except that no hook's output (a gathered or cast param) is ever saved."""
    def policy(prim, *args, **params):
        if _is_hook(prim, params):
            return False
        return True if base is None else base(prim, *args, **params)

    return policy


def _lookup(ctx: HookContext, leaf: jax.Array) -> Bound:
    entry = ctx.bound.get(id(leaf))  # the entry keeps its leaf alive, so the id is not reused
    ctx.used.add(id(leaf))
    if entry is None:
        raise ValueError("scan_layers: a stacked param reached the layer stack changed (cast, sliced or "
                         "rebuilt) inside the loss; under the jzero step pass the stacked params to "
                         "scan_layers as the step gives them")
    return entry[1]


def scan(ctx: HookContext, apply_layer: Callable, policy: Callable | None, x: Any, stacked: Any,
         extra: Any) -> Any:
    """``lax.scan`` of ``apply_layer(layer_params, carry, layer_extra)`` over the stacked layers,
    each layer's params through the hooks `bind` recorded for its leaves."""
    leaves, treedef = jax.tree.flatten(stacked)
    bound = [_lookup(ctx, leaf) for leaf in leaves]
    if bound and all(b.kind == "accumulate" for b in bound):
        return _accumulating_scan(ctx, apply_layer, policy, x, treedef, bound, extra)

    def local(carry, layer_extra, layer_inputs):
        ws = _apply(ctx, [b.kind for b in bound], [b.reduce for b in bound], [b.frozen for b in bound], layer_inputs)
        return apply_layer(jax.tree.unflatten(treedef, ws), carry, layer_extra)

    local = remat.full(local) if policy is remat.FULL else jax.checkpoint(
        local, policy=_never_save_hooks(policy), prevent_cse=False)

    def body(carry, xs):
        return local(carry, *xs), None

    return jax.lax.scan(body, x, (extra, tuple(b.inputs for b in bound)))[0]


def _accumulating_scan(ctx: HookContext, apply_layer: Callable, policy: Callable | None, x: Any, treedef: Any,
                       bound: list[Bound], extra: Any) -> Any:
    """The stack of `bind_accumulators`: under the "full" remat policy `accumulate_stack` (the
    gradient goes into the accumulator layer by layer); under another policy, which saves
    activations the recomputing backward could not use, a plain scan whose stacked gradient is
    added to the accumulator after it (one more full gradient, transient)."""
    ws, accs = [b.inputs[0] for b in bound], [b.inputs[1] for b in bound]

    def layer(ws, h, e):
        return apply_layer(jax.tree.unflatten(treedef, [w.astype(ctx.wire.compute) for w in ws]), h, e)

    if policy is remat.FULL:
        return accumulate_stack(modelaxes.keeping(layer), x, ws, extra, accs)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    return _stack_forward(layer, x, _add_into(ws, accs), extra)[0]


@jax.custom_vjp
def _add_into(ws: Any, accs: Any) -> Any:
    """``ws``; backward: no cotangent for ``ws``, ``accs`` + the gradient for ``accs`` (the
    contract of `accumulate_stack`, without its in-place saving)."""
    return ws


def _add_into_fwd(ws, accs):
    return ws, accs


def _add_into_bwd(accs, ct):
    return None, jax.tree.map(lambda a, g: a + g.astype(a.dtype), accs, ct)


_add_into.defvjp(_add_into_fwd, _add_into_bwd)


def add_gradients(accs: Any, grads: Any, acc_grads: Any) -> Any:
    """The accumulator after one micro-batch: for stacked leaves bound by `bind_accumulators`
    the accumulator's own cotangent (already accumulator + gradient), for the rest acc + grad."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a, g, ga: ga if is_stacked(path) else a + g, accs, grads, acc_grads)

"""ZeRO stages as sharding rules: one table, read top to bottom, turned into a `Plan`.

A stage says which of the three model states are sharded over the mesh's "fsdp" axis, and when
gradients are reduced across devices (k micro-batches per step):

    stage | params (stored) | grads (reduced) | optimizer state | grads reduced       | comm per step
    ------+-----------------+-----------------+-----------------+---------------------+--------------
      0   | replicated      | replicated      | replicated      | once, at the end    | 2 Psi
      1   | replicated      | sharded         | sharded         | once, at the end    | 2 Psi
      2   | replicated      | sharded         | sharded         | every micro-batch   | (k + 1) Psi
      3   | sharded         | sharded         | sharded         | every micro-batch   | 3k Psi

"once, at the end": each device accumulates the fp32 gradients of its own rows, unreduced, over
the k micro-batches and they are reduced once (stage 0: all-reduce; stage 1: reduce-scatter into
the optimizer-state layout): least communication, one full fp32 gradient (4 B/param) transient.
"every micro-batch": each layer's gradient is reduce-scattered inside the backward pass, so a
full gradient never exists: least memory, k reductions. Pick stage 1 over 2 when the 4 B/param
fit; stage 2 when they do not. Model state (BatchNorm statistics: DeepSpeed's buffers) is
replicated at every stage and averaged over the data devices once per step
(`jzero.zero.modelstate`).

Which devices a leaf is sharded over (its ZeRO group), DeepSpeed-MoE's rule:

    leaf                                | expert dim     | ZeRO group (the "sharded" above)
    ------------------------------------+----------------+--------------------------------------
    non-expert                          | -              | ("fsdp", "expert"): all data devices
    expert (under an ``"experts"`` key) | over "expert"  | "fsdp": the expert-data-parallel group

An expert leaf's first dimension after the stacked-layer one counts the experts: each device
holds E / ep_size of them, and ZeRO shards them further over the devices that hold the same
experts. Gradients are summed over every data axis the leaf's layout does not name (an expert's
gradient never over "expert": each device's experts are its own).

A leaf a tensor group splits (`jzero.zero.autotp`: its "tensor" dimension) is ZeRO's like any
other, over the data devices, on what is left of it:

    leaf                                   | "tensor" dim   | stages 1-3 (where the table says "sharded")
    ---------------------------------------+----------------+-------------------------------------------
    column kernel [.., d_in, d_out]        | d_out          | the largest free dim over the ZeRO group
    row kernel / embedding [.., d_in, ..]  | d_in / vocab   | likewise (d_out / d_model)
    column bias [.., d_out]                | d_out          | none free: whole over the data devices
    LayerNorm, row bias, skipped           | -              | as without tensor parallelism

Each device so holds 1/(tensor x ZeRO group) of a split leaf, and ZeRO's collectives move only its
own block (`jzero.zero.mesh.on_model_blocks`). The sequence axis holds no params.

Leaf rule: shard the largest dimension divisible by the ZeRO group size, never the stacked-layer
dimension (leading dim of leaves under a ``"stacked"`` key, see `jzero.models.layers`), and keep any
dimension the model already partitions (tensor parallel, the expert dim). At stage 3, params
with fewer than ``stage3_param_persistence_threshold`` elements stay replicated (DeepSpeed's
persistent params); their grads and optimizer state are still sharded, as in DeepSpeed.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigWarning
from jzero.zero.mesh import DATA_AXES, EXPERT, FSDP, SEQUENCE

STACKED_KEY = "stacked"  # params under this key carry a leading stacked-layer dimension
EXPERT_KEY = "experts"  # params under this key carry an expert dimension (after the stacked one)
HOST_KINDS = ("pinned_host", "unpinned_host")  # JAX memory kinds of host memory
LARGE_REPLICATED = 2**20  # elements: optimizer state this large and replicated is worth a warning


class ZeroRule(NamedTuple):
    params: bool  # stored params sharded
    grads: bool  # reduced gradients sharded
    opt_state: bool  # optimizer state sharded
    reduce_once: bool  # gradients accumulated locally and reduced once per step (else per micro-batch)


ZERO_RULES: dict[int, ZeroRule] = {
    0: ZeroRule(params=False, grads=False, opt_state=False, reduce_once=True),
    1: ZeroRule(params=False, grads=True, opt_state=True, reduce_once=True),
    2: ZeroRule(params=False, grads=True, opt_state=True, reduce_once=False),
    3: ZeroRule(params=True, grads=True, opt_state=True, reduce_once=False),
}


@dataclass(frozen=True, eq=False)
class Plan:
    """Where every leaf lives. Trees of `NamedSharding` shaped like params / opt_state.

    ``params``: stored (fp32 master) params. ``compute``: the params forward and backward read
    (the stored layout of the ZeRO table; same as ``params`` unless the optimizer is offloaded).
    ``grads``: reduced gradients and the accumulator. ``update``: where the optimizer update runs
    (the opt-state layout of each param). ``opt_state``: optimizer state. ``batch``: leading
    (global batch) dim over all data axes. ``offload``: the host memory kind of the master
    params and optimizer state (None: device memory). ``model_state``: the model's
    non-parameter variables, replicated (None: the model has none). Compared and hashed by identity: it is
    static data of the jitted step.
    """

    mesh: Mesh
    stage: int
    params: Any
    compute: Any
    grads: Any
    update: Any
    opt_state: Any
    batch: NamedSharding
    replicated: NamedSharding
    offload: str | None = None
    model_state: Any = None

    @property
    def compute_on_host(self) -> bool:
        """Whether the compute params live in host memory (offload_param)."""
        return any(s.memory_kind in HOST_KINDS for s in jax.tree.leaves(self.compute))


def plan(params_shape: Any, tx: optax.GradientTransformation, mesh: Mesh, stage: int, *,
         persistence_threshold: int = 0, model_specs: Any = None, offload: str | None = None,
         offload_params: str | None = None, model_state_shape: Any = None) -> Plan:
    """The Plan for ``stage`` over ``mesh`` for params shaped like ``params_shape``.

    ``model_specs``: optional tree of PartitionSpecs the model already uses (tensor parallel);
    ZeRO keeps them and adds "fsdp" to a free dimension. ``offload``: host memory kind for the
    fp32 master params and the optimizer state (ZeRO-Offload: both in the update layout, the
    step updates them on the host); ``offload_params``: host memory kind for the compute params
    too (ZeRO-Infinity, stage 3). ``model_state_shape``: the model's state, if it has one.
    """
    if stage not in ZERO_RULES:
        raise ValueError(f"zero_optimization.stage: {stage} is not one of 0, 1, 2, 3")
    if model_specs is None:
        model_specs = jax.tree.map(lambda _: P(), params_shape)

    def one(path, x, base):
        expert = is_expert(path)
        base = expert_spec(x.shape, base, mesh.shape[EXPERT], stacked=is_stacked(path)) if expert else base
        axes = zero_axes(mesh, expert)
        return leaf_specs(x.shape, stage, math.prod(mesh.shape[a] for a in axes), persistence_threshold,
                          stacked=is_stacked(path), base=base, axes=axes)

    per_leaf = jax.tree_util.tree_map_with_path(one, params_shape, model_specs)

    def layout(field: str) -> Any:
        return jax.tree.map(lambda ls: NamedSharding(mesh, getattr(ls, field)), per_leaf,
                            is_leaf=lambda x: isinstance(x, LeafSpecs))

    def in_memory(tree: Any, kind: str | None) -> Any:
        return tree if kind is None else jax.tree.map(lambda s: s.with_memory_kind(kind), tree)

    update, compute = in_memory(layout("update"), offload), in_memory(layout("params"), offload_params)
    replicated = NamedSharding(mesh, P())
    opt_state = opt_state_layout(tx, params_shape, update, in_memory(replicated, offload))
    return Plan(mesh=mesh, stage=stage, params=compute if offload is None else update, compute=compute,
                grads=layout("grads"), update=update, opt_state=opt_state, batch=NamedSharding(mesh, batch_spec(mesh)),
                replicated=replicated, offload=offload,
                model_state=None if model_state_shape is None else jax.tree.map(lambda _: replicated,
                                                                                model_state_shape))


def batch_spec(mesh: Mesh) -> P:
    """A batch leaf's layout: examples over the data axes, tokens (the second dimension) over
    "sequence" when it is split (DeepSpeed-Ulysses)."""
    return P(DATA_AXES, SEQUENCE) if mesh.shape[SEQUENCE] > 1 else P(DATA_AXES)


def opt_state_layout(tx: optax.GradientTransformation, params_shape: Any, update: Any,
                     replicated: NamedSharding) -> Any:
    """Shardings of ``tx``'s state: a leaf shaped like its param takes the param's update layout
    (Adam's moments, Lion's momentum), anything else is replicated (counts, Adafactor's factored
    rows), with one warning when such leaves are large enough to matter."""
    loose = []

    def param_like(leaf: Any, layout: NamedSharding, param: Any) -> Any:
        if isinstance(leaf, optax.MaskedNode):  # a param outside a masked transformation: no state
            return leaf
        if leaf.shape == param.shape:
            return layout
        loose.append(leaf)
        return replicated

    def other(leaf: Any) -> NamedSharding:
        loose.append(leaf)
        return replicated

    opt_shape = jax.eval_shape(tx.init, params_shape)
    layout = optax.tree_map_params(tx, param_like, opt_shape, update, params_shape, transform_non_params=other,
                                   is_leaf=lambda x: isinstance(x, (NamedSharding, optax.MaskedNode)))
    large = [x for x in loose if math.prod(x.shape) >= LARGE_REPLICATED]
    if large:
        warnings.warn(f"optimizer state: {len(large)} leaves not shaped like their params stay replicated on every "
                      f"device ({sum(math.prod(x.shape) for x in large):,} elements, the largest "
                      f"{max(large, key=lambda x: math.prod(x.shape)).shape}); ZeRO shards param-shaped state only",
                      ConfigWarning, stacklevel=4)
    return layout


class LeafSpecs(NamedTuple):
    params: P
    grads: P
    update: P


def zero_axes(mesh: Mesh, expert: bool) -> tuple[str, ...]:
    """The mesh axes of a leaf's ZeRO group: "fsdp" for expert leaves, else "fsdp" and a
    non-trivial "expert" axis (all data devices of the group)."""
    return (FSDP,) if expert or mesh.shape[EXPERT] == 1 else (FSDP, EXPERT)


def expert_spec(shape: tuple[int, ...], base: P, ep: int, *, stacked: bool) -> P:
    """``base`` with the expert dimension (the first after the stacked one) over "expert"."""
    dim = 1 if stacked else 0
    if len(shape) <= dim or shape[dim] % ep:
        raise ValueError(f"an expert param of shape {shape} has no expert dimension divisible by ep_size {ep}")
    if ep == 1:
        return base
    entries = list(base) + [None] * (dim + 1 - len(base))
    entries[dim] = EXPERT
    return P(*entries)


def leaf_specs(shape: tuple[int, ...], stage: int, n: int, persistence_threshold: int = 0, *,
               stacked: bool = False, base: P | None = None, axes: tuple[str, ...] = (FSDP,)) -> LeafSpecs:
    """One leaf's row of the ZeRO table: its stored, reduced-gradient and update layouts, ZeRO
    over ``axes`` (``n`` devices)."""
    rule, base = ZERO_RULES[stage], P() if base is None else base
    sharded = zero_spec(shape, base, n, stacked=stacked, axes=axes)
    persistent = math.prod(shape) < persistence_threshold
    return LeafSpecs(params=sharded if rule.params and not persistent else base,
                     grads=sharded if rule.grads else base,
                     update=sharded if rule.opt_state else base)


def zero_spec(shape: tuple[int, ...], base: P, n: int, *, stacked: bool = False,
              axes: tuple[str, ...] = (FSDP,)) -> P:
    """``base`` with the ZeRO ``axes`` (``n`` devices) on the largest free dimension divisible by
    ``n`` (unchanged if none)."""
    if n == 1:
        return base
    entries = list(base) + [None] * (len(shape) - len(base))
    free = [d for d, size in enumerate(shape)
            if entries[d] is None and size % n == 0 and size >= n and not (stacked and d == 0)]
    if not free:
        return base
    best = max(free, key=lambda d: (shape[d], -d))
    entries[best] = axes[0] if len(axes) == 1 else axes
    while entries and entries[-1] is None:  # canonical form: what jit reports back
        entries.pop()
    return P(*entries)


def _keys(path: tuple) -> list:
    return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_stacked(path: tuple) -> bool:
    """Whether a leaf at ``path`` (a jax key path) lives in a scan_layers stack."""
    return STACKED_KEY in _keys(path)


def is_expert(path: tuple) -> bool:
    """Whether a leaf at ``path`` is an expert's (under an ``"experts"`` key: `jzero.models.moe`)."""
    return EXPERT_KEY in _keys(path)

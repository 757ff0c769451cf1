"""The device mesh: axes ("stage", "replica", "fsdp", "expert", "sequence", "tensor"). "stage"
is the pipeline's, outermost (the slowest links carry only a stage's boundary activations;
``pipeline.stages`` devices, 1 when off). Data parallelism spans the next three; "sequence"
(DeepSpeed-Ulysses) and "tensor" (Megatron / AutoTP) split each replica's model and activations,
innermost (``tensor_parallel.autotp_size`` and ``sequence_parallel_size`` devices, 1 each when
off), so a tensor group is adjacent devices.

ZeRO shards non-expert params over ("fsdp", "expert") -- the ZeRO group, every device when
``replica = 1`` -- and expert params over "fsdp" alone, since "expert" splits the experts
themselves (`jzero.zero.sharding`). ``moe.ep_size`` sizes "expert" (1 without MoE: a trivial axis).
``zero_hpz_partition_size = k > 1`` gives hierarchical partitioning (ZeRO++ hpZ / HSDP): a ZeRO
group of k devices, replicated across ``replica``. Expert groups are contiguous devices, as in
DeepSpeed. Axes are `AxisType.Auto` so GSPMD propagates shardings and `with_sharding_constraint`
binds. The stage and data axes are jzero's own (the step's ``shard_map`` is manual over them); the model
axes are the compiler's, steered by the params' specs (`jzero.zero.autotp`) and activation
constraints (`jzero.zero.modelaxes`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jzero.config import Config, ConfigError, data_devices

STAGE, REPLICA, FSDP, EXPERT, SEQUENCE, TENSOR = "stage", "replica", "fsdp", "expert", "sequence", "tensor"
DATA_AXES = (REPLICA, FSDP, EXPERT)  # the batch is split over every data-parallel device
MODEL_AXES = (SEQUENCE, TENSOR)  # each replica's model split (trivial axes when off)
AXES = (STAGE,) + DATA_AXES + MODEL_AXES


def make_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over ``devices`` (default: the config's device count, or all)."""
    if devices is None:
        available = jax.devices()
        wanted = config.jzero.mesh.devices or len(available)
        if wanted > len(available):
            raise ConfigError(f"jzero.mesh.devices: asks for {wanted} devices but only {len(available)} "
                              f"are visible ({available[0].platform})")
        devices = available[:wanted]
    devices = list(devices)
    n = data_devices(config, len(devices))
    zero, ep = fsdp_size(config, n), expert_size(config, n)
    if zero % ep:
        raise ConfigError(f"moe.ep_size: {ep} does not divide the ZeRO group of {zero} devices "
                          "(jzero.mesh.fsdp / zero_hpz_partition_size)")
    sp, tp = config.sequence_parallel_size, config.tensor_parallel.size
    pp = config.pipeline.stages
    grid = np.array(devices, dtype=object).reshape(pp, n // zero, zero // ep, ep, sp, tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def model_parallel(mesh: Mesh) -> bool:
    """Whether ``mesh`` splits the model (a non-trivial sequence or tensor axis)."""
    return any(mesh.shape.get(a, 1) > 1 for a in MODEL_AXES)


def manual_axes(mesh: Mesh) -> frozenset[str]:
    """The axes the step's ``shard_map`` runs by hand: every axis, unless the model is split, when
    the sequence and tensor axes are left to the compiler (a partial-manual ``shard_map``)."""
    return frozenset((STAGE, *DATA_AXES) if model_parallel(mesh) else mesh.axis_names)


def data_spec(spec: P) -> P:
    """``spec`` with the model axes dropped: what a ``shard_map`` over the data axes is told."""
    return keeping(spec, lambda a: a not in MODEL_AXES)


def model_spec(spec: P) -> P:
    """``spec`` with only its model axes: a leaf's split over "sequence" and "tensor"."""
    return keeping(spec, lambda a: a in MODEL_AXES)


def keeping(spec: P, keep: Callable[[str], bool]) -> P:
    """``spec`` with only the axes ``keep`` accepts, in canonical form (no trailing None)."""
    def entry(e: Any) -> Any:
        axes = tuple(a for a in ((e,) if isinstance(e, str) else tuple(e or ())) if keep(a))
        return None if not axes else axes[0] if len(axes) == 1 else axes
    entries = [entry(e) for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def on_model_blocks(f, spec: P):
    """``f`` on each device's own block of a leaf split over the model axes as ``spec`` says,
    inside the step's ``shard_map`` (``f`` itself when unsplit). A collective over the data axes
    on a leaf the compiler partitions is otherwise preceded by an all-gather of the whole leaf
    over the model axes: the compiler only moves replicated dimensions by hand."""
    if not tuple(spec):
        return f
    return jax.shard_map(f, in_specs=spec, out_specs=spec, axis_names=frozenset(MODEL_AXES))


def over_data(f, mesh: Mesh, in_specs: Any, out_specs: Any, plain: bool = False, **kwargs: Any):
    """``jax.shard_map(f)`` manual over the data axes (`manual_axes`), the specs' model axes left
    to the compiler; and "stage" when a pipeline splits the mesh (outside the pipelined step,
    which runs the stages by hand: an evaluation reads the stack's blocks where they live).
    ``f`` itself when those axes are one device (`live`), or asked to (``plain``): its rows are
    then the whole batch, partitioned by the compiler."""
    auto = frozenset((STAGE,) if mesh.shape.get(STAGE, 1) > 1 else ())
    axes = manual_axes(mesh) - auto
    if plain or math.prod(mesh.shape[a] for a in axes) == 1:
        return functools.partial(_on_mesh, f, mesh)
    strip = functools.partial(jax.tree.map, lambda s: keeping(data_spec(s), lambda a: a not in auto),
                              is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(f, mesh=mesh, in_specs=strip(in_specs), out_specs=strip(out_specs), axis_names=axes,
                         **kwargs)


def _on_mesh(f, mesh: Mesh, *args: Any) -> Any:
    """``f(*args)`` traced with ``mesh`` as the context mesh (the model axes' constraints name it)."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return f(*args)


def live(axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` where this trace runs a collective over them by hand; none where its manual axes
    span one device (or it has none), so the collective is not emitted. JAX lowers a
    ``shard_map`` whose manual axes all have size 1 without a manual region, and a collective
    left in it (over groups of one device) is then a cross-partition collective in automatic
    partitioning, which XLA's partitioner refuses once another axis splits the model
    (docs/design.md, "Data-parallel size 1"). `over_data` runs such a region as plain code."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(axes) if math.prod(mesh.shape[a] for a in mesh.manual_axes) > 1 else ()


def psum(x: Any, axes: tuple[str, ...]) -> Any:
    """``lax.psum`` over the `live` ``axes`` (``x`` when none)."""
    axes = live(axes)
    return jax.lax.psum(x, axes) if axes else x


def pmean(x: Any, axes: tuple[str, ...]) -> Any:
    """``lax.pmean`` over the `live` ``axes`` (``x`` when none)."""
    axes = live(axes)
    return jax.lax.pmean(x, axes) if axes else x


def axis_index(axes: tuple[str, ...]) -> jax.Array:
    """This device's index over the `live` ``axes`` (0 when none)."""
    axes = live(axes)
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)


def fsdp_size(config: Config, num_devices: int) -> int:
    """ZeRO group size of ``num_devices`` data devices: jzero.mesh.fsdp, else
    zero_hpz_partition_size when > 1, else every one."""
    hpz = config.zero_optimization.zero_hpz_partition_size
    fsdp = config.jzero.mesh.fsdp or (hpz if hpz > 1 else num_devices)
    key = "jzero.mesh.fsdp" if config.jzero.mesh.fsdp else "zero_optimization.zero_hpz_partition_size"
    if num_devices % fsdp:
        raise ConfigError(f"{key}: {fsdp} does not divide the {num_devices} devices of the mesh")
    return fsdp


def expert_size(config: Config, num_devices: int) -> int:
    """Expert-parallel size: ``moe.ep_size`` (1 without MoE); it must divide the devices."""
    ep = config.moe.ep_size if config.moe is not None else 1
    if num_devices % ep:
        raise ConfigError(f"moe.ep_size: {ep} does not divide the {num_devices} devices of the mesh")
    return ep


def platform(mesh: Mesh) -> str:
    """The platform of ``mesh``'s devices ("cpu", "gpu", "tpu"): abstract TPU devices of a
    compile-only target say "tpu" on a CPU host, so backend choices follow the mesh, not the host."""
    return mesh.devices.flat[0].platform


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in DATA_AXES]))

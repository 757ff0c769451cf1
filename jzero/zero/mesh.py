"""The device mesh: axes ("replica", "fsdp", "expert"). Data parallelism spans all three.

ZeRO shards non-expert params over ("fsdp", "expert") -- the ZeRO group, every device when
``replica = 1`` -- and expert params over "fsdp" alone, since "expert" splits the experts
themselves (`jzero.zero.sharding`). ``moe.ep_size`` sizes "expert" (1 without MoE: a trivial axis).
``zero_hpz_partition_size = k > 1`` gives hierarchical partitioning (ZeRO++ hpZ / HSDP): a ZeRO
group of k devices, replicated across ``replica``. Expert groups are contiguous devices, as in
DeepSpeed. Axes are `AxisType.Auto` so GSPMD propagates shardings and `with_sharding_constraint`
binds.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jzero.config import Config, ConfigError

REPLICA, FSDP, EXPERT = "replica", "fsdp", "expert"
AXES = (REPLICA, FSDP, EXPERT)
DATA_AXES = AXES  # the batch is split over every data-parallel device


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
    n = len(devices)
    zero, ep = fsdp_size(config, n), expert_size(config, n)
    if zero % ep:
        raise ConfigError(f"moe.ep_size: {ep} does not divide the ZeRO group of {zero} devices "
                          "(jzero.mesh.fsdp / zero_hpz_partition_size)")
    grid = np.array(devices, dtype=object).reshape(n // zero, zero // ep, ep)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def fsdp_size(config: Config, num_devices: int) -> int:
    """ZeRO group size: jzero.mesh.fsdp, else zero_hpz_partition_size when > 1, else every device."""
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


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in DATA_AXES]))

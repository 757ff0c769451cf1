"""The device mesh: axes ("replica", "fsdp"). ZeRO shards over "fsdp"; data parallelism spans both.

``replica = 1`` is classic ZeRO. ``zero_hpz_partition_size = k > 1`` gives hierarchical
partitioning (ZeRO++ hpZ / HSDP): shard inside groups of k devices, replicate across groups.
Axes are `AxisType.Auto` so GSPMD propagates shardings and `with_sharding_constraint` binds.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jzero.config import Config, ConfigError

AXES = ("replica", "fsdp")
DATA_AXES = AXES  # the batch is split over every data-parallel device


def make_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("replica", "fsdp") mesh over ``devices`` (default: the config's device count, or all)."""
    if devices is None:
        available = jax.devices()
        wanted = config.jzero.mesh.devices or len(available)
        if wanted > len(available):
            raise ConfigError(f"jzero.mesh.devices: asks for {wanted} devices but only {len(available)} "
                              f"are visible ({available[0].platform})")
        devices = available[:wanted]
    devices = list(devices)
    n = len(devices)
    fsdp = fsdp_size(config, n)
    grid = np.array(devices, dtype=object).reshape(n // fsdp, fsdp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def fsdp_size(config: Config, num_devices: int) -> int:
    """ZeRO group size: jzero.mesh.fsdp, else zero_hpz_partition_size when > 1, else every device."""
    hpz = config.zero_optimization.zero_hpz_partition_size
    fsdp = config.jzero.mesh.fsdp or (hpz if hpz > 1 else num_devices)
    key = "jzero.mesh.fsdp" if config.jzero.mesh.fsdp else "zero_optimization.zero_hpz_partition_size"
    if num_devices % fsdp:
        raise ConfigError(f"{key}: {fsdp} does not divide the {num_devices} devices of the mesh")
    return fsdp


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in DATA_AXES]))

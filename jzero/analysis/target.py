"""Where a step is compiled for: this host's devices, or an abstract TPU topology.

``tpu:v5e:2x2``, ``tpu:v5p:4x4x4``, ``tpu:v4:2x2x1``...: the TPU compiler in libtpu (the
``jzero[tpu-aot]`` extra) builds the real TPU executable for devices that are not here
(`jax.experimental.topologies`), so memory, cost and the scheduled program are the TPU's, read on
a CPU-only machine. Nothing runs on those devices: only ``lower(...).compile()``.

`quiet_platform` keeps the CPU path quiet: with libtpu installed, every JAX start would probe for
a TPU (warnings on stderr, about 2 s) unless the platform is pinned, so a host with no TPU pins
JAX to the CPU before JAX starts.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import math
import os
import pkgutil
import re
from typing import Any

CPU = "cpu"
TPU_PREFIX = "tpu:"
_TOPOLOGY = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+){1,2})$")
# Cloud TPU accelerator-type names (what a TPU VM's metadata would say) by generation: libtpu asks
# for one at start-up and warns without it; chips -> the name's count (TensorCores for v4/v5p).
_ACCELERATOR_TYPE = {"v4": lambda chips: f"v4-{2 * chips}", "v5p": lambda chips: f"v5p-{2 * chips}",
                     "v5e": lambda chips: f"v5litepod-{chips}", "v6e": lambda chips: f"v6e-{chips}"}
EXAMPLES = "tpu:v5e:2x2, tpu:v5p:4x4x4, tpu:v4:2x2x1"
TPU_COMPILER = importlib.util.find_spec("libtpu") is not None  # the jzero[tpu-aot] extra


class TargetError(ValueError):
    """A ``--target`` that names no platform or topology this host can compile for."""


def is_tpu(target: str | None) -> bool:
    return bool(target) and target.startswith(TPU_PREFIX)


def check(target: str) -> str:
    """``target`` if it is ``cpu`` or ``tpu:GENERATION:TOPOLOGY``, else a one-line `TargetError`."""
    if target == CPU:
        return target
    name = target[len(TPU_PREFIX):] if is_tpu(target) else ""
    if not _TOPOLOGY.match(name):
        raise TargetError(f"--target: '{target}' is not 'cpu' or 'tpu:GENERATION:TOPOLOGY' (e.g. {EXAMPLES})")
    if not TPU_COMPILER:
        raise TargetError(f"--target {target}: the TPU compiler is not installed; pip install 'jzero[tpu-aot]'")
    return target


def chips(target: str) -> int:
    """How many chips a TPU target's topology names (``v5p:4x4x4`` -> 64)."""
    return math.prod(int(d) for d in _TOPOLOGY.match(target[len(TPU_PREFIX):]).group(2).split("x"))


def devices(target: str | None) -> list[Any] | None:
    """The target's devices: None for this host's (the default), else the TPU topology's
    abstract devices (compile-only)."""
    if not is_tpu(target):
        return None
    return list(_topology(check(target)).devices)


@functools.cache
def _topology(target: str) -> Any:
    from jax.experimental import topologies

    generation = target[len(TPU_PREFIX):].split(":")[0]
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # no TPU VM metadata to ask
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip to lock
    if generation in _ACCELERATOR_TYPE:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", _ACCELERATOR_TYPE[generation](chips(target)))
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=target[len(TPU_PREFIX):])
    except Exception as e:  # libtpu's own words: an unknown generation or a shape it does not build
        raise TargetError(f"--target {target}: the TPU compiler refused it: {str(e).splitlines()[0][:200]}") from None


def tpu_present() -> bool:
    """Whether this host has TPU chips (their device files) or is a TPU VM (its environment)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*") or os.environ.get("TPU_NAME"))


def quiet_platform() -> None:
    """Pin JAX to the CPU where libtpu is installed but no TPU is (and no GPU plugin either), before
    JAX starts; a user's own JAX_PLATFORMS always wins. Abstract TPU compiles still work pinned."""
    if "JAX_PLATFORMS" in os.environ or not TPU_COMPILER or tpu_present():
        return
    if any(m.name.startswith(("jax_cuda", "jax_rocm")) for m in pkgutil.iter_modules()):
        return
    os.environ["JAX_PLATFORMS"] = CPU

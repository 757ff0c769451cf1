"""DeepSpeed's communication knobs as XLA flags, set before the backend starts.

DeepSpeed overlaps and buckets collectives by hand; under XLA the compiler schedules and combines
them, and these keys become its flags (GPU; XLA's TPU compiler overlaps and combines on its own
and the CPU backend runs collectives in place, so there they are accepted and reported as
no-ops):

    zero_optimization.overlap_comm          -> --xla_gpu_enable_latency_hiding_scheduler
    zero_optimization.reduce_bucket_size    -> --xla_gpu_{all_reduce,reduce_scatter}_combine_threshold_bytes
    zero_optimization.allgather_bucket_size -> --xla_gpu_all_gather_combine_threshold_bytes

Bucket sizes count elements (DeepSpeed's unit); the byte thresholds multiply by the dtype the
collective carries (communication dtype for reductions, compute dtype for gathers). Sizes equal
to DeepSpeed's defaults are not translated (2 GB combine buffers would only cost memory), and a
flag already in ``XLA_FLAGS`` is left as the user set it.
"""
from __future__ import annotations

import os

from jzero.config import Config, ZeroConfig

DEFAULT_BUCKET = ZeroConfig.allgather_bucket_size  # DeepSpeed's 5e8 elements
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def communication_flags(config: Config) -> list[str]:
    """The XLA flags ``config``'s communication keys ask for, as ``--name=value`` strings."""
    zero = config.zero_optimization
    flags = []
    if zero.overlap_comm is not None:
        flags.append(f"--xla_gpu_enable_latency_hiding_scheduler={str(zero.overlap_comm).lower()}")
    reduce_bytes = DTYPE_BYTES[config.communication_data_type or "fp32"]
    if isinstance(zero.reduce_bucket_size, int) and zero.reduce_bucket_size != DEFAULT_BUCKET:
        threshold = zero.reduce_bucket_size * reduce_bytes
        flags += [f"--xla_gpu_all_reduce_combine_threshold_bytes={threshold}",
                  f"--xla_gpu_reduce_scatter_combine_threshold_bytes={threshold}"]
    if zero.allgather_bucket_size != DEFAULT_BUCKET:
        gather_bytes = 2 if config.bf16.enabled or config.fp16.enabled else 4
        flags.append(f"--xla_gpu_all_gather_combine_threshold_bytes={zero.allgather_bucket_size * gather_bytes}")
    return flags


def apply(config: Config) -> list[str]:
    """Add ``config``'s flags to ``XLA_FLAGS`` (before JAX starts a backend); returns those added."""
    current = os.environ.get("XLA_FLAGS", "").split()
    present = {f.split("=")[0] for f in current}
    added = [f for f in communication_flags(config) if f.split("=")[0] not in present]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


def describe(added: list[str], platform: str) -> str | None:
    """The run header's line about them; None when the config asks for nothing."""
    if not added:
        return None
    effect = "in effect" if platform in ("gpu", "cuda", "rocm") else f"no effect on {platform}"
    return f"jzero: communication flags ({effect}): {' '.join(added)}"

"""DeepSpeed's elasticity (`deepspeed/elasticity/elasticity.py`, versions 0.1 and 0.2): one global
batch valid for many data-parallel sizes, so a job can be rescheduled onto another device count
and keep training the same thing (jzero's checkpoints already restore onto any mesh).

v0.1: candidates are each micro-batch size, and their LCM, scaled by the largest highly
composite number (HCN) that keeps them <= ``max_train_batch_size``; the candidate valid for the
most device counts in [min_gpus, max_gpus] wins (ties: the larger batch if
``prefer_larger_batch``). A device count n is valid when some micro-batch size m divides the
batch and n divides batch / m. v0.2 works per node (``num_gpus_per_node``) and, when the
current count is not valid, falls back to the largest multiple of micro x dp under the max.
The micro-batch for a device count is the largest size that divides batch / devices.
Pure integer arithmetic; imports nothing.
"""
from __future__ import annotations

import math
from functools import reduce

# The 38 smallest highly composite numbers (DeepSpeed's HCN_LIST): enough for batches to 720K.
HCN = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
       20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
       665280, 720720)


def candidates(bases: list[int], max_batch: int) -> list[int]:
    """Each base times the largest HCN keeping it <= ``max_batch`` (bases above it dropped)."""
    out = set()
    for base in bases:
        if base > max_batch:
            continue
        if base == max_batch:
            out.add(base)
            continue
        value = max_batch // base
        above = next((i for i, h in enumerate(HCN) if h > value), 0)  # numpy argmax: 0 when none is above
        out.add(HCN[above - 1] * base)
    return sorted(out)


def valid_devices(batch: int, micro: list[int], min_devices: int, max_devices: int) -> list[int]:
    """Device counts in [min, max] that some micro-batch size fits: n | batch / m."""
    out = set()
    for m in micro:
        if batch % m:
            continue
        most = batch // m
        if min_devices <= most <= max_devices:
            out.add(most)
        for i in range(1, most // 2 + 1):
            if i > max_devices:
                break
            if i >= min_devices and most % i == 0:
                out.add(i)
    return sorted(out)


def best(batches: list[int], micro: list[int], min_devices: int, max_devices: int,
         prefer_larger: bool) -> tuple[int, list[int]]:
    """The candidate batch valid for the most device counts (ties by ``prefer_larger``)."""
    chosen, valid, most = min(micro), [], 0
    for batch in batches:
        counts = valid_devices(batch, micro, min_devices, max_devices)
        tie_break = (prefer_larger and batch > chosen) or (not prefer_larger and batch < chosen)
        if len(counts) > most or (len(counts) == most and tie_break):
            chosen, valid, most = batch, counts, len(counts)
    return chosen, valid


def v01(micro: list[int], max_batch: int, min_devices: int | None, max_devices: int | None,
        prefer_larger: bool) -> tuple[int, list[int]]:
    """(global batch, valid device counts) of elasticity v0.1."""
    min_devices = min_devices or 1
    max_devices = max_devices or max_batch // min(micro)
    lcm = reduce(math.lcm, micro)
    return best(candidates([*micro, lcm], max_batch), micro, min_devices, max_devices, prefer_larger)


def micro_batch(batch: int, devices: int, micro: list[int]) -> int | None:
    """The micro-batch size for ``devices`` devices: the largest that divides batch / devices
    (None: none does)."""
    fits = [m for m in micro if (batch // devices) % m == 0]
    return max(fits) if fits else None


def v02(micro: list[int], max_batch: int, devices: int, min_devices: int, max_devices: int, prefer_larger: bool,
        per_node: int = 1, model_parallel: int = 1) -> tuple[int, list[int]]:
    """(global batch, valid data-parallel sizes) of elasticity v0.2 for ``devices`` devices: the
    v0.1 choice over nodes, else (the current count not valid) the largest / smallest multiple of
    micro x dp under the max, valid for the current count only."""
    dp_per_node = per_node // model_parallel
    batch, nodes = v01(micro, int(max_batch / dp_per_node), int(min_devices / per_node),
                       int(max_devices / per_node), prefer_larger)
    batch, valid = batch * dp_per_node, [n * dp_per_node for n in nodes]
    if devices // model_parallel in valid:
        return batch, valid
    dp = (devices / per_node) * dp_per_node
    sizes = [math.floor(max_batch / float(m * dp)) * m * dp for m in micro]
    return int(max(sizes) if prefer_larger else min(sizes)), [int(dp)]

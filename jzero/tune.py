"""`jzero tune batch`: the largest micro-batch per device whose compiled step fits a memory budget.

PyTorch Lightning's ``scale_batch_size`` grows the batch until a step runs out of memory. Here
each size's training step is compiled ahead of time on abstract shapes (`jzero.estimate`) and
its per-device peak read from the executable, so no size is ever allocated or run to find the
limit: the micro-batch doubles until the peak passes the budget, then a binary search finds
the largest that fits (the peak grows with the micro-batch). The configured global batch is
kept: the accumulation becomes ``train_batch_size / (micro x devices)``, with the micro-batch
lowered to the largest size that divides it when the largest fitting one does not.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from jzero import profile
from jzero.autotune import time_candidate
from jzero.config import ConfigError
from jzero.estimate import compile_step
from jzero.resolve import load_config

MAX_MICRO = 1 << 16


@dataclass
class BatchSearch:
    """``peaks``: every micro-batch compiled, with its per-device peak bytes."""

    budget: int
    devices: int
    largest: int = 0  # the largest micro-batch whose peak fits (0: not even 1 fits)
    micro: int = 0  # the micro-batch chosen for the configured global batch
    accum: int = 0
    train_batch_size: int = 0
    peaks: dict[int, int] = field(default_factory=dict)

    def config(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``raw`` with the chosen micro-batch and accumulation (the global batch unchanged)."""
        out = copy.deepcopy(raw)
        out.update(train_batch_size=self.train_batch_size, train_micro_batch_size_per_gpu=self.micro,
                   gradient_accumulation_steps=self.accum)
        return out


def _trial(raw: dict[str, Any], micro: int) -> dict[str, Any]:
    """``raw`` stepping ``micro`` rows per device, one micro-batch per step."""
    trial = {k: v for k, v in raw.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
    trial.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1)
    return trial


def peak_at(raw: dict[str, Any], micro: int) -> int:
    """Per-device peak bytes of the config's step at ``micro`` rows per device (compiled only)."""
    return profile.memory(compile_step(load_config(_trial(raw, micro))).compiled).peak


def samples_per_s(raw: dict[str, Any], micro: int, steps: int = 3) -> float:
    """Measured training samples per second at ``micro`` rows per device (allocates and runs)."""
    trial = _trial(raw, micro)
    compiled, abstract, *_ = compile_step(load_config(trial))
    return abstract.config.train_batch_size / time_candidate(trial, compiled, abstract, steps)


def largest_micro_batch(raw: dict[str, Any], budget: int) -> BatchSearch:
    """Double, then bisect, over compiled peaks; then fit the configured global batch."""
    if budget <= 0:
        raise ConfigError(f"--memory-budget: must be > 0 bytes, got {budget}")
    config = load_config(raw)
    devices = config.dp_size
    search = BatchSearch(budget=budget, devices=devices)

    def fits(m: int) -> bool:
        search.peaks[m] = search.peaks.get(m) or peak_at(raw, m)
        return search.peaks[m] <= budget

    lo, hi = 0, 1
    while hi <= MAX_MICRO and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if hi <= MAX_MICRO:
        fits(lo + 1)  # the proof: one more row per device is over budget
    search.largest = lo
    if lo == 0:
        return search
    search.train_batch_size = config.train_batch_size
    per_device = config.train_batch_size // devices
    search.micro = max(m for m in range(1, min(lo, per_device) + 1) if per_device % m == 0)
    search.accum = per_device // search.micro
    return search

"""`jzero tune batch`: the largest micro-batch per device whose compiled step fits a memory budget.

PyTorch Lightning's ``scale_batch_size`` grows the batch until a step runs out of memory. Here
each size's training step is compiled ahead of time on abstract shapes (`jzero.analysis.estimate`) and
its per-device peak read from the executable, so no size is ever allocated or run to find the
limit: the guesses follow the line of the peaks compiled so far (the peak is nearly affine in
the micro-batch), with bisection as the fallback, so a search takes a handful of compiles. The
configured global batch is kept: the accumulation becomes ``train_batch_size / (micro x
devices)``, with the micro-batch lowered to the largest size that divides it when the largest
fitting one does not.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jzero.analysis import profile
from jzero.analysis.autotune import time_candidate
from jzero.analysis.estimate import compile_step
from jzero.config import ConfigError
from jzero.train.resolve import load_config

MAX_MICRO = 1 << 16
REACH = 64  # a guess is at most this many times the largest size known to fit


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
    """Search the compiled peaks (`boundary`); then fit the configured global batch."""
    if budget <= 0:
        raise ConfigError(f"--memory-budget: must be > 0 bytes, got {budget}")
    config = load_config(raw)
    devices = config.dp_size
    search = BatchSearch(budget=budget, devices=devices)

    def peak(m: int) -> int:
        search.peaks[m] = search.peaks.get(m) or peak_at(raw, m)
        return search.peaks[m]

    lo = search.largest = boundary(peak, budget)
    if lo == 0:
        return search
    search.train_batch_size = config.train_batch_size
    per_device = config.train_batch_size // devices
    search.micro = max(m for m in range(1, min(lo, per_device) + 1) if per_device % m == 0)
    search.accum = per_device // search.micro
    return search


def boundary(peak: Callable[[int], int], budget: int) -> int:
    """The largest m in 1..`MAX_MICRO` with ``peak(m) <= budget`` (0: none), ``peak`` growing with
    m, and ``peak(m + 1)`` evaluated as the proof. A compile is the cost, so the guesses follow
    the peak's line (it is nearly affine in the rows: activations scale, the state does not):
    each guess is the secant through the fitting size nearest the boundary and the closest other
    size known, kept strictly inside the bracket and within `REACH` x the largest fitting size
    (a flat stretch doubles instead); once a size over budget is known, a guess that does not
    halve the bracket is followed by a bisection, so the search takes at most about twice
    bisection's compiles. An affine peak takes 4 or 5 (1, 2, the guess, the proof)."""
    seen: dict[int, int] = {}

    def fits(m: int) -> bool:
        seen[m] = seen[m] if m in seen else peak(m)
        return seen[m] <= budget

    if not fits(1):
        return 0
    lo, hi = (2, MAX_MICRO + 1) if fits(2) else (1, 2)  # fits(lo); hi: the smallest known not to
    bisect = False
    while hi - lo > 1:
        if bisect:
            guess = (lo + hi) // 2
        else:
            other = hi if hi in seen else max(m for m in seen if m < lo)
            rise, run = seen[other] - seen[lo], other - lo  # integers: no rounding below the boundary
            guess = lo + (budget - seen[lo]) * run // rise if rise * run > 0 else 2 * lo
            guess = min(guess, REACH * lo)
        width, guess = hi - lo, min(max(guess, lo + 1), hi - 1)
        lo, hi = (guess, hi) if fits(guess) else (lo, guess)
        bisect = not bisect and hi in seen and hi - lo > width // 2  # never toward an unknown top
    return lo

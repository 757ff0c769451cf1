"""`jzero autotune`: pick ZeRO stage x micro-batch x remat for a fixed global batch, knowing every
candidate's memory before running it.

DeepSpeed's autotuner launches trials and finds OOMs by crashing into them. Here each candidate's
training step is compiled ahead of time on abstract shapes (`jzero.analysis.estimate.compile_step`) and
its per-device peak read from the executable; a candidate over the memory budget is pruned
without ever allocating or running anything. The survivors run a few real steps each (through the
executable already compiled), fastest first in the ranking; ``best.json`` is the winning config.

The global batch (``train_batch_size``) is fixed, so the micro-batch per device decides the
gradient accumulation: ``accum = train_batch_size / (micro x devices)``.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np

from jzero import models
from jzero.analysis import profile
from jzero.analysis.estimate import compile_step
from jzero.config import ConfigError
from jzero.train.resolve import load_config
from jzero.train.state import init
from jzero.zero.mesh import make_mesh

REMATS = ("none", "dots", "full")
STAGES = (0, 1, 2, 3)
GiB = 2**30


@dataclass(frozen=True)
class Candidate:
    stage: int
    micro: int  # micro-batch per device
    accum: int  # gradient accumulation steps
    remat: str

    def config(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``raw`` (a DeepSpeed/jzero config dict) set to this candidate."""
        out = copy.deepcopy(raw)
        out["train_micro_batch_size_per_gpu"] = self.micro
        out["gradient_accumulation_steps"] = self.accum
        out.setdefault("zero_optimization", {})["stage"] = self.stage
        out.setdefault("jzero", {})["remat"] = self.remat
        return out


@dataclass
class Result:
    candidate: Candidate
    peak_bytes: int = 0
    compile_s: float = 0.0
    status: str = "pending"  # timed | pruned | untimed (time budget) | failed
    why: str = ""
    step_s: float = float("nan")
    tokens_per_s: float = 0.0
    compiled: Any = None  # the executable and the abstract state it was compiled for: kept for
    abstract: Any = None  # timing, not serialised

    def row(self) -> dict[str, Any]:
        return {**asdict(self.candidate), "peak_gib": self.peak_bytes / GiB, "status": self.status,
                "why": self.why, "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "compile_s": self.compile_s}


def candidates(raw: dict[str, Any], devices: int, stages: Sequence[int] = STAGES,
               remats: Sequence[str] = REMATS) -> list[Candidate]:
    """Every stage x power-of-two micro-batch per device x remat policy for the fixed global batch."""
    batch = raw.get("train_batch_size")
    if not isinstance(batch, int) or batch < 1:
        raise ConfigError("train_batch_size: autotune needs a fixed global batch (a positive integer)")
    if batch % devices:
        raise ConfigError(f"train_batch_size: {batch} is not a multiple of the {devices} devices")
    per_device = batch // devices
    micros = [m for m in (2**i for i in range(per_device.bit_length())) if per_device % m == 0]
    return [Candidate(s, m, per_device // m, r) for s in stages for m in micros for r in remats]


def measure(raw: dict[str, Any], devices: int, stages: Sequence[int] = STAGES,
            remats: Sequence[str] = REMATS) -> list[Result]:
    """Compile every candidate on abstract shapes and read its per-device peak memory."""
    results = []
    for cand in candidates(raw, devices, stages, remats):
        result = Result(cand)
        try:
            compiled, abstract, _, _, compile_s = compile_step(load_config(cand.config(raw)))
            result.compiled, result.abstract, result.compile_s = compiled, abstract, compile_s
            result.peak_bytes = profile.memory(compiled).peak
        except Exception as e:  # a candidate XLA cannot build is reported, not fatal
            result.status, result.why = "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        results.append(result)
    return results


def tune(raw: dict[str, Any], results: list[Result], budget_bytes: int, *, steps: int = 3,
         budget_s: float = float("inf")) -> list[Result]:
    """Prune what does not fit ``budget_bytes``, time the rest (``steps`` after one warm-up) until
    ``budget_s`` runs out; returns all results ranked: timed by tokens/s, then the others."""
    deadline = time.monotonic() + budget_s
    fitting = []
    for r in results:
        if r.status == "failed":
            continue
        if r.peak_bytes > budget_bytes:
            r.status, r.why = "pruned", f"over budget ({r.peak_bytes / 2**20:.2f} > {budget_bytes / 2**20:.2f} MiB)"
        else:
            fitting.append(r)
    for r in sorted(fitting, key=lambda r: r.peak_bytes):
        if time.monotonic() > deadline:
            r.status, r.why = "untimed", "time budget spent"
            continue
        r.step_s = time_candidate(r.candidate.config(raw), r.compiled, r.abstract, steps)
        config = r.abstract.config
        r.tokens_per_s = config.train_batch_size * models.build(config).tokens_per_example / r.step_s
        r.status = "timed"
    order = {"timed": 0, "untimed": 1, "pruned": 2, "failed": 3}
    return sorted(results, key=lambda r: (order[r.status], -r.tokens_per_s, r.peak_bytes))


def time_candidate(raw: dict[str, Any], compiled: Any, abstract: Any, steps: int) -> float:
    """Median seconds of one training step of ``raw`` through its ``compiled`` executable, on
    the model's example batch (the data does not change the time). The real state takes the static fields of
    the ``abstract`` one the executable was compiled for."""
    config = load_config(raw)
    model = models.build(config)
    real = init(model.init_fn, config, loss_fn=model.loss_fn, rng=0, mesh=make_mesh(config),
                stages=model.stages)
    state = jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(real))
    batch = jax.device_put(model.example_batch(state.config.train_batch_size), state.plan.batch)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i:
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def device_memory_bytes() -> int | None:
    """The first device's memory size where the backend reports it (GPU/TPU), else None."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def table_rows(ranked: list[Result]) -> list[list[str]]:
    """Rows of the ranked table: rank, stage, micro x accum, remat, peak MiB, tokens/s, status."""
    rows = []
    for i, r in enumerate(ranked, 1):
        c = r.candidate
        rows.append([str(i) if r.status == "timed" else "-", str(c.stage), f"{c.micro} x {c.accum}", c.remat,
                     f"{r.peak_bytes / 2**20:.2f}" if r.peak_bytes else "-",
                     f"{r.tokens_per_s:,.0f}" if r.status == "timed" else "-", r.why or r.status])
    return rows

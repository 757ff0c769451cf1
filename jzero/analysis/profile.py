"""Per-device memory and communication read from a compiled step, beside the ZeRO formulas.

`memory` splits XLA's ``memory_analysis()`` by what the arguments are (params, optimizer
state, batch, other), using the shardings the executable was compiled with. `comm` parses the
partitioned HLO: every collective with its element count, dtype, group size and how often it runs
(while loops multiply by their trip count), and totals the ZeRO-paper volume. `analytic` gives the
paper's and DeepSpeed's estimator formulas to print beside the measurements, never instead.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from jzero.analysis import hlo
from jzero.analysis.hlo import COLLECTIVES, DTYPE_BYTES
from jzero.zero.sharding import HOST_KINDS, is_expert


# ------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryReport:
    """Bytes per device. ``arguments`` = params + opt_state + batch + other (persistent state
    is params + opt_state + other); ``peak`` = arguments + outputs + temp - aliased. ``host``:
    the state's bytes in host memory (offloaded: from the arguments' memory kinds, since
    ``memory_analysis()`` reports no host bytes on CPU, where everything is host memory).
    ``expert_params`` / ``expert_opt_state``: the part of ``params`` / ``opt_state`` that belongs
    to MoE experts (`jzero.zero.sharding.is_expert`), split over the expert axis."""

    arguments: int
    outputs: int
    temp: int
    aliased: int
    params: int
    opt_state: int
    batch: int
    other: int
    num_params: int
    host: int = 0
    host_in_arguments: bool = True  # whether ``arguments`` counts the host bytes too (CPU)
    expert_params: int = 0
    expert_opt_state: int = 0

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs + self.temp - self.aliased

    @property
    def persistent(self) -> int:
        return self.arguments - self.batch

    @property
    def device_persistent(self) -> int:
        """The persistent state in device memory: what offloading takes off the accelerator."""
        return self.persistent - (self.host if self.host_in_arguments else 0)

    def per_param(self, nbytes: int) -> float:
        return nbytes / self.num_params


def memory(compiled: Any) -> MemoryReport:
    """The per-device memory of a compiled ``jzero.train_step(state, batch)`` (or any
    executable whose first argument is a TrainState and second the batch)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("this backend reports no memory_analysis() for compiled programs")
    groups: dict[str, int] = defaultdict(int)
    num_params = host = 0
    shardings = {jax.tree_util.keystr(p): s
                 for p, s in jax.tree_util.tree_flatten_with_path(compiled.input_shardings[0])[0]}
    for path, info in jax.tree_util.tree_flatten_with_path(compiled.args_info[0])[0]:
        sharding = shardings.get(jax.tree_util.keystr(path))
        nbytes = shard_bytes(info.shape, info.dtype, sharding)
        group = _argument_group(path)
        groups[group] += nbytes
        if group in ("params", "opt_state") and is_expert(path):
            groups["expert_" + group] += nbytes
        if getattr(sharding, "memory_kind", None) in HOST_KINDS:
            host += nbytes
        if group == "params":
            num_params += math.prod(info.shape)
    return MemoryReport(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                        temp=stats.temp_size_in_bytes, aliased=stats.alias_size_in_bytes,
                        params=groups["params"], opt_state=groups["opt_state"], batch=groups["batch"],
                        other=stats.argument_size_in_bytes - groups["params"] - groups["opt_state"]
                        - groups["batch"], num_params=num_params, host=host,
                        host_in_arguments=not stats.host_argument_size_in_bytes,
                        expert_params=groups["expert_params"], expert_opt_state=groups["expert_opt_state"])


def shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    """Bytes of one device's shard of an array of ``shape`` laid out by ``sharding`` (None: whole)."""
    shard = sharding.shard_shape(shape) if sharding is not None and shape else shape
    return math.prod(shard) * dtype.itemsize


def _argument_group(path: tuple) -> str:
    if path[0].idx == 1:  # args[1]: the batch
        return "batch"
    names = [getattr(k, "name", None) for k in path]
    for group in ("params", "opt_state"):
        if group in names:
            return group
    return "other"


# ------------------------------------------------------------------------------------------
# Communication
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    kind: str
    dtype: str
    elements: int  # elements of the result (per device), all tuple parts together
    group_size: int
    count: int  # executions per step (trip counts of enclosing loops multiplied)
    name: str
    groups: tuple[tuple[int, ...], ...] | None = None  # device ids of each group, where the HLO lists them
    widened_to: str | None = None  # the dtype the backend really carries, where it widened ``dtype``
    op_name: str = ""  # the jax op_name metadata (named scopes: "moe_dispatch" marks MoE's all-to-alls)

    @property
    def wire_bytes(self) -> float:
        """Bytes per device per execution in the ZeRO paper's accounting, in the dtype the
        backend really moves (the widened one, where it widened)."""
        return self.zero_elements * DTYPE_BYTES.get(self.widened_to or self.dtype, 4)

    @property
    def zero_elements(self) -> int:
        """Elements per device per execution in the ZeRO paper's accounting: an all-gather
        moves its result, a reduce-scatter its input, an all-reduce twice its size."""
        if self.group_size <= 1:
            return 0
        return {"all-gather": self.elements, "reduce-scatter": self.elements * self.group_size,
                "all-reduce": 2 * self.elements}.get(self.kind, self.elements)

    @property
    def ring_bytes(self) -> float:
        """Bytes each device sends per execution with a ring algorithm."""
        n = self.group_size
        if n <= 1:
            return 0.0
        nbytes = self.elements * DTYPE_BYTES.get(self.dtype, 4)
        return {"all-gather": nbytes * (n - 1) / n, "reduce-scatter": nbytes * (n - 1),
                "all-reduce": 2 * nbytes * (n - 1) / n}.get(self.kind, float(nbytes))


@dataclass(frozen=True)
class CommReport:
    collectives: tuple[Collective, ...]

    def total_elements(self, kinds: tuple[str, ...] = COLLECTIVES) -> int:
        return sum(c.zero_elements * c.count for c in self.collectives if c.kind in kinds)

    def total_ring_bytes(self) -> float:
        return sum(c.ring_bytes * c.count for c in self.collectives)

    def total_wire_bytes(self) -> float:
        """`Collective.wire_bytes` of every collective, times how often it runs."""
        return sum(c.wire_bytes * c.count for c in self.collectives)

    def wire_bytes_by_kind_dtype(self) -> dict[tuple[str, str], float]:
        """Wire bytes per step by (kind, dtype moved); a widened collective is listed under
        "dtype->widened" (what the program asks for, and what this backend moves)."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for c in self.collectives:
            if c.group_size > 1:
                out[(c.kind, f"{c.dtype}->{c.widened_to}" if c.widened_to else c.dtype)] += c.wire_bytes * c.count
        return dict(out)

    def by_kind_dtype(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = defaultdict(int)
        for c in self.collectives:
            if c.group_size > 1:
                out[(c.kind, c.dtype)] += c.zero_elements * c.count
        return dict(out)


def comm(compiled: Any) -> CommReport:
    """Every collective in the partitioned HLO of ``compiled`` (or an HLO text), once (a TPU
    asynchronous collective's done fusion repeats it: `hlo.Module.echoes`)."""
    module = hlo.parse(compiled if isinstance(compiled, str) else compiled.as_text())
    found, echoes = [], module.echoes()
    for inst in module.instructions():
        kind = inst.op.removesuffix("-start")
        if kind not in COLLECTIVES or inst.name in echoes:
            continue
        shapes = hlo.shapes(inst.result)
        if inst.op in ("all-gather-start", "collective-permute-start"):  # (operands, results[, contexts])
            shapes = shapes[len(shapes) // 2:] if inst.op == "all-gather-start" else shapes[1:2]
        elements = sum(math.prod(dims) for _, dims in shapes)
        dtype = shapes[0][0] if shapes else "?"
        requested = module.requested_dtype(inst)
        op_name = re.search(r'op_name="([^"]*)"', inst.line)
        found.append(Collective(kind=kind, dtype=requested or dtype, elements=elements,
                                group_size=hlo.group_size(inst.line), count=inst.count, name=inst.name,
                                groups=hlo.replica_groups(inst.line), widened_to=dtype if requested else None,
                                op_name=op_name.group(1) if op_name else ""))
    return CommReport(tuple(found))


def axes_of(group: tuple[int, ...], mesh: Any) -> tuple[str, ...]:
    """The mesh axes a collective's group spans: those along which its devices' coordinates
    differ (ids are positions in the mesh's device order, as the partitioned program numbers them)."""
    coords = np.array(np.unravel_index(list(group), mesh.devices.shape))
    return tuple(name for name, row in zip(mesh.axis_names, coords, strict=True) if len(set(row.tolist())) > 1)


class AxisTraffic(NamedTuple):
    count: int  # executions per step
    elements: int  # result elements per device, summed over executions
    nbytes: int  # the same in bytes, in the dtype each moves


def by_axes(report: CommReport, mesh: Any) -> dict[tuple[str, tuple[str, ...]], AxisTraffic]:
    """``{(kind, mesh axes): AxisTraffic}`` of every collective whose group the HLO lists: which
    collectives run over the tensor group, the sequence group, the ZeRO group."""
    out: dict[tuple[str, tuple[str, ...]], AxisTraffic] = {}
    for c in report.collectives:
        if c.group_size <= 1 or not c.groups:
            continue
        key = (c.kind, axes_of(c.groups[0], mesh))
        old = out.get(key, AxisTraffic(0, 0, 0))
        out[key] = AxisTraffic(old.count + c.count, old.elements + c.elements * c.count,
                               old.nbytes + c.elements * c.count * DTYPE_BYTES.get(c.widened_to or c.dtype, 4))
    return out


# ------------------------------------------------------------------------------------------
# Formulas and FLOPs
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Analytic:
    """ZeRO paper (mixed-precision Adam, K=12) and DeepSpeed estimator numbers, bytes/device,
    and jzero's own contract (fp32 master + Adam, no 16-bit copy: 12 bytes/param in all)."""

    paper_bytes: float
    deepspeed_bytes: float
    jzero_bytes: float
    comm_elements: float
    extra: dict[str, float] = field(default_factory=dict)

    def __add__(self, other: "Analytic") -> "Analytic":
        """The formulas of two groups of params (e.g. an MoE model's experts and the rest)."""
        return Analytic(self.paper_bytes + other.paper_bytes, self.deepspeed_bytes + other.deepspeed_bytes,
                        self.jzero_bytes + other.jzero_bytes, self.comm_elements + other.comm_elements,
                        {**self.extra, **other.extra})


def analytic(num_params: int, stage: int, n: int, *, largest_layer_params: int = 0,
             accumulation: int = 1, offload: bool = False) -> Analytic:
    """The formulas for ``num_params`` at ``stage`` over ``n`` shards; ``comm_elements`` per step
    with ``accumulation`` micro-batches: DeepSpeed's 2 Psi at stages 0-1 (reduced once), (k + 1) Psi
    at stage 2 and 3k Psi at stage 3 (reduced every micro-batch). ``offload`` (ZeRO-Offload):
    jzero keeps the fp32 master and the optimizer state sharded in host memory (12 Psi / N) and
    nothing on the device between steps; DeepSpeed's estimator counts its 2 Psi of fp16 params
    on the GPU (stage 3: the largest layer's)."""
    psi = float(num_params)
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    deepspeed = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 18 * psi / n,
                 3: 4 * largest_layer_params + 18 * psi / n}[stage]
    jzero = {0: 12 * psi, 1: 4 * psi + 8 * psi / n, 2: 4 * psi + 8 * psi / n, 3: 12 * psi / n}[stage]
    if offload:
        deepspeed = 4 * largest_layer_params if stage == 3 else 2 * psi
        jzero = 12 * psi / n
    k = accumulation
    comm_elements = {0: 2, 1: 2, 2: k + 1, 3: 3 * k}[stage] * psi
    return Analytic(paper_bytes=paper, deepspeed_bytes=deepspeed, jzero_bytes=jzero, comm_elements=comm_elements)


def flops(compiled: Any) -> float:
    """Matmul FLOPs per step (per device): every dot and convolution of the partitioned HLO times
    its loop trip counts. Not XLA's cost analysis alone: it counts a while-loop body once, so a
    scanned layer stack would count as one layer (`xla_flops`)."""
    return float(sum(matmul_flops_by_scope(compiled).values()))


def xla_flops(compiled: Any) -> float:
    """FLOPs per step (per device) as XLA's cost analysis reports them (loop bodies once; all ops)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", np.nan)) if cost else float("nan")


SCOPES = ("embedding", "attention", "mlp", "head", "loss", "optimizer")  # jax.named_scope names


def bytes_accessed(compiled: Any) -> float:
    """Bytes read and written per step (per device) from XLA's cost analysis (where it gives only
    each operand's and the output's, as for a TPU Pallas kernel, their sum)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    if not cost:
        return float("nan")
    if "bytes accessed" in cost:
        return float(cost["bytes accessed"])
    parts = [v for k, v in cost.items() if re.fullmatch(r"bytes accessed(\d+|out)\{\}", k) and v > 0]
    return float(sum(parts)) if parts else float("nan")


def matmul_flops_by_scope(compiled: Any) -> dict[str, float]:
    """FLOPs per step (per device) of every dot and convolution in the partitioned HLO, summed
    by the first `SCOPES` name in its ``op_name`` metadata ("other" when none), times how often
    its computation runs (layer loops, micro-batch loops, fusions)."""
    module = hlo.parse(compiled if isinstance(compiled, str) else compiled.as_text())
    out: dict[str, float] = defaultdict(float)
    for inst in module.instructions():
        if inst.op not in ("dot", "convolution"):
            continue
        operands = hlo.operands(inst)
        lhs = module.dims(operands[0]) if operands else []
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.line)
        k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
        name = re.search(r'op_name="([^"]*)"', inst.line)
        path = name.group(1).split("/") if name else []
        scope = next((s for s in SCOPES if s in path), "other")
        out[scope] += 2.0 * math.prod(module.dims(inst.name)) * k * inst.count
    return dict(out)


# Dense bf16 peak TFLOP/s per device, matched by substring of `jax.Device.device_kind`.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "TPU v6": 918.0, "TPU v5p": 459.0,
               "TPU v5": 197.0, "TPU v4": 275.0}


def known_peak_tflops(device_kind: str) -> float | None:
    """The device's dense bf16 peak TFLOP/s where jzero knows it (None on CPU and unknown kinds)."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_kind), None)

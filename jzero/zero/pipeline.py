"""Pipeline parallelism's rules: which layers a stage holds, and what each stage does at each
tick of DeepSpeed's 1F1B ``TrainSchedule`` (docs/design.md, "Pipeline parallelism").

Partition (DeepSpeed's ``PipelineModule(partition_method=...)``, over the layer stack's blocks):

    method        | weights of the blocks           | split
    --------------+---------------------------------+-----------------------------------
    "uniform"     | -                               | DeepSpeed's ``partition_uniform``
    "parameters"  | each block's parameter count    | ``partition_balanced`` (linear partition)
    "type:REGEX"  | 1 where REGEX finds the block's | ``partition_balanced``
                  | class name (case-insensitive)   |

One SPMD program runs every stage, its stack sharded over the "stage" mesh axis, so every stage
must get the same number of blocks; a split that does not is refused, naming the key.

Schedule (p stages, m micro-batches, 2(m + p - 1) ticks): at tick t stage s runs a forward when
t - s is even, else a backward; forward of micro-batch i at t = 2i + s, backward at
t = 2i + 2p - 1 - s; a micro-batch id outside [0, m) is idle. So a stage never holds more than
p - s micro-batches' inputs (stage 0: p, the 1F1B bound), and each stage is idle on
2(p - 1) of the 2(m + p - 1) ticks: the bubble (p - 1) / (m + p - 1). `slot` is written in
arithmetic that Python ints and traced JAX integers share, so the table the tests and
`jzero estimate` read is the one the step runs.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError
from jzero.zero.mesh import STAGE
from jzero.zero.sharding import STACKED_KEY

IDLE, FORWARD, BACKWARD = 0, 1, 2  # what a stage does at a tick (`slot`'s op)
METHODS = ("parameters", "uniform", "type:REGEX")


def check_method(method: str) -> None:
    """ConfigError naming ``pipeline.partition`` unless it is one of `METHODS`."""
    if method in ("parameters", "uniform"):
        return
    if method.startswith("type:"):
        try:
            re.compile(method[len("type:"):], re.IGNORECASE)
        except re.error as e:
            raise ConfigError(f"pipeline.partition: {method!r} is not a valid regex ({e})") from None
        return
    raise ConfigError(f"pipeline.partition: {method!r} is not one of {', '.join(METHODS)}")


def partition_uniform(items: int, parts: int) -> list[int]:
    """DeepSpeed's ``partition_uniform``: ``parts + 1`` boundaries, the remainder to the first parts."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    chunk, residual = divmod(items, parts)
    return [p * chunk + min(p, residual) for p in range(parts + 1)]


def partition_balanced(weights: Sequence[float], parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the contiguous split whose heaviest and lightest parts
    differ least (the linear partition problem, by dynamic programming); boundaries."""
    n = len(weights)
    if n <= parts:
        return partition_uniform(n, parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = {(0, 0): (0.0, -inf, inf)}  # (i items, j parts) -> (cost, heaviest, lightest)
    start: dict[tuple[int, int], int] = {}
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(j - 1, i):
                if (k, j - 1) not in best:
                    continue
                _, heavy, light = best[(k, j - 1)]
                part = prefix[i] - prefix[k]
                heavy, light = max(heavy, part), min(light, part)
                if (i, j) not in best or best[(i, j)][0] >= heavy - light:
                    best[(i, j)], start[(i, j)] = (heavy - light, heavy, light), k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(start[(bounds[-1], j)])
    return bounds[::-1]


def partition(method: str, names: Sequence[str], sizes: Sequence[int], stages: int) -> list[int]:
    """The ``stages + 1`` boundaries ``method`` puts between blocks named ``names`` holding
    ``sizes`` parameters each."""
    check_method(method)
    if method == "uniform":
        return partition_uniform(len(names), stages)
    if method == "parameters":
        return partition_balanced(list(sizes), stages)
    regex = re.compile(method[len("type:"):], re.IGNORECASE)
    weights = [1 if regex.search(name) else 0 for name in names]
    if not any(weights):
        raise ConfigError(f"pipeline.partition: {method!r} finds none of the layer stack's blocks "
                          f"({', '.join(sorted(set(names)))})")
    return partition_balanced(weights, stages)


def layers_per_stage(method: str, names: Sequence[str], sizes: Sequence[int], stages: int) -> int:
    """How many of the stack's blocks each stage holds; ConfigError naming ``pipeline.partition``
    (or ``pipeline.stages``) when ``method`` does not give every stage the same number."""
    bounds = partition(method, names, sizes, stages)
    counts = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if len(set(counts)) > 1 or counts[0] == 0:
        raise ConfigError(f"pipeline.partition: {method!r} splits the {len(names)} blocks of the layer stack "
                          f"{counts} over pipeline.stages {stages}; every stage must hold the same number (one "
                          f"program over a stacked layer axis): use stages that divide {len(names)}")
    return counts[0]


def ticks(stages: int, micro_batches: int) -> int:
    """The 1F1B schedule's length: 2(m + p - 1) ticks (the step runs m + p - 1 loop iterations
    of two ticks each)."""
    return 2 * (micro_batches + stages - 1)


def slot(tick: Any, stage: Any, stages: int, micro_batches: int) -> tuple[Any, Any]:
    """(op, micro-batch) of ``stage`` at ``tick``: `FORWARD`, `BACKWARD` or `IDLE` (micro-batch
    then meaningless). Python ints or traced JAX integers alike."""
    forward = (tick - stage) % 2 == 0
    first = (tick - stage) // 2
    second = (tick - (2 * stages - 1 - stage)) // 2
    micro = second + forward * (first - second)
    valid = (micro >= 0) & (micro < micro_batches)
    return valid * (BACKWARD - forward * (BACKWARD - FORWARD)), micro


def table(stages: int, micro_batches: int) -> list[list[tuple[int, int]]]:
    """Every stage's (op, micro-batch) at every tick: rows are ticks."""
    return [[tuple(int(v) for v in slot(t, s, stages, micro_batches)) for s in range(stages)]
            for t in range(ticks(stages, micro_batches))]


def idle_fraction(stages: int, micro_batches: int) -> float:
    """The fraction of stage-ticks `table` leaves idle (DeepSpeed's bubble: (p - 1) / (m + p - 1))."""
    rows = table(stages, micro_batches)
    return sum(op == IDLE for row in rows for op, _ in row) / (len(rows) * stages)


def in_flight(stages: int, micro_batches: int) -> list[int]:
    """Each stage's most micro-batches forwarded and not yet backwarded at once (stage s: p - s,
    capped by m): the stage inputs it keeps."""
    peak = [0] * stages
    live = [0] * stages
    for row in table(stages, micro_batches):
        for s, (op, _) in enumerate(row):
            live[s] += (op == FORWARD) - (op == BACKWARD)
            peak[s] = max(peak[s], live[s])
    return peak


def stage_specs(specs: Any, params_shape: Any, stack: str, block: str, stages: int, method: str) -> Any:
    """``specs`` (the params' PartitionSpecs, None: all replicated) with the layer stack's leading (block) dimension
    over "stage": each stage holds a contiguous `layers_per_stage` of the blocks, every other
    leaf (the ends) every stage's. ConfigError naming ``pipeline.stages`` for a model without
    a stack under ``params[stack]["stacked"]``."""
    stacked = params_shape.get(stack, {}).get(STACKED_KEY) if isinstance(params_shape, dict) else None
    if not stacked:
        raise ConfigError(f"pipeline.stages: {stages} needs the model's layer stack under params[{stack!r}]"
                          f"[{STACKED_KEY!r}] (jzero.models.layers.scan_layers)")
    specs = jax.tree.map(lambda _: P(), params_shape) if specs is None else specs
    leaves = jax.tree.leaves(stacked)
    blocks = leaves[0].shape[0]
    per_block = sum(math.prod(x.shape[1:]) for x in leaves)
    layers_per_stage(method, [block] * blocks, [per_block] * blocks, stages)

    def with_stage(spec: P) -> P:
        return P(STAGE, *tuple(spec)[1:])

    return {**specs, stack: {**specs[stack], STACKED_KEY: jax.tree.map(with_stage, specs[stack][STACKED_KEY],
                                                                       is_leaf=lambda x: isinstance(x, P))}}

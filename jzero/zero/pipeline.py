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

Schedule (p stages, m micro-batches, v repeats): at tick t stage s runs a forward when t - s is
even, else a backward: its u-th forward at t = 2u + s, its u-th backward at
t = 2u + (v + 1)p - 1 - s; u outside [0, mv) is idle. At v = 1, u is the micro-batch: DeepSpeed's
1F1B, 2(m + p - 1) ticks, stage s holding at most p - s micro-batches' inputs (stage 0: p, the
1F1B bound), idle (p - 1) / (m + p - 1). Circular stages (v > 1: chunk r·p + s of the stack on
stage s) take micro-batches in groups of p / 2, each group's repeats in turn (backward: in
reverse), so the last stage's output reaches the first stage on the very tick it is due there:
2mv + (v + 1)p - 2 ticks, idle ((v + 1)p - 2) / (2mv + (v + 1)p - 2). `slot` is written in
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


def layers_per_stage(method: str, names: Sequence[str], sizes: Sequence[int], stages: int, repeats: int = 1) -> int:
    """How many of the stack's blocks each of the stages x repeats chunks holds; ConfigError
    naming ``pipeline.partition`` when ``method`` does not give every chunk the same number."""
    bounds = partition(method, names, sizes, stages * repeats)
    counts = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if len(set(counts)) > 1 or counts[0] == 0:
        over = f"pipeline.stages {stages}" + (f" x pipeline.repeats {repeats}" if repeats > 1 else "")
        raise ConfigError(f"pipeline.partition: {method!r} splits the {len(names)} blocks of the layer stack "
                          f"{counts} over {over}; every stage must hold the same number (one program over a "
                          f"stacked layer axis): use stages{' x repeats' * (repeats > 1)} that divide {len(names)}")
    return counts[0]


def group(stages: int, repeats: int) -> int:
    """Micro-batches that go round the ring together (circular stages: stages / 2, so stage
    p - 1's output reaches stage 0 on the very tick it is due there; 1 without repeats)."""
    return stages // 2 if repeats > 1 else 1


def check_repeats(stages: int, micro_batches: int, repeats: int) -> None:
    """ConfigError naming the key unless circular stages' schedule fits: repeats >= 1, an even
    stage count and micro-batches in whole groups of stages / 2."""
    if repeats < 1:
        raise ConfigError(f"pipeline.repeats: must be >= 1 (1: not circular), got {repeats}")
    if repeats == 1:
        return
    if stages % 2:
        raise ConfigError(f"pipeline.repeats: {repeats} needs an even pipeline.stages (micro-batches go round the "
                          f"ring in groups of stages / 2), got {stages}")
    if micro_batches % group(stages, repeats):
        raise ConfigError(f"gradient_accumulation_steps: {micro_batches} is not a multiple of pipeline.stages / 2 = "
                          f"{group(stages, repeats)} (circular stages run micro-batches in such groups)")


def ticks(stages: int, micro_batches: int, repeats: int = 1) -> int:
    """The schedule's length: 2mv + (v + 1)p - 2 ticks (1F1B's 2(m + p - 1) at v = 1), run as
    half as many loop iterations of two ticks each."""
    return 2 * micro_batches * repeats + (repeats + 1) * stages - 2


def bubble_formula(stages: int, micro_batches: int, repeats: int = 1) -> float:
    """The idle fraction of `table`'s schedule in closed form: ((v + 1)p - 2) / (2mv + (v + 1)p - 2),
    DeepSpeed's (p - 1) / (m + p - 1) at v = 1."""
    idle = (repeats + 1) * stages - 2
    return idle / (2 * micro_batches * repeats + idle)


def slot(tick: Any, stage: Any, stages: int, micro_batches: int, repeats: int = 1) -> tuple[Any, Any, Any]:
    """(op, micro-batch, repeat) of ``stage`` at ``tick``: `FORWARD`, `BACKWARD` or `IDLE` (the
    other two then meaningless). Python ints or traced JAX integers alike."""
    q, v = group(stages, repeats), repeats
    forward = (tick - stage) % 2 == 0
    first = (tick - stage) // 2
    second = (tick - ((v + 1) * stages - 1 - stage)) // 2
    u = second + forward * (first - second)  # the op's place in the stage's forward (backward) order
    valid = (u >= 0) & (u < micro_batches * v)
    micro = u // (q * v) * q + u % q
    turn = u % (q * v) // q
    repeat = turn + (1 - forward) * (v - 1 - 2 * turn)  # backward: the repeats in reverse
    return valid * (BACKWARD - forward * (BACKWARD - FORWARD)), micro, repeat


def table(stages: int, micro_batches: int, repeats: int = 1) -> list[list[tuple[int, int, int]]]:
    """Every stage's (op, micro-batch, repeat) at every tick: rows are ticks."""
    return [[tuple(int(x) for x in slot(t, s, stages, micro_batches, repeats)) for s in range(stages)]
            for t in range(ticks(stages, micro_batches, repeats))]


def idle_fraction(stages: int, micro_batches: int, repeats: int = 1) -> float:
    """The fraction of stage-ticks `table` leaves idle (`bubble_formula`)."""
    rows = table(stages, micro_batches, repeats)
    return sum(op == IDLE for row in rows for op, _, _ in row) / (len(rows) * stages)


def branch_fractions(stages: int, micro_batches: int, repeats: int = 1) -> tuple[tuple[float, ...],
                                                                               tuple[float, ...]]:
    """How often, averaged over the stages, a tick runs each op (idle, forward, backward: every
    stage runs each of its m x v forwards and backwards once), and how often a forward or backward
    is the last virtual stage's (not last, last: ``lax.cond``'s branch order), which alone runs the
    head and skips the forward; for `jzero.zero.branches`."""
    t, work = ticks(stages, micro_batches, repeats), micro_batches * repeats
    last = 1 / (stages * repeats)
    return ((t - 2 * work) / t, work / t, work / t), (1 - last, last)


def forward_index(micro: Any, repeat: Any, stages: int, repeats: int = 1) -> Any:
    """The place of (micro-batch, repeat) in a stage's forward order."""
    q = group(stages, repeats)
    return micro // q * q * repeats + repeat * q + micro % q


def _live(stages: int, micro_batches: int, repeats: int) -> list[list[set[int]]]:
    """Each stage's forward indices forwarded and not yet backwarded, after each tick."""
    live: list[set[int]] = [set() for _ in range(stages)]
    after = []
    for row in table(stages, micro_batches, repeats):
        for s, (op, i, r) in enumerate(row):
            u = forward_index(i, r, stages, repeats)
            live[s] = live[s] | {u} if op == FORWARD else live[s] - {u}
        after.append([set(x) for x in live])
    return after


def in_flight(stages: int, micro_batches: int, repeats: int = 1) -> list[int]:
    """Each stage's most (micro-batch, repeat) inputs forwarded and not yet backwarded at once
    (stage s: p - s at v = 1, capped by m): the stage inputs it keeps."""
    return [max(len(row[s]) for row in _live(stages, micro_batches, repeats)) for s in range(stages)]


def stash_size(stages: int, micro_batches: int, repeats: int = 1) -> int:
    """Slots of the ring a stage keeps its inputs in, keyed by `forward_index` modulo this: the
    widest span of forward indices alive at once on any stage (p at v = 1)."""
    return max(max(x) - min(x) + 1 for row in _live(stages, micro_batches, repeats) for x in row if x)


def stage_specs(specs: Any, params_shape: Any, stack: str, block: str, stages: int, method: str,
                repeats: int = 1) -> Any:
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
    layers_per_stage(method, [block] * blocks, [per_block] * blocks, stages, repeats)

    def with_stage(spec: P) -> P:
        return P(STAGE, *tuple(spec)[1:])

    return {**specs, stack: {**specs[stack], STACKED_KEY: jax.tree.map(with_stage, specs[stack][STACKED_KEY],
                                                                       is_leaf=lambda x: isinstance(x, P))}}

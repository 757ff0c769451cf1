"""Reading XLA's partitioned HLO text: computations, instructions, how often each runs, shapes
and replica groups. `jzero.analysis.profile` builds its reports on this small API (`parse`,
`Module.instructions`, `shapes`, `operands`, `replica_groups`, `group_size`); the regular
expressions stay here.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from jzero.zero import branches

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z\-]+)\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_DONE_TARGET = 'custom_call_target="AsyncCollectiveDone"'
_CALLEE = re.compile(r"(?:calls|to_apply|condition|body|branch_computations|called_computations)="
                     r"\{?(%[\w.\-]+(?:, ?%[\w.\-]+)*)\}?")


class Instruction(NamedTuple):
    name: str
    result: str  # the result type text, e.g. "f32[8,16]" or a tuple of them
    op: str  # e.g. "all-gather", "dot", "all-reduce-start"
    line: str
    count: float  # executions per call of ENTRY (loop trip counts multiplied; branches' fractions)


class Module(NamedTuple):
    """A parsed HLO module: each computation's instruction lines and how often it runs."""

    lines: dict[str, list[str]]  # computation -> instruction lines
    counts: dict[str, float]  # computation -> executions per call of ENTRY
    defs: dict[str, str]  # instruction name -> its line

    def instructions(self) -> Iterator[Instruction]:
        for comp, lines in self.lines.items():
            for line in lines:
                if m := _INSTRUCTION.match(line):
                    yield Instruction(m.group(1), m.group(2), m.group(3), line, self.counts.get(comp, 0))

    def dims(self, name: str) -> list[int]:
        """The first result shape's dimensions of instruction ``name`` ([] if unknown)."""
        m = _INSTRUCTION.match(self.defs.get(name, ""))
        found = shapes(m.group(2)) if m else []
        return found[0][1] if found else []

    def echoes(self) -> set[str]:
        """Names of collectives that repeat another: the TPU runs an asynchronous collective as a
        start fusion holding it, compute fusions it progresses in (``async_collective_fusion*``)
        and a done fusion, each holding a copy of it (same channel, same shape), so only the
        start's counts."""
        return {m.group(1) for comp, lines in self.lines.items()
                if comp.startswith("async_collective_fusion") or any(_DONE_TARGET in ln for ln in lines)
                for ln in lines if (m := _INSTRUCTION.match(ln)) and m.group(3) in COLLECTIVES}

    def requested_dtype(self, inst: Instruction) -> str | None:
        """The 16-bit dtype a reduction was asked for where the backend widened it, else None."""
        return _requested_dtype(inst.line, self.defs, self.lines)


def parse(text: str) -> Module:
    """The HLO text as a `Module`."""
    lines, entry = _computations(text)
    defs = {m.group(1): line for group in lines.values() for line in group if (m := _INSTRUCTION.match(line))}
    return Module(lines, _execution_counts(lines, entry), defs)


def shapes(result: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of every array in a result type text (a tuple has several)."""
    return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _SHAPE.findall(result)]


def operands(inst: Instruction) -> list[str]:
    """The names of an instruction's operands."""
    return re.findall(r"%([\w.\-]+)", inst.line.split(inst.op + "(", 1)[1].split(")", 1)[0])


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """The HLO text's instruction lines by computation name, and the ENTRY computation's name."""
    instructions: dict[str, list[str]] = defaultdict(list)
    entry, current = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("(")[0]:
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is not None and line.strip() and line.strip() != "}":
            instructions[current].append(line)
    return instructions, entry


def _execution_counts(instructions: dict[str, list[str]], entry: str | None) -> dict[str, float]:
    """How many times each computation runs per call of ENTRY (while bodies x trip count; a
    conditional's branches x the fractions its scope says, `jzero.zero.branches`, else each in full)."""
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for comp, lines in instructions.items():
        for line in lines:
            trip = 1
            if " while(" in line:
                t = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trip = int(t.group(1)) if t else _bound(line, instructions)
            for group in _CALLEE.findall(line):
                callees = [c.strip().lstrip("%") for c in group.split(",")]
                shares = _branch_shares(line, len(callees)) if " conditional(" in line else None
                for i, callee in enumerate(callees):
                    calls[comp].append((callee, trip if shares is None else shares[i]))
    counts: dict[str, float] = defaultdict(float)

    def visit(comp: str, times: float) -> None:
        counts[comp] += times
        for callee, trip in calls.get(comp, ()):
            visit(callee, times * trip)

    if entry is not None:
        visit(entry, 1)
    return counts


def _bound(line: str, instructions: dict[str, list[str]]) -> int:
    """A while loop's trip count from its condition where the backend records none (TPU): a
    counter from 0 compared ``LT`` with a constant, as `jax.lax.scan` and ``fori_loop`` write it;
    1 for any other loop."""
    cond = re.search(r"condition=%([\w.\-]+)", line)
    lines = instructions.get(cond.group(1), []) if cond else []
    root = next((ln for ln in lines if ln.lstrip().startswith("ROOT ") and " compare(" in ln), "")
    if "direction=LT" not in root:
        return 1
    constants = {m.group(1): int(m.group(2)) for ln in lines
                 if (m := re.match(r"\s*%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", ln))}
    bound = [constants[name] for name in re.findall(r"%([\w.\-]+)", root.split("compare(", 1)[1]) if name in constants]
    return bound[0] if bound else 1


def _branch_shares(line: str, n: int) -> tuple[float, ...] | None:
    name = re.search(r'op_name="([^"]*)"', line)
    return None if name is None else branches.fractions(name.group(1), n)


def _requested_dtype(line: str, defs: dict[str, str], instructions: dict[str, list[str]]) -> str | None:
    """The 16-bit dtype a reduction was asked for when the backend widened it: XLA's CPU backend
    reduces bf16/f16 in f32 (its reduction computation renamed ``*_promoted``, the operand a
    fusion that rounds to 16 bits and converts back). None when nothing was widened."""
    if not re.search(r"to_apply=%[\w.\-]+_promoted\b", line):
        return None
    return _rounded_to(line, defs, instructions, depth=2)


def _rounded_to(line: str, defs: dict[str, str], instructions: dict[str, list[str]], depth: int) -> str | None:
    """The 16-bit dtype the operands of ``line`` were rounded to, looking through ``depth``
    levels of concatenation (a gradient bucket: `jzero.zero.buckets`)."""
    call = re.search(r" [a-z\-]+\(([^)]*)\)", line.split("=", 1)[1])
    operands = re.findall(r"%([\w.\-]+)", call.group(1)) if call else []
    for name in operands:
        text = defs.get(name, "")
        callee = re.search(r"calls=%([\w.\-]+)", text)
        body = text + "\n".join(instructions.get(callee.group(1), [])) if callee else text
        for wanted in ("bf16", "f16"):
            if re.search(rf"\b{wanted}\[", body):
                return wanted
        if depth and " concatenate(" in text:
            found = _rounded_to(text, defs, instructions, depth - 1)
            if found:
                return found
    return None


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups as device-id tuples: explicit ``{{0,1},{2,3}}`` or the iota form
    ``[2,4]<=[4,2]T(1,0)``; None for forms that need the mesh to resolve."""
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return tuple(tuple(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        ids = np.arange(math.prod(int(d) for d in m.group(2).split(","))).reshape(
            [int(d) for d in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                  r"\{([^}]*)\}", line)
    if m:  # Shardy's form: named mesh axes over (permuted) device ids; the group spans the named axes
        axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
        ids = np.arange(math.prod(size for _, size in axes))
        if m.group(2):
            ids = ids.reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        names = [a for a, _ in axes]
        over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        grid = np.moveaxis(ids.reshape([size for _, size in axes]), over, range(-len(over), 0))
        return tuple(tuple(int(i) for i in row) for row in grid.reshape(-1, math.prod(grid.shape[-len(over):])))
    return None


def source_target_pairs(line: str) -> tuple[tuple[int, int], ...]:
    """A collective-permute's (source, target) device ids."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else ()


def group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        axes = re.search(r"\{('[\w']+(?:,\s*'\w+')*)\}", line[m.end():])
        names = re.findall(r"'(\w+)'", axes.group(1)) if axes else list(sizes)
        return math.prod(int(sizes[a]) for a in names)
    if "replica_groups={}" in line:
        return 0  # all devices: resolved by the caller if needed
    return 1

"""How much of a step's communication runs while compute runs, read from the scheduled program.

A scheduled HLO module (``is_scheduled=true``: each computation's instructions in the order the
device runs them) shows asynchronous collectives as a start and a done with other instructions
between them. Two forms occur:

* XLA's async pairs: ``all-gather-start`` / ``all-gather-done``, ``all-reduce-start`` /
  ``-done``, ``collective-permute-start`` / ``-done``, ``async-start`` / ``async-done`` around a
  reduce-scatter or an all-to-all (XLA:GPU, XLA:CPU);
* the TPU's: a fusion whose computation holds the collective and ends in the custom call
  ``AsyncCollectiveStart``, then the fusions the compiler scheduled beside it, then a fusion whose
  computation ends in ``AsyncCollectiveDone`` on the start's outputs.

A collective is *overlapped* when at least one compute instruction (a fusion, a matmul, a copy:
anything but bookkeeping and other collectives' starts and dones) runs between its start and
its done; a collective run synchronously (the compiler found nothing to put beside it, or was
not asked to) is not. `overlapped_fraction` weights each by its wire bytes (`profile.Collective`)
and how often it runs: the share of the step's communication that is hidden behind compute, the
figure DeepSpeed's ``overlap_comm`` and prefetching are for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jzero.analysis import hlo, profile
from jzero.analysis.hlo import COLLECTIVES

_BOOKKEEPING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
                "replica-id", "copy-start", "copy-done", "opt-barrier", "add-dependency"}
_START_OPS = tuple(f"{k}-start" for k in COLLECTIVES) + ("async-start",)
_DONE_OPS = tuple(f"{k}-done" for k in COLLECTIVES) + ("async-done",)
_TARGET = re.compile(r'custom_call_target="(AsyncCollectiveStart|AsyncCollectiveDone)"')
_CALLS = re.compile(r"(?:calls|called_computations)=\{?%([\w.\-]+)")


@dataclass(frozen=True)
class Overlap:
    """Wire bytes per step (per device) of the step's collectives, and the part of them that
    runs beside compute; ``windows``: the compute instructions between each async start and
    its done, by collective name."""

    total_bytes: float
    overlapped_bytes: float
    windows: dict[str, int]

    @property
    def fraction(self) -> float:
        return self.overlapped_bytes / self.total_bytes if self.total_bytes else 0.0


def overlapped(compiled: Any) -> Overlap:
    """The `Overlap` of a compiled step (or its scheduled HLO text)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    module = hlo.parse(text)
    report = profile.comm(text)
    windows = _windows(module)
    total = overlapped_bytes = 0.0
    for c in report.collectives:
        if c.group_size <= 1:
            continue
        nbytes = c.wire_bytes * c.count
        total += nbytes
        if windows.get(c.name, 0) > 0:
            overlapped_bytes += nbytes
    return Overlap(total, overlapped_bytes, windows)


def _role(line: str, op: str, module: hlo.Module) -> str | None:
    """"start" / "done" for an async collective's start or done instruction, else None."""
    if op in _START_OPS:
        return "start"
    if op in _DONE_OPS:
        return "done"
    if op == "fusion" and (callee := _CALLS.search(line)):
        found = _TARGET.search("\n".join(module.lines.get(callee.group(1), ())))
        if found:
            return "start" if found.group(1) == "AsyncCollectiveStart" else "done"
    return None


def _collectives_of(line: str, op: str, name: str, module: hlo.Module) -> list[str]:
    """The collective instructions a start runs: itself (``all-gather-start``), or those in the
    computation it calls (the TPU's start fusion, ``async-start``)."""
    if op.removesuffix("-start") in COLLECTIVES:
        return [name]
    callee = _CALLS.search(line)
    lines = module.lines.get(callee.group(1), ()) if callee else ()
    return [m.group(1) for ln in lines if (m := hlo._INSTRUCTION.match(ln))
            and m.group(3).removesuffix("-start") in COLLECTIVES]


def _windows(module: hlo.Module) -> dict[str, int]:
    """Collective name -> compute instructions scheduled between its start and its done."""
    out: dict[str, int] = {}
    for lines in module.lines.values():
        parsed = [(m.group(1), m.group(3), line) for line in lines if (m := hlo._INSTRUCTION.match(line))]
        deps = {name: hlo.operands(hlo.Instruction(name, "", op, line, 0)) for name, op, line in parsed}
        open_starts: dict[str, tuple[list[str], int]] = {}  # start name -> (its collectives, compute seen)
        for name, op, line in parsed:
            role = _role(line, op, module)
            if role == "start":
                open_starts[name] = (_collectives_of(line, op, name, module), 0)
            elif role == "done":
                for start in _matching(line, op, name, open_starts, deps, module):
                    collectives, seen = open_starts.pop(start)
                    out.update(dict.fromkeys(collectives, seen))
            elif op not in _BOOKKEEPING:
                open_starts = {k: (c, seen + 1) for k, (c, seen) in open_starts.items()}
    return out


def _matching(line: str, op: str, name: str, open_starts: dict[str, tuple[list[str], int]],
              deps: dict[str, list[str]], module: hlo.Module) -> set[str]:
    """The open starts a done ends: the TPU's done fusion repeats its collective (same channel
    and shape: `_key`); XLA's ``*-done`` takes its start (through get-tuple-elements)."""
    key = _key(_collectives_of(line, op, name, module), module)
    if key:
        return {s for s, (collectives, _) in open_starts.items() if _key(collectives, module) == key}
    return _starts_reached(name, set(open_starts), deps)


def _key(collectives: list[str], module: hlo.Module) -> tuple[str, ...]:
    """The channels and result shapes of ``collectives``: what a start and its done share."""
    out = []
    for c in collectives:
        line = module.defs.get(c, "")
        channel = re.search(r"channel_id=(\d+)", line)
        found = hlo._INSTRUCTION.match(line)
        out.append(f"{channel.group(1) if channel else '?'}:{hlo.shapes(found.group(2)) if found else ''}")
    return tuple(sorted(out))


def _starts_reached(done: str, starts: set[str], deps: dict[str, list[str]]) -> set[str]:
    """The open starts a done consumes: through get-tuple-elements and through the compute
    fusions the TPU compiler threads the start's buffers through on their way to the done."""
    found, seen, todo = set(), set(), list(deps.get(done, ()))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in starts:
            found.add(name)
        else:
            todo.extend(deps.get(name, ()))
    return found

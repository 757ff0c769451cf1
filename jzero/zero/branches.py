"""How often each branch of a conditional runs, said by the program itself for whoever counts
its work from the compiled HLO (`jzero.analysis.hlo`).

A compiled program's ``conditional`` names every branch it may take; counting each branch's work
at every execution (what a reader of the HLO must do without more) counts the pipeline's
forward, backward and idle ticks all at once: ~3.9x the FLOPs the step runs (issue 49). The
code that builds a ``lax.switch`` or ``lax.cond`` knows how often each branch is taken (the
pipeline's schedule table does), so it traces it under a scope whose name carries the fractions
(`scope`); the scope name reaches the HLO's ``op_name`` metadata, where `fractions` reads it
back. A conditional without such a scope is counted in full, as before: an upper bound.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

PREFIX = "jzero_branches="
_FOUND = re.compile(re.escape(PREFIX) + r"([\d.e:+-]+)\)*/(?:cond|switch)$")


def scope(fractions: Sequence[float]) -> str:
    """A ``jax.named_scope`` name saying branch i (``lax.switch``'s order; ``lax.cond``'s is
    false, true) runs ``fractions[i]`` of the times its conditional is reached, averaged over devices."""
    return PREFIX + ":".join(f"{f:.9g}" for f in fractions)


def fractions(op_name: str, branches: int) -> tuple[float, ...] | None:
    """The fractions a conditional's ``op_name`` carries (None: not said, or not ``branches`` of them)."""
    found = _FOUND.search(op_name)
    if found is None:
        return None
    out = tuple(float(f) for f in found.group(1).split(":"))
    return out if len(out) == branches else None

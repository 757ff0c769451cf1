"""Weight gradients kept in the dot form XLA:CPU runs fast (docs/design.md, "Engine overhead").

JAX differentiates a dense kernel into a dot giving ``[out, in]`` followed by a transpose.
XLA:CPU's algebraic simplifier folds a transpose that directly follows a dot into the dot's
dimension numbers; the folded dot contracts its left operand on its first dimension, which
YNNPACK does not take, so it runs on Eigen (1024x512x1536 f32: 10.1 ms YNNPACK, 15.2 ms Eigen).
`unfold` writes the two transposes that cancel onto the dot with an optimization barrier between
them: the dot keeps its fast form and the one real transpose is a copy. GSPMD's data parallelism
gets the same by accident (its all-reduce sits between dot and transpose). Only XLA:CPU folds
this way into a slower kernel; GPU and TPU matmuls take either operand order at no cost, so
elsewhere the gradient passes through untouched. The copy costs per parameter and the saving
grows with the rows a dot contracts, so the plain stack (`pays_for`) unfolds only from
`MIN_ROWS` rows a device (25M GPT, fp32, overhead.py: 1,024 rows +4%, 256 rows -6%).
"""
from __future__ import annotations

from typing import Any

import jax

MIN_ROWS = 1024


def applies(platform: str) -> bool:
    """Whether gradients computed on ``platform`` (a device's ``.platform``) are worth unfolding."""
    return platform == "cpu"


def pays_for(x: Any) -> bool:
    """Whether a layer stack over activations ``x`` (a pytree; rows are all axes but the last)
    contracts its weight gradients over at least `MIN_ROWS` rows."""
    return max((leaf.size // leaf.shape[-1] for leaf in jax.tree.leaves(x) if leaf.ndim >= 2), default=0) >= MIN_ROWS


def unfold(ct: jax.Array) -> jax.Array:
    """``ct`` itself; a 2-D ``ct`` computed by a dot and a transpose is kept from being folded
    into one dot (the transposes cancel onto the dot, the barrier keeps the last apart)."""
    if ct.ndim != 2:
        return ct
    return jax.lax.optimization_barrier(ct.T).T

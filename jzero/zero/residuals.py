"""A vjp's residuals as arrays to keep: what a forward saves for its backward, stored between
the two (the pipeline's 1F1B stash, `jzero.train.pipestep`) so the backward does not run the
forward again.

``jax.vjp`` returns its pullback as a pytree whose leaves are the residuals the model's remat
policy saves (under "full", each layer's input; under "none", every activation). Some leaves
are the forward's own inputs (the parameters, the micro-batch): those are not stored, the
backward hands them back (`pullback`), so a stash holds one micro-batch's activations and
nothing of the weights. `Saved` says which leaf is which; it is static, so a ring of stashes
can be allocated before the forward runs (`shapes`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jzero.zero import remat


class Saved(NamedTuple):
    """The pullback's structure: its treedef and, per residual leaf, the index of the input leaf
    it is (handed back at the backward) or None (stored)."""

    tree: Any
    source: tuple[int | None, ...]
    spaces: tuple[Any, ...] = ()  # each stored leaf's memory space (the "offload" policy's: host)


def forward(fn: Callable[..., Any], consts: Any, params: Any, own: Any) -> tuple[Any, list[jax.Array], Saved]:
    """(``fn(consts, params, own)``, the residuals of its vjp in (params, own) to store, their
    `Saved`). ``consts`` and ``params`` the backward hands back (`pullback`); a residual that is
    one of their leaves (by identity) is not stored."""
    out, pull = jax.vjp(lambda p, x: fn(consts, p, x), params, own)
    leaves, tree = jax.tree.flatten(pull)
    ids = {id(x): i for i, x in enumerate(jax.tree.leaves((consts, params)))}
    source = tuple(ids.get(id(leaf)) for leaf in leaves)
    stored = [leaf for leaf, i in zip(leaves, source, strict=True) if i is None]
    return out, stored, Saved(tree, source, tuple(jax.typeof(leaf).memory_space for leaf in stored))


def zeros(shapes: list[Any], saved: Saved, leading: tuple[int, ...] = ()) -> list[jax.Array]:
    """Zeros shaped as the stored residuals (``leading`` dims first: a ring of them), each in
    the memory space its residual lives in."""
    return [remat.into(jnp.zeros((*leading, *s.shape), s.dtype), space)
            for s, space in zip(shapes, saved.spaces, strict=True)]


def pullback(saved: Saved, consts: Any, params: Any, stored: list[jax.Array]) -> Callable[..., Any]:
    """The vjp function of `forward` (cotangent of its output -> those of params and own),
    rebuilt from its ``stored`` residuals and the same ``consts`` and ``params``."""
    given, kept = jax.tree.leaves((consts, params)), iter(stored)
    leaves = [next(kept) if i is None else given[i] for i in saved.source]
    return jax.tree.unflatten(saved.tree, leaves)


def shapes(fn: Callable[..., Any], consts: Any, params: Any, own: Any) -> tuple[Any, list[Any], Saved]:
    """`forward`'s output and stored residuals as ``jax.ShapeDtypeStruct``s, and its `Saved`,
    without running it."""
    found: list[Saved] = []

    def run(consts, params, own):
        out, stored, saved = forward(fn, consts, params, own)
        found.append(saved)
        return out, stored

    out, stored = jax.eval_shape(run, consts, params, own)
    return out, stored, found[0]

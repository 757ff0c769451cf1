"""Leaves by name: one spelling of a pytree path, shared by checkpoints, export and `init(params=)`.

A leaf's name joins its path with ``/`` (``params/blocks/stacked/mlp/fc/kernel``): dict keys,
attribute names and sequence indices alike. Matching trees by these names, not by treedefs,
makes a checkpoint or an exported file independent of container classes (optax's NamedTuples,
Flax's dicts) and lets a mismatch be reported as the first leaf that differs.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

SEP = "/"


def key_name(key: Any) -> str:
    """One path element as text: a dict key, an attribute name or a sequence index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{name: leaf}`` in tree order; None and empty nodes hold no leaves and are skipped."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[SEP.join([prefix, *map(key_name, path)] if prefix else map(key_name, path))] = leaf
    return out


def nest(named: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts from ``{name: leaf}`` (the plain form Orbax and safetensors users expect)."""
    root: dict[str, Any] = {}
    for name, leaf in named.items():
        node = root
        *parents, last = name.split(SEP)
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return root


def fill(template: Any, named: Mapping[str, Any]) -> Any:
    """``template``'s structure with each leaf replaced by ``named[its name]``."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [named[SEP.join(map(key_name, p))] for p, _ in paths])


def first_mismatch(want: Mapping[str, tuple], have: Mapping[str, tuple], want_label: str,
                   have_label: str) -> str | None:
    """The first leaf whose name or shape differs between two ``{name: shape}`` maps, as a
    sentence; None when they agree."""
    for name, shape in want.items():
        if name not in have:
            return f"{name} (shape {list(shape)}) is in the {want_label} but not in the {have_label}"
        if tuple(have[name]) != tuple(shape):
            return (f"{name} has shape {list(have[name])} in the {have_label} but {list(shape)} "
                    f"in the {want_label}")
    for name, shape in have.items():
        if name not in want:
            return f"{name} (shape {list(shape)}) is in the {have_label} but not in the {want_label}"
    return None

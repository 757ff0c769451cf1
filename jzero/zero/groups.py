"""Parameter groups and frozen parameters: which leaves train, and with what.

Every leaf gets a label from its name (`jzero.zero.treepath`: ``blocks/stacked/attn/w_qkv``):
"frozen" when a ``jzero.frozen`` pattern finds it, else the first ``jzero.param_groups`` entry
whose pattern finds it, else "default". The optimizer is then `optax.multi_transform` over the
labels: each group is the config's optimizer with its own weight decay and lr multiplier
(DeepSpeed takes these as torch param groups, "no weight decay on biases and norms"); frozen
leaves get `optax.set_to_zero()`, which keeps no state, and the step neither differentiates
them where the model allows it nor reduces their gradients (`jzero.train.step`).

`param_labels` is the same rule as a plain function of the params, for users who build their own
optax transformation (``optax.multi_transform(..., jzero.param_labels(cfg))``).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from jzero.config import Config, ConfigError
from jzero.zero import treepath

DEFAULT, FROZEN = "default", "frozen"


class Group(NamedTuple):
    """A group's effective settings: ``weight_decay`` None keeps the optimizer's."""

    name: str
    weight_decay: float | None = None
    lr_scale: float = 1.0


def groups(cfg: Config) -> list[Group]:
    """The configured groups, named, the default group first (checked: `validate`)."""
    named = [Group(g.name or f"group{i}", g.weight_decay, g.lr_scale) for i, g in enumerate(cfg.jzero.param_groups)]
    return [Group(DEFAULT), *named]


def validate(cfg: Config) -> None:
    """ConfigError naming the ``jzero.param_groups`` / ``jzero.frozen`` key that is wrong."""
    for i, g in enumerate(cfg.jzero.param_groups):
        _compiles(f"jzero.param_groups[{i}].pattern", g.pattern)
        if g.weight_decay is not None and g.weight_decay < 0:
            raise ConfigError(f"jzero.param_groups[{i}].weight_decay: must be >= 0, got {g.weight_decay}")
        if g.lr_scale < 0:
            raise ConfigError(f"jzero.param_groups[{i}].lr_scale: must be >= 0, got {g.lr_scale}")
    names = [g.name for g in groups(cfg)]
    clash = next((n for n in names if names.count(n) > 1 or n == FROZEN), None)
    if clash is not None:
        raise ConfigError(f"jzero.param_groups: the group name '{clash}' is taken; name each group once, "
                          f"and none '{DEFAULT}' or '{FROZEN}'")
    for i, pattern in enumerate(cfg.jzero.frozen.patterns):
        _compiles(f"jzero.frozen.patterns[{i}]", pattern)


def _compiles(where: str, pattern: Any) -> None:
    try:
        re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ConfigError(f"{where}: {pattern!r} is not a regular expression ({e})") from None


def label_of(cfg: Config, name: str) -> str:
    """The label of the leaf called ``name``."""
    if any(re.search(p, name) for p in cfg.jzero.frozen.patterns):
        return FROZEN
    for group, spec in zip(groups(cfg)[1:], cfg.jzero.param_groups, strict=True):
        if re.search(spec.pattern, name):
            return group.name
    return DEFAULT


def param_labels(cfg: Config) -> Callable[[Any], Any]:
    """``params -> tree of labels`` ("frozen", a group's name, "default") by the config's
    ``jzero.frozen`` and ``jzero.param_groups``: for ``optax.multi_transform`` or, compared
    with a label, ``optax.masked`` in a client optimizer (public as ``jzero.param_labels``)."""
    def label_tree(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: label_of(cfg, treepath.SEP.join(map(treepath.key_name, path))), params)

    return label_tree


def frozen_mask(cfg: Config, params: Any) -> Any:
    """A tree of bools shaped like ``params``: True for frozen leaves."""
    return jax.tree.map(lambda label: label == FROZEN, param_labels(cfg)(params))


def active(cfg: Config) -> bool:
    """Whether the config has groups or frozen leaves (else the optimizer is one transformation)."""
    return bool(cfg.jzero.param_groups or cfg.jzero.frozen.patterns)


def wrap(cfg: Config, build: Callable[[Group], optax.GradientTransformation]) -> optax.GradientTransformation:
    """The optimizer over the config's groups: ``build(group)`` for each, frozen leaves kept."""
    if not active(cfg):
        return build(Group(DEFAULT))
    transforms = {g.name: build(g) for g in groups(cfg)}
    return optax.multi_transform({**transforms, FROZEN: optax.set_to_zero()}, param_labels(cfg))


def describe(cfg: Config, params_shape: Any) -> list[str]:
    """One line per group with leaves: its name, size and effective settings (for the header)."""
    if not active(cfg):
        return []
    named = treepath.named_leaves(param_labels(cfg)(params_shape))
    sizes = treepath.named_leaves(jax.tree.map(lambda x: x.size, params_shape))
    lines = []
    for group in [*groups(cfg), Group(FROZEN)]:
        members = [n for n, label in named.items() if label == group.name]
        if not members:
            continue
        size = sum(sizes[n] for n in members)
        if group.name == FROZEN:
            lines.append(f"{FROZEN}: {len(members)} leaves, {size:,} params, not trained")
            continue
        base = cfg.optimizer.params  # empty for a client optimizer: its own values apply
        decay = group.weight_decay if group.weight_decay is not None else base.get("weight_decay")
        lr = f"lr {group.lr_scale * base['lr']:g}" if "lr" in base else "lr"
        lines.append(f"{group.name}: {len(members)} leaves, {size:,} params, weight_decay "
                     f"{'as tx' if decay is None else f'{decay:g}'}, {lr} (x{group.lr_scale:g})")
    return lines

"""Models: the reference models (`gpt`, `vit`, `clip`, `mlp`, `evoformer` on `base`) and what any model is
built with: `scan_layers` (`layers`), the MoE layer and its gates, `from_linen` / `from_nnx`
(`adapters`). Imports `jzero.config` and `jzero.zero`.

`build` turns a config into a `Model` by name (``jzero.model.name``): the one place a config
becomes (init_fn, loss_fn, batch shapes) for `jzero train`, estimate, autotune and profile;
the next reference models plug into `MODELS`.
"""
from __future__ import annotations

from collections.abc import Callable

from jzero.config import Config, ConfigError, unknown
from jzero.models import attention, clip, evoformer, gpt, mlp, vit
from jzero.models.base import Model

MODELS: dict[str, Callable[[Config], Model]] = {"gpt": gpt.build, "vit": vit.build, "clip": clip.build,
                                              "mlp": mlp.build, "evoformer": evoformer.build}


def build(config: Config) -> Model:
    """The reference model the config's ``jzero.model`` section describes (checked)."""
    name = config.jzero.model.name
    if name not in MODELS:
        raise unknown("jzero.model.name", f"model '{name}'", name, MODELS)
    return MODELS[name](config)


def validate(config: Config) -> None:
    """ConfigError naming the ``jzero.model`` key that is wrong; builds nothing heavy."""
    if config.sparse_attention is not None and config.jzero.model.name != "gpt":
        raise ConfigError(f"sparse_attention: only the gpt model takes a sparse layout, not "
                          f"{config.jzero.model.name!r} (its sequence need not be whole blocks)")
    attention.check_settings(config.jzero.model.attention)
    build(config)


__all__ = ["MODELS", "Model", "build", "validate"]

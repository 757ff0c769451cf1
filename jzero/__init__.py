"""jzero: DeepSpeed's training engine on JAX/XLA. ZeRO stages 0-3 are sharding rules.

The public names are loaded on first use (PEP 562), so ``import jzero.config`` (or a CLI
command that only reads a config) does not pull in Orbax, Flax and the kernels.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {  # module -> the names it gives the public face, bottom layer first
    "jzero.config": ("Config", "ConfigError", "ConfigWarning"),
    "jzero.zero.mesh": ("make_mesh",),
    "jzero.zero.sharding": ("Plan",),
    "jzero.zero.rows": ("gather_rows", "row_offset"),
    "jzero.zero.phase": ("evaluating",),
    "jzero.zero.modelstate": ("Variables",),
    "jzero.zero.groups": ("param_labels",),
    "jzero.models.adapters": ("from_linen", "from_nnx"),
    "jzero.models.layers": ("scan_layers",),
    "jzero.models.base": ("Stages",),
    "jzero.models.attention": ("attention",),
    "jzero.models.moe": ("MoE", "NNXMoE", "MoESpec", "MoEStats"),
    "jzero.models.gating": ("GateSpec",),
    "jzero.train.resolve": ("load_config",),
    "jzero.train.state": ("TrainState", "abstract_init", "device_params", "init"),
    "jzero.train.step": ("train_step", "eval_step"),
    "jzero.runtime.checkpoint": ("CheckpointError", "CheckpointMismatchError", "Checkpointer", "CheckpointWarning"),
    "jzero.runtime.weights": ("export", "load_params", "load_model_state"),
}
_EXPORTS = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jzero' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

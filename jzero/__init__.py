"""jzero: DeepSpeed's training engine on JAX/XLA. ZeRO stages 0-3 are sharding rules.

The public names are loaded on first use (PEP 562), so ``import jzero.config`` (or a CLI
command that only reads a config) does not pull in Orbax, Flax and the kernels.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "from_linen": "jzero.adapters", "from_nnx": "jzero.adapters",
    "CheckpointError": "jzero.checkpoint", "CheckpointMismatchError": "jzero.checkpoint",
    "Checkpointer": "jzero.checkpoint", "CheckpointWarning": "jzero.checkpoint",
    "Config": "jzero.config", "ConfigError": "jzero.config", "ConfigWarning": "jzero.config",
    "load_config": "jzero.resolve",
    "export": "jzero.weights", "load_params": "jzero.weights",
    "make_mesh": "jzero.mesh", "Plan": "jzero.sharding",
    "TrainState": "jzero.state", "abstract_init": "jzero.state", "device_params": "jzero.state",
    "init": "jzero.state",
    "train_step": "jzero.step", "eval_step": "jzero.step", "gather_rows": "jzero.rows", "row_offset": "jzero.rows",
    "MoE": "jzero.moe", "NNXMoE": "jzero.moe", "MoESpec": "jzero.moe", "MoEStats": "jzero.moe",
    "GateSpec": "jzero.gating", "evaluating": "jzero.phase",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jzero' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

"""Hugging Face's ``"auto"``: the values HF's Trainer writes into a ds_config from its
``TrainingArguments``, at the Trainer's defaults, so HF's templates run unchanged.

HF's DeepSpeed integration (``HfTrainerDeepSpeedConfig``) fills these keys from the training
arguments before DeepSpeed ever reads the file. jzero has no TrainingArguments, so it fills them
with what the Trainer uses when none are given: ``learning_rate`` 5e-5, ``adam_beta1/2`` 0.9 /
0.999, ``adam_epsilon`` 1e-8, ``weight_decay`` 0, ``warmup_steps`` 0, ``max_grad_norm`` 1.0,
``fp16`` / ``bf16`` off, ``per_device_train_batch_size`` 8 and ``gradient_accumulation_steps`` 1.
The ``"auto"`` keys jzero has a source for stay ``"auto"`` and are resolved where that source is:
``train_batch_size`` by the batch rule, the ZeRO bucket and persistence sizes from the model,
``warmup_max_lr`` from the lr, ``total_num_steps`` from ``jzero.train.steps``.

``jzero.auto``: ``"hf_defaults"`` (default) fills them and says so in one warning listing each
key and value; ``"strict"`` refuses them all at once, in one error listing every such key.
This module imports no jzero module.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

AUTO = "auto"
MODES = ("hf_defaults", "strict")

# dotted key -> the Trainer's default (the TrainingArguments field it comes from)
TRAINER_DEFAULTS: dict[str, tuple[Any, str]] = {
    "optimizer.params.lr": (5e-5, "learning_rate"),
    "optimizer.params.betas": ([0.9, 0.999], "adam_beta1, adam_beta2"),
    "optimizer.params.eps": (1e-8, "adam_epsilon"),
    "optimizer.params.weight_decay": (0.0, "weight_decay"),
    "scheduler.params.warmup_min_lr": (0.0, "0"),
    "scheduler.params.warmup_num_steps": (0, "warmup_steps"),
    "gradient_clipping": (1.0, "max_grad_norm"),
    "fp16.enabled": (False, "fp16"),
    "bf16.enabled": (False, "bf16"),
    "gradient_accumulation_steps": (1, "gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": (8, "per_device_train_batch_size"),
}


def fill(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``raw`` with the Trainer's ``"auto"`` keys filled, {dotted key: value filled}).
    The micro-batch is filled only when ``train_batch_size`` does not fix it."""
    out = copy.deepcopy(dict(raw))
    filled = {}
    for key, (value, _) in TRAINER_DEFAULTS.items():
        if _get(out, key) != AUTO:
            continue
        if key == "train_micro_batch_size_per_gpu" and _get(out, "train_batch_size") not in (None, AUTO):
            continue  # the batch rule derives it from the given global batch
        _set(out, key, copy.deepcopy(value))
        filled[key] = value
    return out, filled


def describe(filled: Mapping[str, Any]) -> str:
    """One line: each filled key and its value."""
    values = ", ".join(f"{key}={value!r}" for key, value in filled.items())
    finder = " (jzero train --auto-lr finds an lr instead)" if "optimizer.params.lr" in filled else ""
    return (f"'auto' filled with HF Trainer defaults (no TrainingArguments here): {values}; override with "
            f"--set KEY=VALUE{finder}, or refuse them with jzero.auto: strict")


def _get(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree[part]
    tree[last] = value

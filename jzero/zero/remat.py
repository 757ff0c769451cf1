"""Named rematerialization (activation checkpointing) policies, applied per layer by scan_layers.

``none`` keeps every activation; ``full`` keeps only each layer's input and recomputes the rest
in the backward pass; ``dots`` / ``dots_no_batch`` keep matmul outputs (all, or those without
batch dimensions); ``names`` keeps only tensors the model tagged with
``jax.ad_checkpoint.checkpoint_name`` under one of `SAVE_NAMES` (the GPT tags them);
``offload`` keeps the same tensors in pinned host memory instead of device memory.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jzero.config import unknown

SAVE_NAMES = ("qkv", "attn_out", "mlp_hidden")

_cp = jax.checkpoint_policies

# name -> checkpoint policy; None means "do not rematerialize".
POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": _cp.nothing_saveable,
    "dots": _cp.dots_saveable,
    "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
    "names": _cp.save_only_these_names(*SAVE_NAMES),
    "offload": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVE_NAMES),
        offload_src="device", offload_dst="pinned_host"),
}


def policy(name: str) -> Callable[..., Any] | None:
    """The jax checkpoint policy for ``name`` (None = no remat); KeyError lists the valid names."""
    if name not in POLICIES:
        raise KeyError(f"unknown remat policy '{name}'; valid: {', '.join(POLICIES)}")
    return POLICIES[name]


def validate(name: str) -> None:
    """ConfigError naming ``jzero.remat`` unless ``name`` is a policy."""
    if name not in POLICIES:
        raise unknown("jzero.remat", f"policy '{name}'", name, POLICIES)

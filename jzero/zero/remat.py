"""Named rematerialization (activation checkpointing) policies, applied per layer by scan_layers.

``none`` keeps every activation; ``full`` keeps only each layer's input and recomputes the rest
in the backward pass; ``dots`` / ``dots_no_batch`` keep matmul outputs (all, or those without
batch dimensions); ``names`` keeps only tensors the model tagged with
``jax.ad_checkpoint.checkpoint_name`` under one of `SAVE_NAMES` (the GPT tags them);
``offload`` keeps the same tensors in pinned host memory instead of device memory.

`full` is the "full" policy as a custom VJP rather than ``jax.checkpoint``: it saves the layer's
input with 16-bit floats as their raw bits. In a scan the saved inputs of all layers form one
stacked array that the backward slices layer by layer, and XLA:CPU slices a bf16 array by
converting the whole operand to fp32 (a loop invariant, so hoisted out of the loop): an fp32 copy
of every layer's input, 3 GiB a device for the 1.3B GPT at micro-batch 8 (`jzero estimate`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jzero.config import unknown
from jzero.zero import bits, modelaxes

SAVE_NAMES = ("qkv", "attn_out", "mlp_hidden")

_cp = jax.checkpoint_policies
FULL = _cp.nothing_saveable

# name -> checkpoint policy; None means "do not rematerialize".
POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": FULL,
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


def full(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(x, *rest)`` whose backward recomputes it from ``x`` (saved, 16-bit floats as raw
    bits) and ``rest``; the same values and gradients as ``jax.checkpoint`` under "full"."""
    def run(x: Any, *rest: Any) -> Any:
        recompute = modelaxes.keeping(fn)  # the backward is traced after the loss: keep its layout
        dtypes = jax.tree.map(lambda v: v.dtype, x)
        spaces = jax.tree.map(lambda v: jax.typeof(v).memory_space, rest)  # offloaded params: host

        @jax.custom_vjp
        def layer(x, *rest):
            return fn(x, *rest)

        def fwd(x, *rest):
            return fn(x, *rest), (jax.tree.map(bits.raw, x), rest)

        def bwd(res, ct):
            saved, rest = res
            ct_x, *ct_rest = jax.vjp(recompute, jax.tree.map(bits.restored, saved, dtypes), *rest)[1](ct)
            return ct_x, *jax.tree.map(into, ct_rest, list(spaces))

        layer.defvjp(fwd, bwd)
        return layer(x, *rest)

    return run


def into(value: jax.Array, space: Any) -> jax.Array:
    """``value`` in memory ``space`` (a cotangent goes where its primal lives)."""
    return value if jax.typeof(value).memory_space == space else jax.device_put(value, space)

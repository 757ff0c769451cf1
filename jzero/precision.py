"""Dtype policy: fp32 master params, compute in the policy's dtype, grads accumulated in fp32.

The step casts the floating params to the compute dtype before calling the user's loss, so one
code path serves every model (Linen, NNX, plain functions) and the gradient flows back to the
fp32 master through the cast. Loss scaling for fp16 belongs here too (a later release).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jzero.config import Config

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


class Policy(NamedTuple):
    param_dtype: Any
    compute_dtype: Any
    grad_accum_dtype: Any


def policy(config: Config) -> Policy:
    """bf16.enabled -> bf16 compute; fp16.enabled -> fp16; else fp32 (jzero.compute_dtype overrides)."""
    if config.jzero.compute_dtype is not None:
        compute = config.jzero.compute_dtype
    else:
        compute = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    return Policy(jnp.float32, DTYPES[compute], DTYPES[config.data_types.grad_accum_dtype])


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast every floating leaf of ``tree`` to ``dtype``; integer leaves are left alone."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree.map(cast, tree)

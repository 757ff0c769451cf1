"""AdamW on the Pallas fused step (`pallas_kernels.adamw`), as an optax transformation.

``fused_adamw(...)`` has ``optax.adamw``'s state, so checkpoints move freely between fused and
XLA runs, and wraps in ``optax.inject_hyperparams`` like every jzero optimizer. Called as a
plain optax transformation it returns updates. The ZeRO step calls it with extra arguments
instead (`apply`): the undivided gradients with the one ``grad_divisor`` (loss scale x clip
factor), the overflow flag ``skip``, and the ``layout`` of the update (`Plan.update`); then it
runs the kernel under ``jax.shard_map`` on each device's own shard, leaf by leaf, and returns
the new params themselves, written into the old params' buffers. Leaves whose local shard is
not a whole number of 128-element rows take the same arithmetic under XLA.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import adamw as kernel


def fused_adamw(learning_rate: Any, b1: Any = 0.9, b2: Any = 0.999, eps: Any = 1e-8, eps_root: Any = 0.0,
                weight_decay: Any = 1e-4, *, backend: str = "interpret",
                kernel_options: Mapping[str, Any] | None = None) -> optax.GradientTransformationExtraArgs:
    """``optax.adamw`` (no mask, no nesterov) whose update is one fused kernel pass per leaf.

    ``backend``: a `pallas_kernels.adamw.BACKENDS` name, or "xla" for the same arithmetic
    without Pallas (the benchmark's baseline). ``kernel_options``: tuning passed to the kernel
    (``block_rows``, ``steps_in_flight``).

    Extra update arguments: ``grad_divisor`` (gradients are divided by it first), ``skip``
    (true: params and moments stay as they are), ``layout`` (a tree of `NamedSharding`, one per
    param: run per device on local shards) and ``new_params`` (return the new params instead of
    updates: the in-place path).
    """
    reference = optax.adamw(learning_rate, b1, b2, eps, eps_root, weight_decay=weight_decay)

    def update(grads, state, params=None, *, grad_divisor=1.0, skip=False, layout=None, new_params=False, **_):
        if params is None:
            raise ValueError("fused_adamw: update needs params")
        adam, *rest = state
        count = optax.safe_increment(adam.count)
        hyper = kernel.hyper_vector(lr=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                    weight_decay=weight_decay, count=count, divisor=grad_divisor, skip=skip)
        new_p, mu, nu = _run(backend, dict(kernel_options or {}), layout, hyper, grads, params, adam.mu, adam.nu)
        state = (adam._replace(count=count, mu=mu, nu=nu), *rest)
        if new_params:
            return new_p, state
        return jax.tree.map(jnp.subtract, new_p, params), state

    return optax.GradientTransformationExtraArgs(reference.init, update)


def apply(tx: optax.GradientTransformationExtraArgs, grads: Any, opt_state: Any, params: Any, *,
          grad_divisor: jax.Array, skip: jax.Array, layout: Any) -> tuple[Any, Any]:
    """(new params, new opt_state) of a (hyperparam-injected) ``fused_adamw`` in place."""
    return tx.update(grads, opt_state, params, grad_divisor=grad_divisor, skip=skip, layout=layout,
                     new_params=True)


def _run(backend: str, options: dict, layout: Any, hyper: jax.Array, grads: Any, params: Any, mu: Any, nu: Any):
    step = functools.partial(_step_leaves, backend, options)
    if layout is None:
        return step(hyper, grads, params, mu, nu)
    specs = jax.tree.map(lambda s: s.spec, layout, is_leaf=lambda x: isinstance(x, NamedSharding))
    mesh = jax.tree.leaves(layout, is_leaf=lambda x: isinstance(x, NamedSharding))[0].mesh
    # check_vma=False: Pallas's interpret mode does not type-check under shard_map (jax 0.10).
    return jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, specs, specs, specs),
                         out_specs=(specs, specs, specs), check_vma=False)(hyper, grads, params, mu, nu)


def _step_leaves(backend: str, options: dict, hyper: jax.Array, grads: Any, params: Any, mu: Any, nu: Any):
    """Each leaf through the kernel where it fits, else through the same arithmetic under XLA."""
    def one(g, p, m, v):
        if backend != "xla" and kernel.fits(p.size) and p.dtype == m.dtype == v.dtype == jnp.float32:
            return kernel.adamw(hyper, g, p, m, v, backend=backend, **options)
        return kernel.step_math(hyper, g, p, m, v)

    out = jax.tree.map(one, grads, params, mu, nu)
    treedef = jax.tree.structure(params)
    return tuple(jax.tree.unflatten(treedef, xs) for xs in zip(*treedef.flatten_up_to(out), strict=True))

"""`scan_layers`: N identical blocks stacked with ``scan`` + a named remat policy.

Scanning keeps compile time flat in depth: the block is traced once and its params get a
leading layer dimension, stored under the key ``"stacked"`` so the ZeRO plan never shards that
dimension (`jzero.zero.sharding.STACKED_KEY`). One function serves Linen and NNX:

* Linen: ``scan_layers(Block(...), n)`` returns a Linen module; call it on the hidden state.
* NNX: ``scan_layers(lambda rngs: Block(..., rngs=rngs), n, rngs=rngs)`` returns an NNX module.

Blocks map ``x -> x`` (same shape; leading dim = batch); ``x`` may be a pytree carried
through the stack (the MoE GPT carries its `jzero.models.moe.MoEStats` beside the hidden state).
Arguments after ``x`` are ``shared``: every layer gets the same values (packed documents' segment
ids and positions, `jzero.models.packing`). `run_stack` hands them to each layer as part of its
scanned extras (broadcast over the layers: a few ints a token a layer), never by closure: a
remat policy's backward is traced after the loss, where a closed-over value no longer exists.
Both frameworks hand `run_stack` a pure ``apply_layer`` and the stacked params, so the
per-layer ZeRO hooks (`jzero.zero.hooks`: gather each layer's params before use, reduce-scatter its
gradient after) live in one place.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jzero.models import lora
from jzero.zero import dots, hooks, remat
from jzero.zero.sharding import STACKED_KEY


def scan_layers(block: nn.Module | Callable[[nnx.Rngs], nnx.Module], length: int, *,
                remat_policy: str = "full", rngs: nnx.Rngs | None = None,
                name: str | None = None, per_layer: tuple[int, ...] = ()) -> nn.Module | nnx.Module:
    """Stack ``length`` copies of ``block`` (a Linen module, or an NNX factory taking rngs).

    ``name`` names the Linen submodule (ignored by NNX, where the attribute name is the path).
    ``per_layer`` (Linen): one int a layer, handed to the block after x (a layer's sliding window).
    """
    if length < 1:
        raise ValueError(f"scan_layers: length must be >= 1, got {length}")
    remat.policy(remat_policy)  # fail early on an unknown name
    if isinstance(block, nn.Module):
        if per_layer and len(per_layer) != length:
            raise ValueError(f"scan_layers: per_layer has {len(per_layer)} values for {length} layers")
        return LinenScanLayers(block=block, length=length, remat_policy=remat_policy, per_layer=tuple(per_layer),
                               name=name)
    if rngs is None:
        raise ValueError("scan_layers: an NNX block factory needs rngs=nnx.Rngs(...)")
    return NNXScanLayers(block, length, remat_policy=remat_policy, rngs=rngs)


def run_stack(apply_layer: Callable[..., Any], x: Any, stacked: Any, extra: Any, remat_policy: str,
              shared: tuple = ()) -> Any:
    """Scan ``apply_layer(layer_params, x, layer_extra, *shared)`` over the leading (layer) axis.

    The one code path of both frameworks. Under the jzero step at stages 2-3 the body is the
    per-layer ZeRO hook (`jzero.zero.hooks`); otherwise a plain scan body under the remat policy.
    """
    policy = remat.policy(remat_policy)
    if shared:
        layers = jax.tree.leaves(stacked)[0].shape[0]
        extra = (extra, jax.tree.map(lambda s: jnp.broadcast_to(s, (layers, *s.shape)), shared))
        apply_layer = _sharing(apply_layer)
    scale = lora.current_scale()
    if scale is not None:  # each layer's adapters merged where it runs (after ZeRO-3's gather)
        apply_layer = _merging(apply_layer, scale)
    ctx = hooks.current()
    if ctx is not None:
        return hooks.scan(ctx, apply_layer, policy, x, stacked, extra)
    if dots.applies(jax.default_backend()) and dots.pays_for(x):
        apply_layer = _unfolding(apply_layer)

    def body(carry, xs):
        return apply_layer(xs[0], carry, xs[1]), None

    if policy is remat.FULL:
        body = remat.full(body)
    elif policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, x, (stacked, extra))[0]


def _sharing(apply_layer: Callable[..., Any]) -> Callable[[Any, Any, Any], Any]:
    return lambda params, h, extra: apply_layer(params, h, extra[0], *extra[1])


def _merging(apply_layer: Callable[[Any, Any, Any], Any], scale: float) -> Callable[[Any, Any, Any], Any]:
    return lambda params, h, extra: apply_layer(lora.merged(params, scale), h, extra)


@jax.custom_vjp
def _unfolded(params: Any) -> Any:
    """``params``; their 2-D cotangents pass `dots.unfold` (the hooks do it at stages 2-3)."""
    return params


_unfolded.defvjp(lambda params: (params, None), lambda _, ct: (jax.tree.map(dots.unfold, ct),))


def _unfolding(apply_layer: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
    return lambda params, h, extra: apply_layer(_unfolded(params), h, extra)


class LinenScanLayers(nn.Module):
    """Linen stack: ``block``'s params, stacked along a leading layer axis, live under "stacked"."""

    block: nn.Module
    length: int
    remat_policy: str = "full"
    per_layer: tuple[int, ...] = ()  # one int a layer, the block's argument after x

    @nn.compact
    def __call__(self, x, *shared):
        block = self.block.clone(parent=None)  # used as a pure function: init / apply
        values = jnp.asarray(self.per_layer, jnp.int32) if self.per_layer else None
        first = () if values is None else (values[0],)

        def init_stack(rng):
            keys = jax.random.split(rng, self.length)
            return jax.vmap(lambda k: block.init({"params": k, "dropout": k}, x, *first, *shared)["params"])(keys)

        # Applied, the stack takes its params as given (not re-checked against init's shapes:
        # under the step an MoE layer's experts are this device's E / ep_size).
        stacked = (self.get_variable("params", STACKED_KEY) if self.has_variable("params", STACKED_KEY)
                   else self.param(STACKED_KEY, init_stack))
        use_dropout = self.has_rng("dropout")
        keys = jax.random.split(self.make_rng("dropout") if use_dropout else jax.random.key(0), self.length)

        def apply_layer(params, h, extra, *shared):
            key, *value = extra
            return block.apply({"params": params}, h, *value, *shared, rngs={"dropout": key} if use_dropout else None)

        extra = (keys,) if values is None else (keys, values)
        return run_stack(apply_layer, x, stacked, extra, self.remat_policy, shared)


class NNXScanLayers(nnx.Module):
    """NNX stack: ``length`` blocks created under ``nnx.vmap``; applied by `run_stack`."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], length: int, *,
                 remat_policy: str = "full", rngs: nnx.Rngs):
        @nnx.split_rngs(splits=length)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r):
            return make_block(r)

        setattr(self, STACKED_KEY, create(rngs))
        self.remat_policy = remat_policy

    def __call__(self, x, *shared):
        graphdef, params, rest = nnx.split(getattr(self, STACKED_KEY), nnx.Param, ...)

        def apply_layer(layer_params, h, layer_rest, *shared):
            return nnx.merge(graphdef, layer_params, layer_rest)(h, *shared)

        return run_stack(apply_layer, x, params, rest, self.remat_policy, shared)

"""`scan_layers`: N identical blocks stacked with ``scan`` + a named remat policy.

Scanning keeps compile time flat in depth: the block is traced once and its params get a
leading layer dimension, stored under the key ``"stacked"`` so the ZeRO plan never shards that
dimension (`jzero.sharding.STACKED_KEY`). One function serves Linen and NNX:

* Linen: ``scan_layers(Block(...), n)`` returns a Linen module; call it on the hidden state.
* NNX: ``scan_layers(lambda rngs: Block(..., rngs=rngs), n, rngs=rngs)`` returns an NNX module.

Blocks map ``x -> x`` (same shape). The scan body is where per-layer ZeRO hooks belong
(gather each layer's params before use, reduce-scatter its gradient after): one place, both
frameworks, because both bodies call the block through `_apply_block`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

from jzero import remat
from jzero.sharding import STACKED_KEY


def scan_layers(block: nn.Module | Callable[[nnx.Rngs], nnx.Module], length: int, *,
                remat_policy: str = "full", rngs: nnx.Rngs | None = None,
                name: str | None = None) -> nn.Module | nnx.Module:
    """Stack ``length`` copies of ``block`` (a Linen module, or an NNX factory taking rngs).

    ``name`` names the Linen submodule (ignored by NNX, where the attribute name is the path).
    """
    if length < 1:
        raise ValueError(f"scan_layers: length must be >= 1, got {length}")
    remat.policy(remat_policy)  # fail early on an unknown name
    if isinstance(block, nn.Module):
        return LinenScanLayers(block=block, length=length, remat_policy=remat_policy, name=name)
    if rngs is None:
        raise ValueError("scan_layers: an NNX block factory needs rngs=nnx.Rngs(...)")
    return NNXScanLayers(block, length, remat_policy=remat_policy, rngs=rngs)


def _apply_block(block: Any, x: Any) -> Any:
    return block(x)


def _rematted(fn: Callable, policy_name: str, checkpoint: Callable) -> Callable:
    """``fn`` under the named remat policy, via the framework's ``checkpoint`` transform."""
    if remat.policy(policy_name) is None:
        return fn
    return checkpoint(fn, policy=remat.policy(policy_name), prevent_cse=False)


class LinenScanLayers(nn.Module):
    """Linen stack: params of ``block`` get a leading axis of size ``length`` under "stacked"."""

    block: nn.Module
    length: int
    remat_policy: str = "full"

    @nn.compact
    def __call__(self, x):
        def body(module, carry, _):
            return _apply_block(module, carry), None

        body = _rematted(body, self.remat_policy, nn.remat)
        scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                       length=self.length)
        x, _ = scan(self.block.clone(name=STACKED_KEY, parent=self), x, None)
        return x


class NNXScanLayers(nnx.Module):
    """NNX stack: ``length`` blocks created under ``nnx.vmap`` and applied with ``nnx.scan``."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], length: int, *,
                 remat_policy: str = "full", rngs: nnx.Rngs):
        @nnx.split_rngs(splits=length)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(r):
            return make_block(r)

        setattr(self, STACKED_KEY, create(rngs))
        self.length = length
        self.remat_policy = remat_policy

    def __call__(self, x):
        def body(carry, block):
            return _apply_block(block, carry)

        body = _rematted(body, self.remat_policy, nnx.remat)
        scan = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        return scan(x, getattr(self, STACKED_KEY))

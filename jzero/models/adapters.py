"""One-line adapters from Flax modules to jzero's ``init_fn(rng)`` / ``loss_fn(params, batch, rng)``.

Both adapters share the contract: ``loss(outputs, batch) -> loss | (loss, aux)`` and
``inputs(batch) -> model input`` (default: ``batch["inputs"]`` for a dict, ``batch[0]`` for a
tuple, else the batch itself). Params are a plain nested dict, so Plans, checkpoints and exports
see the same tree whichever Flax API built it.

A model with state (Linen collections besides ``params``, such as ``batch_stats``; NNX
variables that are neither ``nnx.Param`` nor RNG state, such as ``nnx.BatchStat``) gets the
stateful contract of `jzero.zero.modelstate`: ``init_fn`` returns ``Variables(params, state)``
and ``loss_fn`` takes and returns the state. Training or evaluation (`jzero.zero.phase`) picks
the model's mode: NNX's ``train()`` / ``eval()``; for Linen, the ``__call__`` argument that says it
(``train``, ``training``, ``deterministic``, ``use_running_average``; or the one ``mode_arg``
names), and in evaluation the state is read, not updated.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jzero.zero import phase
from jzero.zero.modelstate import Variables

Loss = Callable[[Any, Any], Any]
# Linen __call__ arguments that switch a module between training and evaluation, and whether
# each is True in training (train) or in evaluation (deterministic).
MODE_ARGS = {"train": True, "training": True, "is_training": True, "deterministic": False,
             "use_running_average": False}
NNX_STATE = nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))  # what from_nnx carries as state


def default_inputs(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return batch["inputs"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


def from_linen(module: nn.Module, sample_input: Any, loss: Loss, *,
               inputs: Callable[[Any], Any] = default_inputs, apply_kwargs: Mapping[str, Any] | None = None,
               mode_arg: str | None = "auto") -> tuple[Callable, Callable]:
    """(init_fn, loss_fn) for a Linen module. ``sample_input`` (arrays or ShapeDtypeStructs, any
    pytree) fixes the input shapes for ``init``; the RNG of each step is passed as the
    ``dropout`` stream. ``mode_arg``: the ``__call__`` argument that switches training and
    evaluation ("auto": the first of `MODE_ARGS` the signature has; None: none is passed)."""
    kwargs = dict(apply_kwargs or {})
    mode = _linen_mode_arg(module, mode_arg, kwargs)

    def flags(training: bool) -> dict[str, Any]:
        return {} if mode is None else {mode: training if MODE_ARGS.get(mode, True) else not training}

    def init_fn(rng):
        sample = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sample_input)
        variables = dict(module.init({"params": rng, "dropout": rng}, sample, **kwargs, **flags(False)))
        params = variables.pop("params")
        if variables and mode is None:
            raise ValueError(f"from_linen: {type(module).__name__} has state {sorted(variables)} but its __call__ "
                             f"takes none of {', '.join(MODE_ARGS)} to switch to evaluation; pass "
                             "mode_arg='<argument name>'")
        return Variables(params, variables) if variables else params

    def loss_fn(params, batch, rng, state=None):
        variables = {"params": params, **(state or {})}
        training = phase.training()
        if state is None or not training:
            out = module.apply(variables, inputs(batch), rngs={"dropout": rng}, **kwargs, **flags(training))
            return loss(out, batch) if state is None else (loss(out, batch), state)
        out, updated = module.apply(variables, inputs(batch), rngs={"dropout": rng}, mutable=list(state), **kwargs,
                                    **flags(True))
        return loss(out, batch), {**state, **updated}

    return init_fn, loss_fn


def _linen_mode_arg(module: nn.Module, mode_arg: str | None, kwargs: dict) -> str | None:
    """The argument that switches the module's mode; None where the caller fixes it in
    ``apply_kwargs`` or the module has none."""
    if mode_arg != "auto":
        return mode_arg
    names = inspect.signature(module.__call__).parameters
    return next((name for name in MODE_ARGS if name in names and name not in kwargs), None)


def from_nnx(make_model: Callable[[nnx.Rngs], nnx.Module], loss: Loss, *,
             inputs: Callable[[Any], Any] = default_inputs) -> tuple[Callable, Callable]:
    """(init_fn, loss_fn) for an NNX model built by ``make_model(rngs)``.

    Params are the model's ``nnx.Param`` variables; its other variables, except RNG state, are
    the model state (``nnx.BatchStat`` and any custom ``nnx.Variable``), carried between steps.
    RNG streams (dropout) are rebuilt from the step's rng on every call, so they are never stale.
    The model runs in ``train()`` mode under `jzero.train_step`, ``eval()`` under `jzero.eval_step`.
    """
    graphdef, abstract_params, abstract_rest = nnx.split(
        nnx.eval_shape(lambda: make_model(nnx.Rngs(0))), nnx.Param, ...)
    has_rest = bool(jax.tree.leaves(abstract_rest))

    def init_fn(rng):
        model = make_model(nnx.Rngs(rng))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        state = nnx.to_pure_dict(nnx.state(model, NNX_STATE))
        return Variables(params, state) if jax.tree.leaves(state) else params

    def loss_fn(params, batch, rng, state=None):
        values = jax.tree.map(lambda x: x, abstract_params)
        nnx.replace_by_pure_dict(values, params)
        rest = nnx.split(make_model(nnx.Rngs(rng)), nnx.Param, ...)[2] if has_rest else abstract_rest
        model = nnx.merge(graphdef, values, rest)
        if state is not None:
            carried = nnx.state(model, NNX_STATE)
            nnx.replace_by_pure_dict(carried, state)
            nnx.update(model, carried)
        if phase.training():
            model.train()
        else:
            model.eval()
        out = loss(model(inputs(batch)), batch)
        return out if state is None else (out, nnx.to_pure_dict(nnx.state(model, NNX_STATE)))

    return init_fn, loss_fn

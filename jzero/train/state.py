"""`TrainState` and `init`: a born-sharded training state.

Params are created by ``jit(init_fn, out_shardings=plan.params)``, so each device computes only
its own shard (JAX's partitionable threefry gives the same values as an unsharded init); the
optimizer state is created the same way under ``plan.opt_state``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from jzero.config import Config, ConfigError
from jzero.models import lora
from jzero.models.base import Stages
from jzero.train.resolve import offload_kinds, resolve_auto_sizes
from jzero.zero import autotp, groups, modelstate, optim, pipeline, precision, sharding, treepath
from jzero.zero.mesh import data_parallel_size, make_mesh

LossFn = Callable[[Any, Any, jax.Array], Any]


class TrainState(struct.PyTreeNode):
    """Everything a step reads and writes. Array fields are sharded per ``plan``.

    ``loss_scale`` holds the fp16 dynamic loss-scaler state (None when fp16 is off);
    ``model_state`` the model's non-parameter variables, replicated (None for a stateless model:
    `jzero.zero.modelstate`); ``stages`` the model cut for a pipeline (`jzero.models.base.Stages`;
    None: not pipelined). Static fields (loss_fn, tx, plan, config) are compared by identity by ``jax.jit``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: Any
    model_state: Any
    loss_fn: LossFn = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    plan: sharding.Plan = struct.field(pytree_node=False)
    config: Config = struct.field(pytree_node=False)
    stages: Stages | None = struct.field(pytree_node=False, default=None)


def init(init_fn: Callable[[jax.Array], Any], config: Config, *, loss_fn: LossFn,
         rng: jax.Array | int, mesh: Mesh | None = None, model_specs: Any = None, params: Any = None,
         model_state: Any = None, tx: optax.GradientTransformation | None = None,
         stages: Stages | None = None) -> TrainState:
    """Build a sharded TrainState: ``init_fn(rng) -> params``; ``loss_fn(params, batch, rng)``.

    ``loss_fn`` returns a scalar loss or ``(loss, aux)``. A model with state (BatchNorm
    statistics) returns ``Variables(params, state)`` from ``init_fn`` and takes and returns it in
    ``loss_fn(params, batch, rng, state) -> (loss | (loss, aux), new_state)``
    (`jzero.zero.modelstate`; ``from_linen`` and ``from_nnx`` do this for Flax models). Floating params are kept in fp32
    (the master copy) whatever ``init_fn`` returns. ``model_specs`` is an optional tree of
    PartitionSpecs the model already uses (kept; ZeRO adds "fsdp" to a free dimension).
    ``params`` starts from given values (e.g. `jzero.load_params`) instead of ``init_fn``'s: they
    are matched to ``init_fn``'s tree by leaf name and shape, and each device reads its shard;
    ``model_state`` likewise starts a stateful model from given statistics
    (`jzero.load_model_state`). ``tx``: a client optimizer (any optax transformation, its own
    schedule included) instead of the config's ``optimizer`` section; its param-shaped state
    follows the ZeRO layout of its param, the rest is replicated. ``stages``: the model cut for
    a pipeline (`jzero.models.base.Stages`, a reference model's ``.stages``), which
    ``pipeline.stages > 1`` needs.
    """
    init_fn, loss_fn, stages = _adapted(init_fn, loss_fn, stages, config)
    prep = _prepare(init_fn, config, rng, mesh, model_specs, tx, stages)
    plan = prep.plan
    if params is not None and config.jzero.lora is not None:  # a base checkpoint: fresh adapters
        params = lora.with_adapters(params, config.jzero.lora, jax.random.fold_in(prep.key, lora.SEED))
    if params is None:
        params = jax.jit(prep.make_params, out_shardings=plan.params)(prep.key)
    else:
        params = _place(params, jax.eval_shape(prep.make_params, prep.key), plan.params, "params")
    opt_state = jax.jit(prep.tx.init, out_shardings=plan.opt_state)(params)
    if prep.make_state is None:
        if model_state is not None:
            raise ConfigError("model_state: given, but init_fn returned no model state (bare params, not Variables)")
    elif model_state is None:
        model_state = jax.jit(prep.make_state, out_shardings=plan.model_state)(prep.key)
    else:
        model_state = _place(model_state, jax.eval_shape(prep.make_state, prep.key), plan.model_state, "model_state")
    step_rng = replicated(lambda k: jax.random.fold_in(k, 1), plan, prep.key)
    scaler = precision.loss_scaler(prep.config)
    loss_scale = None if scaler is None else replicated(scaler.init, plan)
    return TrainState(step=replicated(lambda: jnp.zeros((), jnp.int32), plan), params=params,
                      opt_state=opt_state, rng=step_rng, loss_scale=loss_scale, model_state=model_state,
                      loss_fn=loss_fn, tx=prep.tx, plan=plan, config=prep.config, stages=stages)


def device_params(state: TrainState) -> Any:
    """The (fp32 master) params in device memory, for code outside the step that reads them
    (sampling, a hand-written evaluation): offloaded params are copied to the device, others
    returned as they are."""
    if state.plan.offload is None:
        return state.params
    return jax.device_put(state.params, jax.tree.map(lambda s: s.with_memory_kind("device"), state.plan.params))


def replicated(fn: Callable[..., Any], plan: sharding.Plan, *args: Any) -> Any:
    """``fn(*args)`` computed as replicated arrays on the plan's mesh. Not `jax.device_put`:
    that needs every device addressable, which a multi-process mesh is not."""
    return jax.jit(fn, out_shardings=plan.replicated)(*args)


def abstract_init(init_fn: Callable[[jax.Array], Any], config: Config, *, loss_fn: LossFn,
                  mesh: Mesh | None = None, model_specs: Any = None,
                  tx: optax.GradientTransformation | None = None, stages: Stages | None = None) -> TrainState:
    """The TrainState `init` would build, as `jax.ShapeDtypeStruct`s carrying the Plan's
    shardings: nothing is allocated, so ``train_step.lower(state, batch)`` plans any size."""
    init_fn, loss_fn, stages = _adapted(init_fn, loss_fn, stages, config)
    prep = _prepare(init_fn, config, 0, mesh, model_specs, tx, stages)
    plan = prep.plan

    def abstract(tree, shardings):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    params_shape = jax.eval_shape(prep.make_params, prep.key)
    model_state = None if prep.make_state is None else abstract(jax.eval_shape(prep.make_state, prep.key),
                                                                 plan.model_state)
    rng_shape = jax.eval_shape(lambda k: jax.random.fold_in(k, 1), prep.key)
    scaler = precision.loss_scaler(prep.config)
    loss_scale = None if scaler is None else abstract(jax.eval_shape(scaler.init),
                                                       jax.tree.map(lambda _: plan.replicated, scaler.init()))
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=plan.replicated),
                      params=abstract(params_shape, plan.params),
                      opt_state=abstract(jax.eval_shape(prep.tx.init, params_shape), plan.opt_state),
                      rng=jax.ShapeDtypeStruct(rng_shape.shape, rng_shape.dtype, sharding=plan.replicated),
                      loss_scale=loss_scale, model_state=model_state, loss_fn=loss_fn, tx=prep.tx, plan=plan,
                      config=prep.config, stages=stages)


def _adapted(init_fn: Callable, loss_fn: LossFn, stages: Stages | None, config: Config
             ) -> tuple[Callable, LossFn, Stages | None]:
    """The model's functions with ``jzero.lora``'s adapters (`jzero.models.lora`), if any."""
    if config.jzero.lora is None:
        return init_fn, loss_fn, stages
    return lora.applied(init_fn, loss_fn, stages, config.jzero.lora)


def _place(values: Any, shapes: Any, shardings: Any, what: str) -> Any:
    """Given host values laid out as ``shapes`` (matched by leaf name) under ``shardings``."""
    have = treepath.named_leaves(values)
    want = treepath.named_leaves(shapes)
    mismatch = treepath.first_mismatch({n: x.shape for n, x in want.items()},
                                       {n: np.shape(x) for n, x in have.items()}, "model", f"given {what}")
    if mismatch:
        raise ConfigError(f"{what}: the given {what} do not fit the model: {mismatch}")

    def put(name: str, shape: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding) -> jax.Array:
        # shard by shard, each on its device before the next is read: host memory holds one
        # shard at a time, not the leaf (a lazily read checkpoint, `jzero.runtime.hf`, streams)
        value = have[name]
        pieces = [jax.device_put(np.asarray(value[index]).astype(shape.dtype), device)
                  for device, index in sharding.addressable_devices_indices_map(shape.shape).items()]
        return jax.make_array_from_single_device_arrays(shape.shape, sharding, pieces)

    return treepath.fill(shapes, {n: put(n, want[n], s) for n, s in treepath.named_leaves(shardings).items()})


def _staged(config: Config, params_shape: Any, specs: Any, stages: Stages | None, stateful: bool) -> Any:
    """``specs`` with the layer stack over the pipeline's stages (unchanged without a pipeline);
    ConfigError naming ``pipeline.stages`` for a model that cannot be pipelined."""
    pp = config.pipeline
    if pp.stages == 1:
        return specs
    if stages is None or stateful:
        why = ("has model state" if stateful
               else "was not cut into stages (init(stages=...): a reference model's .stages)")
        raise ConfigError(f"pipeline.stages: {pp.stages} needs a model cut into stages; this one {why}")
    return pipeline.stage_specs(specs, params_shape, stages.stack, stages.block, pp.stages, pp.partition, pp.repeats)


class _Prepared(NamedTuple):
    config: Config
    key: jax.Array
    tx: optax.GradientTransformation
    make_params: Callable[[jax.Array], Any]
    make_state: Callable[[jax.Array], Any] | None  # None: the model has no state
    plan: sharding.Plan


def _check_floating(params_shape: Any) -> None:
    """One line naming the first integer or boolean leaf of the params: it has no gradient and no
    optimizer state, and ZeRO's gathers move params in the compute dtype, so jzero trains only
    floating-point params and says where such a leaf belongs instead of failing inside the step."""
    for name, leaf in treepath.named_leaves(params_shape).items():
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ConfigError(f"params: '{name}' is {leaf.dtype}{list(leaf.shape)}; only floating-point params "
                              "are trained: keep integer and boolean arrays out of them, as model state (a Linen "
                              "collection other than 'params', an NNX Variable that is not a Param) or constants of "
                              "loss_fn")


def _prepare(init_fn, config, rng, mesh, model_specs, tx, stages) -> _Prepared:
    """Resolve the config for the mesh, build the optimizer (or take the client's ``tx``) and
    the Plan from params' shapes."""
    mesh = mesh if mesh is not None else make_mesh(config)
    config = config.for_dp(data_parallel_size(mesh))
    if tx is not None:
        tx = optim.transformation(tx)
        config = optim.client(config, tx)
    key = jax.random.key(rng) if isinstance(rng, int) else rng
    pol = precision.policy(config)

    stateful = modelstate.is_stateful(jax.eval_shape(init_fn, key))

    def make_params(k):
        out = init_fn(k)
        params = precision.cast_floating(out.params if stateful else out, pol.param_dtype)
        if not config.jzero.frozen.compute_dtype:
            return params
        return jax.tree.map(lambda x, frozen: precision.cast_floating(x, pol.compute_dtype) if frozen else x,
                            params, groups.frozen_mask(config, params))

    def make_state(k):
        return init_fn(k).state

    params_shape = jax.eval_shape(make_params, key)
    if not jax.tree.leaves(params_shape):
        raise ConfigError("init_fn returned no parameters (an empty pytree)")
    _check_floating(params_shape)
    config = resolve_auto_sizes(config, params_shape)
    tx = optim.build(config).tx if tx is None else groups.wrap(config, lambda _: tx)  # frozen leaves kept
    model_specs = autotp.model_specs(config, params_shape) if model_specs is None else model_specs
    model_specs = _staged(config, params_shape, model_specs, stages, stateful)
    offload, offload_params = offload_kinds(config.zero_optimization)
    plan = sharding.plan(params_shape, tx, mesh, config.zero_optimization.stage,
                         persistence_threshold=config.zero_optimization.stage3_param_persistence_threshold,
                         model_specs=model_specs, offload=offload, offload_params=offload_params,
                         model_state_shape=jax.eval_shape(make_state, key) if stateful else None)
    return _Prepared(config, key, tx, make_params, make_state if stateful else None, plan)

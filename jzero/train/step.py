"""`train_step`: one jitted, donated, sharded optimizer step with gradient accumulation.

The global batch (leading dim = ``train_batch_size``) is split into
``gradient_accumulation_steps`` micro-batches without moving data between devices: micro-batch
k takes the k-th chunk of every device's slice. Gradients are accumulated by ``lax.scan`` in
``data_types.grad_accum_dtype`` (fp32) and reduced where the ZeRO table says
(`jzero.zero.sharding.ZERO_RULES`): stages 0-1 keep each device's gradients unreduced until the last
micro-batch and reduce once (`_reduced_once`); stages 2-3 reduce every micro-batch, each layer's
gradient reduce-scattered inside the backward pass, into a sharded accumulator. The update runs
where the optimizer state lives (sharded for stage >= 1) and the new params are re-laid out per
the Plan (an all-gather at stages 1-2). Every output is pinned to the Plan, so the state keeps
its sharding step after step.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental.compute_on import compute_on
from jax.sharding import PartitionSpec as P

from jzero.train import collectives, pipestep
from jzero.train.state import TrainState
from jzero.zero import buckets, fused, groups, hooks, modelaxes, modelstate, optim, phase, precision, treepath
from jzero.zero.mesh import DATA_AXES, STAGE, axis_index, data_parallel_size, over_data, platform, pmean, psum
from jzero.zero.rows import split_over
from jzero.zero.sharding import ZERO_RULES

_constrain = jax.lax.with_sharding_constraint


@functools.partial(jax.jit, donate_argnums=(0,))
def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on ``batch`` (a pytree, leading dim = the global batch).

    Returns the new state and metrics: ``loss`` (mean over the global batch), ``grad_norm``
    (global L2 norm before clipping), ``lr`` (the lr applied, when the optimizer exposes it
    through `optax.inject_hyperparams`) and ``aux`` when the loss has one.
    """
    cfg, plan = state.config, state.plan
    _check_batch(batch, cfg.train_batch_size)
    batch = _constrain(batch, jax.tree.map(lambda _: plan.batch, batch))
    rng = jax.random.fold_in(state.rng, state.step)
    scaler = precision.loss_scaler(cfg)
    scale = state.loss_scale.scale if scaler is not None else jnp.float32(1.0)
    if state.config.pipeline.stages > 1:
        (loss, grads), aux, model_state = pipestep.pipelined_grads(state, state.params, batch, scale), None, None
    else:
        loss, aux, grads, model_state = _accumulated_grads(state, _compute_params(state), batch, rng, scale)
    scaled_norm = global_norm(grads, platform(plan.mesh))  # also the overflow check
    grad_norm = scaled_norm / scale
    divisor = scale
    if cfg.gradient_clipping > 0:
        # DeepSpeed folds clipping into unscaling: clip = (norm + 1e-6) / max_norm, applied if > 1.
        clip = (grad_norm + 1e-6) / cfg.gradient_clipping
        divisor = jnp.where(clip > 1, clip * scale, scale)
    # An fp16 overflow anywhere (the norm is not finite, or the step's gradient does not fit fp16)
    # skips the step on every device: params and optimizer state (and so the LR schedule's count)
    # stay bit-identical.
    overflow = overflowed(scaled_norm, grads, cfg.gradient_accumulation_steps) if scaler else jnp.bool_(False)
    with jax.named_scope("optimizer"):
        if plan.offload is None:
            params, opt_state = _apply_update(state, grads, divisor, overflow)
        else:  # ZeRO-Offload: the gradient shards go to the host, which updates its master copy
            grads = jax.device_put(grads, plan.update)
            divisor, overflow = jax.device_put((divisor, overflow), plan.replicated.with_memory_kind(plan.offload))
            with compute_on("device_host"):
                params, opt_state = _apply_update(state, grads, divisor, overflow)
            params, opt_state = jax.device_put((params, opt_state), (plan.params, plan.opt_state))  # scalars too
    loss_scale = state.loss_scale
    # a skipped step's norm is inf, however the overflow was found (`overflowed`)
    metrics = {"loss": loss, "grad_norm": jnp.where(overflow, jnp.inf, grad_norm)}
    if scaler is not None:
        loss_scale = scaler.update(state.loss_scale, overflow)
        metrics.update(loss_scale=state.loss_scale.scale, skipped=overflow, skipped_total=loss_scale.skipped,
                       loss_scale_at_min=state.loss_scale.scale <= scaler.min_scale)
    lr = optim.learning_rate(opt_state)
    if lr is not None:
        metrics["lr"] = lr
    if aux is not None:
        metrics["aux"] = aux
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=loss_scale,
                         model_state=model_state), metrics


def overflowed(scaled_norm: jax.Array, grads: Any, accumulation: int) -> jax.Array:
    """DeepSpeed's fp16 overflow: an inf or nan in any fp16 gradient. Each micro-batch's backward
    runs in fp16 (an overflow there makes ``scaled_norm`` inf); DeepSpeed also holds the step's
    gradient, summed over the micro-batches (averaged over the devices), as fp16 ``.grad``, which
    overflows where a sum of finite micro-batch gradients leaves fp16's range. jzero accumulates
    in fp32, so that sum, ``grads`` (the mean over micro-batches and devices) x ``accumulation``,
    is checked as fp16 here. The pipelined step (`jzero.train.pipestep`) holds the same sum. With
    one micro-batch that sum is a mean of finite fp16 gradients: no pass over them is needed."""
    if accumulation == 1:
        return ~jnp.isfinite(scaled_norm)
    too_big = [jnp.any(~jnp.isfinite((g * accumulation).astype(jnp.float16))) for g in jax.tree.leaves(grads)]
    return ~jnp.isfinite(scaled_norm) | jnp.any(jnp.stack(too_big))


def global_norm(grads: Any, platform: str) -> jax.Array:
    """The L2 norm over every leaf; on XLA:CPU each squared apart from the optimizer's own
    square: XLA:CPU merges ``g * g`` here with Adam's (the same expression), and the shared square
    is then written out in full for both instead of fused into each (+0.2 GB a step at 25M params;
    benchmarks/overhead.py), so a barrier hides that they are the same values. The TPU compiler
    fuses the norm into the optimizer's pass over the gradients, which the barrier would prevent
    (a second read of every gradient: 3% more bytes than a hand-written step)."""
    return optax.tree.norm(jax.lax.optimization_barrier(grads) if platform == "cpu" else grads)


def _apply_update(state: TrainState, grads: Any, divisor: jax.Array, overflow: jax.Array) -> tuple[Any, Any]:
    """(new params, new opt_state), laid out per the Plan: the update runs in each param's
    optimizer-state layout and the new params are moved back to the stored layout (the
    all-gather of stages 1-2). On an fp16 overflow both stay as they were."""
    plan = state.plan
    is_fused = optim.fused_backend(state.config) is not None
    grads, params = _constrain(grads, plan.update), _constrain(state.params, plan.update)
    params, opt_state = _update(state, grads, params, divisor, overflow, is_fused)
    params, opt_state = _constrain(_to_stored(params, plan), plan.params), _constrain(opt_state, plan.opt_state)
    if precision.loss_scaler(state.config) is not None:
        def keep_on_overflow(old, new):  # the fused kernel already kept its arrays
            return new if is_fused and new.ndim else jnp.where(overflow, old, new)

        if not is_fused:
            params = jax.tree.map(keep_on_overflow, state.params, params)
        opt_state = jax.tree.map(keep_on_overflow, state.opt_state, opt_state)
    return params, opt_state


def _to_stored(params: Any, plan: Any) -> Any:
    """The new params moved from the update layout to the stored one: at stages 1-2 each
    leaf's all-gather over its ZeRO group, written out (`buckets.all_gather`: whole chunks put in
    place, where GSPMD's all-gather transposes the array element by element, twice; on TPU the
    leaf's own all-gather, `buckets.rows_are_free`)."""
    rows = buckets.rows_are_free(platform(plan.mesh))

    def one(p: jax.Array, update: Any, stored: Any) -> jax.Array:
        if update.spec == stored.spec:
            return p
        red = hooks.reduction(update.spec)
        gather = (functools.partial(buckets.all_gather, dim=red.dim, axes=red.scatter) if rows else
                  functools.partial(jax.lax.all_gather, axis_name=red.scatter, axis=red.dim, tiled=True))
        # check_vma off: an all-gather's result is the same on every device of the group, which
        # JAX's varying-axes types do not record
        return jax.shard_map(gather, mesh=plan.mesh, in_specs=update.spec, out_specs=stored.spec,
                             check_vma=False)(p)

    return jax.tree.map(one, params, plan.update, plan.params)


def _update(state: TrainState, grads: Any, params: Any, divisor: jax.Array, overflow: jax.Array,
            is_fused: bool) -> tuple[Any, Any]:
    """(new params, new opt_state): the fused kernel (divides, skips and updates in place), or
    the optax transformation on grads divided by ``divisor``."""
    cfg = state.config
    if is_fused:
        return fused.apply(state.tx, grads, state.opt_state, params, grad_divisor=divisor, skip=overflow,
                           layout=state.plan.update)
    if precision.loss_scaler(cfg) is not None or cfg.gradient_clipping > 0:
        grads = jax.tree.map(lambda g: g / divisor.astype(g.dtype), grads)
    updates, opt_state = state.tx.update(grads, state.opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _compute_params(state: TrainState) -> Any:
    """The params forward and backward read, in ``plan.compute``: the stored fp32 params, or
    under ZeRO-Offload their cast to the compute dtype, made on the host from the master copy
    and moved to the device (the all-gather of the new params of stages 1-2), or left on the
    host with offload_param, for the hooks to bring one layer at a time."""
    plan = state.plan
    if plan.offload is None:
        return state.params
    with compute_on("device_host"):
        low = precision.cast_floating(state.params, precision.policy(state.config).compute_dtype)
    return _constrain(jax.device_put(low, plan.compute), plan.compute)


def _loss_and_aux(state: TrainState, params: Any, batch: Any, rng: jax.Array, scale: Any = 1.0,
                  ctx: hooks.HookContext | None = None, model_state: Any = None):
    """The user's loss on params in the compute dtype: cast here, or by the hooks of ``ctx``
    (`hooks.bind`, stages 2-3: after the reduce-scatter in backward, so gradients are reduced
    in the communication dtype). A stateful model also takes ``model_state`` and gives its
    new value: ``(loss x scale, (loss, aux, new model state or None))``."""
    if ctx is None:
        params = precision.cast_floating(params, precision.policy(state.config).compute_dtype)
    with hooks.active(ctx), split_over(DATA_AXES), modelaxes.active(collectives.model_axes(state.config)):
        if model_state is None:
            out, new_state = state.loss_fn(params, batch, rng), None
        else:
            out, new_state = state.loss_fn(params, batch, rng, model_state)
            _check_model_state(model_state, new_state)
    if ctx is not None:
        hooks.check_used(ctx)
    loss, aux = out if isinstance(out, tuple) else (out, None)
    loss = loss.astype(jnp.float32)
    return loss * scale, (loss, aux, new_state)


def _check_model_state(before: Any, after: Any) -> None:
    """One line naming the leaf when a model's new state is not laid out like the old: jzero
    keeps the state at fixed shapes and dtypes, replicated, from step to step."""
    def layout(tree: Any) -> dict[str, tuple]:
        return {n: (*x.shape, str(x.dtype)) for n, x in treepath.named_leaves(tree).items()}

    mismatch = treepath.first_mismatch(layout(before), layout(after), "state loss_fn was given",
                                       "state it returned")
    if mismatch:
        raise ValueError(f"model state: {mismatch} (shape, dtype); loss_fn must return its state with the same "
                         "leaves, shapes and dtypes (a growing collection, like a decoding cache, is not trainable "
                         "state)")


def _hooked(state: TrainState) -> Any:
    """The hook of every leaf at stages that reduce every micro-batch (2-3); None at stages 0-1,
    whose gradients are reduced once per step."""
    plan = state.plan
    if ZERO_RULES[plan.stage].reduce_once:
        return None
    return hooks.leaf_hooks(plan.compute, plan.grads, groups.frozen_mask(state.config, state.params))


def _local_loss(state: TrainState, hooked: Any, stored: Any, targets: Any, acc: Any, rows: Any, rng: jax.Array,
                scale: Any, model_state: Any = None):
    """`_loss_and_aux` of one device's ``rows`` inside the step's ``shard_map``, as a function of
    ``targets`` (what is differentiated): the params themselves (stages 0-1; with an accumulator
    ``acc``, stacked leaves add their gradient into it layer by layer: `hooks.bind_accumulators`),
    or each param's view in the reduced-gradient layout, bound with ``stored`` to its hook
    (stages 2-3)."""
    if hooked is None and acc is None:
        return _loss_and_aux(state, targets, rows, rng, scale, model_state=model_state)
    ctx = hooks.HookContext(collectives.wire(state.config, state.plan.mesh), on_host=state.plan.compute_on_host)
    params = (hooks.bind(ctx, hooked, stored, targets) if hooked is not None
              else hooks.bind_accumulators(ctx, targets, acc))
    return _loss_and_aux(state, params, rows, rng, scale, ctx, model_state)


def _accumulated_grads(state: TrainState, stored: Any, batch: Any, rng: jax.Array, scale: Any):
    """(mean loss, mean aux, mean grads of loss x scale, new model state) over the micro-batches,
    laid out per plan.grads and reduced where the stage's row of the ZeRO table says.

    One ``shard_map`` over the data axes: each device takes the gradients of its own rows,
    micro-batch by micro-batch, into a local fp32 accumulator. Stages 0-1 (DeepSpeed's rule for
    them): params typed "varying" (``pcast``) so the gradient stays unreduced, and the
    accumulator reduced once, in the communication dtype: 2 Psi per step whatever the
    accumulation, one full fp32 gradient (4 B/param) the price. Stages 2-3: the hooks
    (`hooks.bind`) reduce-scatter every micro-batch's gradient into the sharded accumulator.
    Each local loss is scaled by 1 / (micro-batches x devices) before differentiation, as the
    global mean loss is, so the gradients leave the backward as means: no pass over them after.
    Not under fp16: there the backward runs at loss x loss scale, DeepSpeed's, whose overflows
    (in the backward and on the wire) set the scaler's course, and the mean is taken after.
    A model's state is threaded through the micro-batches and averaged over the devices
    (`jzero.zero.modelstate`)."""
    cfg, plan = state.config, state.plan
    pol = precision.policy(cfg)
    accum, count = cfg.gradient_accumulation_steps, cfg.gradient_accumulation_steps * data_parallel_size(plan.mesh)
    hooked, fp16 = _hooked(state), precision.loss_scaler(cfg) is not None
    frozen = groups.frozen_mask(cfg, state.params)

    def local(stored, targets, rows, rng, scale, model_state):
        rng = jax.random.fold_in(rng, axis_index(DATA_AXES))  # each device its own dropout
        scale = scale if fp16 else scale / count  # the mean over micro-batches and devices, by the backward
        if hooked is None:
            targets = jax.tree.map(hooks.vary, stored)  # local, unreduced gradients

        def grad_fn(mb, r, acc, ms):
            bound_acc = acc if hooked is None else None
            (_, (loss, aux, ms)), (grads, acc_grads) = jax.value_and_grad(
                lambda t, a: _local_loss(state, hooked, stored, _stop_frozen(t, frozen), a, mb, r, scale, ms),
                argnums=(0, 1), has_aux=True)(targets, bound_acc)
            grads, ms = precision.cast_floating(grads, pol.grad_accum_dtype), jax.tree.map(hooks.vary, ms)
            if acc is None:
                return loss, aux, grads, ms
            if bound_acc is None:
                return loss, aux, jax.tree.map(jnp.add, acc, grads), ms
            return loss, aux, hooks.add_gradients(acc, grads, acc_grads), ms

        zeros = jax.tree.map(lambda t: jnp.zeros_like(t, pol.grad_accum_dtype), targets)
        if accum == 1:
            per_layer = _casts_per_layer(plan, hooked, pol.compute_dtype)
            loss, aux, acc, model_state = _one_batch(grad_fn, rows, rng, zeros if per_layer else None, model_state)
        else:
            micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), rows)
            loss0 = hooks.vary(jnp.zeros((), jnp.float32))  # a local sum
            loss, aux, acc, model_state = _sum_over_micro_batches(
                grad_fn, micro, rng, (zeros, loss0, jax.tree.map(hooks.vary, model_state)))
        if hooked is None:
            on_wire = collectives.wire(cfg, plan.mesh)
            acc = jax.tree.map(functools.partial(collectives.reduce_once, on_wire=on_wire), acc, plan.grads, frozen)
        aux = None if aux is None else jax.tree.map(lambda a: pmean(a, DATA_AXES), aux)
        acc = jax.tree.map(lambda g: g / count, acc) if fp16 else acc
        return (psum(loss, DATA_AXES) / count, aux, acc,
                modelstate.synchronized(model_state, DATA_AXES))

    specs = jax.tree.map(lambda s: s.spec, (plan.compute, plan.grads))
    return over_data(local, plan.mesh, in_specs=(*specs, P(DATA_AXES), P(), P(), P()),
                     out_specs=(P(), P(), specs[1], P()))(stored, _targets(state), batch, rng, scale, state.model_state)


def _casts_per_layer(plan: Any, hooked: Any, compute_dtype: Any) -> bool:
    """Whether one 16-bit batch at stages 0-1 binds a zero fp32 accumulator to the layer stacks
    so each layer casts its own params (`_one_batch`): on XLA:CPU only, where it is fast; elsewhere
    the zeros cost a fill and an add over every gradient (TPU: 1.066x a hand-written bf16 step's
    bytes accessed, 0.993x without)."""
    return platform(plan.mesh) == "cpu" and hooked is None and compute_dtype != jnp.float32


def _one_batch(grad_fn, rows: Any, rng: jax.Array, zeros: Any, model_state: Any):
    """``grad_fn`` of one batch. Given ``zeros`` (stages 0-1 in 16 bits), with that zero
    accumulator bound to the layer stacks, so each layer casts its own params to the compute
    dtype and its gradient leaves the backward in fp32 layer by layer, fused with the layer's (as
    a hand-written step's per-layer cast is) rather than one stacked 16-bit gradient converted
    after the scan. A loss that reads stacked params outside `scan_layers` cannot bind them: it
    gets the plain path (the whole tree cast before the loss), as before."""
    if zeros is None:
        return grad_fn(rows, rng, None, model_state)
    try:
        return grad_fn(rows, rng, zeros, model_state)
    except hooks.StackedOutsideScan:
        return grad_fn(rows, rng, None, model_state)


def _stop_frozen(targets: Any, frozen: Any) -> Any:
    """``targets`` with the frozen leaves (`jzero.zero.groups`) cut from differentiation: their
    hooks run forward only (no gradient reduction), and XLA drops their weight-gradient work
    wherever the model's backward does not need it anyway."""
    return jax.tree.map(lambda t, f: jax.lax.stop_gradient(t) if f else t, targets, frozen)


def _targets(state: TrainState) -> Any:
    """What the hooks of stages 2-3 send each reduced gradient to: fp32 zeros in the gradient
    layout (only their type matters; XLA never materializes them)."""
    return jax.tree.map(lambda p, s: _constrain(jnp.zeros(p.shape, jnp.float32), s), state.params, state.plan.grads)


def _sum_over_micro_batches(grad_fn, micro: Any, rng: jax.Array, start: Any):
    """(sum of losses, mean aux, sum of gradients, last model state) of ``grad_fn(micro_batch,
    rng, acc, model_state) -> (loss, aux, acc + gradients, new model state)`` over the
    micro-batches (the leading axis of ``micro``), each with its own key, by ``lax.scan`` from
    ``start`` = (gradient accumulator, loss accumulator, model state)."""
    def body(carry, xs):
        (mb, i), (acc, loss_sum, ms) = xs, carry
        loss, aux, acc, ms = grad_fn(mb, jax.random.fold_in(rng, i), acc, ms)
        return (acc, loss_sum + loss, ms), aux

    steps = jax.tree.leaves(micro)[0].shape[0]
    (acc, loss_sum, ms), aux = jax.lax.scan(body, start, (micro, jnp.arange(steps)))
    return loss_sum, None if aux is None else jax.tree.map(lambda a: jnp.mean(a, axis=0), aux), acc, ms


def _check_batch(batch: Any, expected: int) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if x.ndim == 0 or x.shape[0] != expected:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: leading dimension must be the global batch "
                             f"train_batch_size={expected}, got shape {tuple(x.shape)}")


@jax.jit
def eval_step(state: TrainState, batch: Any) -> jax.Array:
    """The loss of ``state.params`` on ``batch`` (compute dtype, no gradient, no update, layers
    in evaluation: `jzero.zero.phase`, reading the carried model state): each device's rows
    under the step's ``shard_map``, averaged over devices. Under a pipeline the stages' blocks
    are read where they live by the compiler's own partitioning of the whole forward (no manual
    axes: XLA's partitioner aborts on a gather in a region manual over the data axes between the
    automatic "stage" and tensor axes; docs/design.md, "Pipeline parallelism")."""
    plan = state.plan
    _check_rows(batch, data_parallel_size(plan.mesh))
    pipelined = plan.mesh.shape[STAGE] > 1
    hooked = None if pipelined else _hooked(state)

    def local(stored, targets, rows, model_state):
        params = stored if hooked is None else targets  # what _local_loss reads at this stage
        with phase.evaluating():
            loss = _local_loss(state, hooked, stored, params, None, rows, state.rng, 1.0, model_state)[1][0]
        return pmean(loss, DATA_AXES)

    specs = jax.tree.map(lambda s: s.spec, (plan.compute, plan.grads))
    batch = _constrain(batch, jax.tree.map(lambda _: plan.batch, batch))
    return over_data(local, plan.mesh, in_specs=(*specs, P(DATA_AXES), P()), out_specs=P(), plain=pipelined)(
        _compute_params(state), _targets(state), batch, state.model_state)


def _check_rows(batch: Any, devices: int) -> None:
    """One line naming the leaf whose rows do not split evenly over the data-parallel devices, or
    differ from the first leaf's (each device would pair rows that are not the same examples)."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, x in leaves:
        if x.ndim == 0 or x.shape[0] % devices or not x.shape[0]:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: leading dimension must be a positive multiple of "
                             f"the data-parallel size {devices}, got shape {tuple(x.shape)}")
        if x.shape[0] != leaves[0][1].shape[0]:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: {x.shape[0]} rows, but "
                             f"batch{jax.tree_util.keystr(leaves[0][0])} has {leaves[0][1].shape[0]}")

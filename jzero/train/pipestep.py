"""The pipelined step's gradients: DeepSpeed's 1F1B ``TrainSchedule`` inside one jitted step
(docs/design.md, "Pipeline parallelism").

One ``shard_map`` manual over "stage" and the data axes runs every stage at once, each device
its own stage's blocks (the stack's block dimension is sharded over "stage",
`jzero.zero.pipeline.stage_specs`) on its data shard's micro-batches (``gradient_accumulation_steps``
of them). A loop of m + p - 1 iterations of two ticks each follows `jzero.zero.pipeline.slot`:
at a tick a stage runs a forward (its input stored in a ring of p slots: 1F1B's bound), a
backward (its stored input's forward recomputed under the model's remat policy, then
differentiated against the gradient the next stage sent) or nothing, chosen by ``lax.switch``;
then one ``ppermute`` moves what each stage produced, activations to the next stage and input
gradients to the previous one (at a tick the two directions pair disjoint neighbours).

Gradients are accumulated per device in fp32 and reduced once per step: the ends' (embeddings,
final LayerNorm, head) summed over the stages first (tied embeddings: the first stage's and the
last's, DeepSpeed's ``TiedLayerSpec``), then every leaf over the data devices into its ZeRO
layout (`jzero.train.collectives.reduce_once`). ZeRO-3's params are gathered over the data
devices once per step, before the loop; so stages 2 and 3 reduce as stage 1 does (DeepSpeed
refuses them with a pipeline).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.train import collectives
from jzero.zero import groups, modelaxes, pipeline, precision
from jzero.zero.mesh import DATA_AXES, STAGE, data_parallel_size, keeping, manual_axes

_constrain = jax.lax.with_sharding_constraint


def perms(stages: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (source, target) pairs of an even tick's ``ppermute`` and an odd tick's: stages
    running a forward send to the next stage, those running a backward to the previous one."""
    def at(parity: int) -> list[tuple[int, int]]:
        forward = [(s, s + 1) for s in range(stages - 1) if (s - parity) % 2 == 0]
        backward = [(s, s - 1) for s in range(1, stages) if (s - parity) % 2 == 1]
        return forward + backward

    return at(0), at(1)


def gathered(spec: P) -> P:
    """``spec`` without its data axes: a stage's params whole on each of its data devices."""
    return keeping(spec, lambda a: a not in DATA_AXES)


def pipelined_grads(state: Any, stored: Any, batch: Any, scale: Any) -> tuple[jax.Array, Any]:
    """(mean loss, mean gradients of loss x scale laid out per plan.grads) of the global
    ``batch``, by the 1F1B schedule over the pipeline's stages (``state.stages``)."""
    cfg, plan, cut = state.config, state.plan, state.stages
    m = cfg.gradient_accumulation_steps
    count = m * data_parallel_size(plan.mesh)
    fp16 = precision.loss_scaler(cfg) is not None
    stack_specs = jax.tree.map(lambda s: gathered(s.spec), plan.compute[cut.stack])
    ends_specs = {k: jax.tree.map(lambda s: gathered(s.spec), v) for k, v in plan.compute.items() if k != cut.stack}
    def on_mesh(specs):
        return jax.tree.map(lambda s: NamedSharding(plan.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    stack = _constrain(stored[cut.stack], on_mesh(stack_specs))
    ends = _constrain({k: v for k, v in stored.items() if k != cut.stack}, on_mesh(ends_specs))
    grad_specs = jax.tree.map(lambda s: s.spec, plan.grads)
    frozen = groups.frozen_mask(cfg, stored)
    on_wire = collectives.wire(cfg, plan.mesh)

    def local(stack, ends, rows, scale):
        scale = scale if fp16 else scale / count
        with modelaxes.active(collectives.model_axes(cfg)):
            loss, g_stack, g_ends = _schedule(state, stack, ends, rows, scale)
        grads = {**jax.lax.psum(g_ends, STAGE), cut.stack: g_stack}
        grads = jax.tree.map(lambda g, layout, f: collectives.reduce_once(g * (1 - f), layout, False, on_wire),
                             grads, plan.grads, frozen)
        grads = jax.tree.map(lambda g: g / count, grads) if fp16 else grads
        return jax.lax.psum(loss, (STAGE, *DATA_AXES)) / count, grads

    strip = jax.tree.map(lambda s: keeping(s, lambda a: a in manual_axes(plan.mesh)), (stack_specs, ends_specs),
                         is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(*strip, P(DATA_AXES), P()),
                         out_specs=(P(), jax.tree.map(lambda s: keeping(s, lambda a: a in manual_axes(plan.mesh)),
                                                      grad_specs, is_leaf=lambda x: isinstance(x, P))),
                         axis_names=manual_axes(plan.mesh), check_vma=False)(stack, ends, batch, scale)


def _schedule(state: Any, stack: Any, ends: Any, rows: Any, scale: Any) -> tuple[jax.Array, Any, Any]:
    """One device's stage through the whole schedule: (its loss sum, its accumulated fp32
    gradients of the stack and of the ends)."""
    cfg, cut = state.config, state.stages
    p, m = cfg.pipeline.stages, cfg.gradient_accumulation_steps
    compute = precision.policy(cfg).compute_dtype
    s = jax.lax.axis_index(STAGE)
    micro = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), rows)
    last = s == p - 1

    def forward(stack, ends, x, mb):
        stack, ends = precision.cast_floating((stack, ends), compute)
        return cut.layers(stack, jnp.where(s == 0, cut.embed(ends, mb), x))

    def objective(stack, ends, x, mb, ct):  # the last stage's loss, else <output, its gradient>
        y = forward(stack, ends, x, mb)
        loss = jax.lax.cond(last, lambda: cut.head(precision.cast_floating(ends, compute), y, mb).astype(jnp.float32),
                            lambda: jnp.zeros((), jnp.float32))
        inner = jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
        return jnp.where(last, loss * scale, inner), loss

    shape = jax.eval_shape(lambda e, mb: cut.embed(precision.cast_floating(e, compute), mb), ends,
                           jax.tree.map(lambda x: x[0], micro))
    zeros_x = jnp.zeros(shape.shape, shape.dtype)
    zero_grads = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (stack, ends))

    def tick(carry, t, perm):
        stash, recv, acc, loss_sum = carry
        op, i = pipeline.slot(t, s, p, m)
        k = jnp.clip(i, 0, m - 1)
        mb = jax.tree.map(lambda x: x[k], micro)
        kept = stash[k % p]

        def idle():
            return zeros_x, zero_grads, jnp.zeros((), jnp.float32)

        def run_forward():
            return jax.lax.cond(last, lambda: zeros_x, lambda: forward(stack, ends, recv, mb)), zero_grads, idle()[2]

        def run_backward():
            (_, loss), (g_stack, g_ends, g_x) = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
                stack, ends, kept, mb, recv)
            return g_x.astype(zeros_x.dtype), (g_stack, g_ends), loss

        # Only what a tick produces leaves the switch: the stash and the accumulators are
        # updated in place outside it (inside, each branch would return a copy of them).
        send, grads, loss = jax.lax.switch(op, [idle, run_forward, run_backward])
        stash = stash.at[k % p].set(jnp.where(op == pipeline.FORWARD, recv, kept))
        acc = jax.tree.map(jnp.add, acc, grads)
        return stash, jax.lax.ppermute(send, STAGE, perm), acc, loss_sum + loss

    even, odd = perms(p)

    def iteration(carry, it):
        return tick(tick(carry, 2 * it, even), 2 * it + 1, odd), None

    start = (jnp.zeros((p, *shape.shape), shape.dtype), zeros_x, zero_grads, jnp.zeros((), jnp.float32))
    (_, _, (g_stack, g_ends), loss_sum), _ = jax.lax.scan(iteration, start, jnp.arange(m + p - 1))
    return loss_sum, g_stack, g_ends

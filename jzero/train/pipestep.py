"""The pipelined step's gradients: DeepSpeed's 1F1B ``TrainSchedule`` inside one jitted step
(docs/design.md, "Pipeline parallelism").

One ``shard_map`` manual over "stage" and the data axes runs every stage at once, each device
its own stage's blocks (the stack's block dimension is sharded over "stage",
`jzero.zero.pipeline.stage_specs`; circular stages reshard it round-robin once a step, `chunked`)
on its data shard's micro-batches (``gradient_accumulation_steps`` of them). A loop of two ticks
an iteration (m + p - 1 iterations without repeats) follows `jzero.zero.pipeline.slot`:
at a tick a stage runs a forward (what its vjp saves under the model's remat policy stored in a
ring of `jzero.zero.pipeline.stash_size` slots, `jzero.zero.residuals`: p without repeats,
1F1B's bound), a backward (that vjp applied to the gradient the next stage sent; the last
virtual stage, which keeps its input instead, runs its forward, the loss and the backward at
once) or nothing, chosen by ``lax.switch``;
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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.models import packing
from jzero.train import collectives
from jzero.zero import branches, groups, modelaxes, pipeline, precision, residuals
from jzero.zero.mesh import DATA_AXES, STAGE, data_parallel_size, keeping, manual_axes

_constrain = jax.lax.with_sharding_constraint


def perms(stages: int, circular: bool = False) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (source, target) pairs of an even tick's ``ppermute`` and an odd tick's: stages
    running a forward send to the next stage, those running a backward to the previous one;
    ``circular``: round the ring (the last stage's output to the first, for the next repeat)."""
    def at(parity: int) -> list[tuple[int, int]]:
        forward = [(s, (s + 1) % stages) for s in range(stages - 1 + circular) if (s - parity) % 2 == 0]
        backward = [(s, (s - 1) % stages) for s in range(1 - circular, stages) if (s - parity) % 2 == 1]
        return forward + backward

    return at(0), at(1)


def gathered(spec: P) -> P:
    """``spec`` without its data axes: a stage's params whole on each of its data devices."""
    return keeping(spec, lambda a: a not in DATA_AXES)


def chunked(spec: P) -> P:
    """``spec`` of a stack leaf [blocks, ...] as that of its [repeats, blocks / repeats, ...]
    view: sharded over "stage" along dim 1, each stage holds block r·pc + s·c + j as its
    repeat r's j-th (circular stages' interleaved layout; one chunk at repeats 1)."""
    return P(None, *spec)


def pipelined_grads(state: Any, stored: Any, batch: Any, scale: Any) -> tuple[jax.Array, Any]:
    """(mean loss, mean gradients of loss x scale laid out per plan.grads) of the global
    ``batch``, by the 1F1B schedule over the pipeline's stages (``state.stages``)."""
    cfg, plan, cut = state.config, state.plan, state.stages
    m, v = cfg.gradient_accumulation_steps, cfg.pipeline.repeats
    count = m * data_parallel_size(plan.mesh)
    fp16 = precision.loss_scaler(cfg) is not None
    tied = precision.policy(cfg).compute_dtype if fp16 else jnp.float32
    stack_specs = jax.tree.map(lambda s: chunked(gathered(s.spec)), plan.compute[cut.stack])
    ends_specs = {k: jax.tree.map(lambda s: gathered(s.spec), v) for k, v in plan.compute.items() if k != cut.stack}
    def on_mesh(specs):
        return jax.tree.map(lambda s: NamedSharding(plan.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    # Circular stages take their blocks round-robin: one exchange over "stage" a step (none at v = 1).
    stack = _constrain(jax.tree.map(lambda x: x.reshape(v, -1, *x.shape[1:]), stored[cut.stack]), on_mesh(stack_specs))
    ends = _constrain({k: v for k, v in stored.items() if k != cut.stack}, on_mesh(ends_specs))
    layouts = {**plan.grads, cut.stack: jax.tree.map(lambda s: NamedSharding(plan.mesh, chunked(s.spec)),
                                                     plan.grads[cut.stack])}
    manual = functools.partial(keeping, keep=lambda a: a in manual_axes(plan.mesh))
    grad_specs = jax.tree.map(lambda s: manual(s.spec), layouts)
    frozen = groups.frozen_mask(cfg, stored)
    on_wire = collectives.wire(cfg, plan.mesh)

    def local(stack, ends, rows, scale):
        scale = scale if fp16 else scale / count
        with modelaxes.active(collectives.model_axes(cfg)):
            loss, g_stack, g_ends = _schedule(state, stack, ends, rows, scale)
        # fp16: summed as fp16, so a tied embedding's halves overflow where the plain step's
        # fp16 gradient of the one tied weight does (and DeepSpeed's fp16 tied all-reduce)
        ends_sum = jax.tree.map(lambda g: jax.lax.psum(g.astype(tied), STAGE).astype(jnp.float32), g_ends)
        grads = {**ends_sum, cut.stack: g_stack}
        grads = jax.tree.map(lambda g, layout, f: collectives.reduce_once(g * (1 - f), layout, False, on_wire),
                             grads, layouts, frozen)
        grads = jax.tree.map(lambda g: g / count, grads) if fp16 else grads
        return jax.lax.psum(loss, (STAGE, *DATA_AXES)) / count, grads

    strip = jax.tree.map(manual, (stack_specs, ends_specs), is_leaf=lambda x: isinstance(x, P))
    loss, grads = jax.shard_map(local, mesh=plan.mesh, in_specs=(*strip, P(DATA_AXES), P()),
                                out_specs=(P(), grad_specs), axis_names=manual_axes(plan.mesh),
                                check_vma=False)(stack, ends, batch, scale)
    blocks = jax.tree.map(lambda g, layout: _constrain(g.reshape(-1, *g.shape[2:]), layout),
                          grads[cut.stack], plan.grads[cut.stack])
    return loss, {**grads, cut.stack: blocks}


def _chunk_fns(cut: Any, scale: Any) -> tuple[Any, Any]:
    """A chunk's forward in (consts: micro-batch, first?; params: chunk, ends; its input), the
    first virtual stage embedding, and the last virtual stage's scaled loss (and loss) through it."""
    def forward(consts, params, x):
        (mb, first), (chunk, ends) = consts, params
        x = jnp.where(first, cut.embed(ends, mb), x)
        return cut.layers(chunk, x, mb) if packing.packed(mb) else cut.layers(chunk, x)

    def objective(params, x, consts):
        loss = cut.head(params[1], forward(consts, params, x), consts[0]).astype(jnp.float32)
        return loss * scale, loss

    return forward, objective


class _Empty(NamedTuple):
    """A tick's outputs where it produces nothing (zeros), and the stored residuals' structure."""

    x: jax.Array  # a stage's input or output
    stored: list  # one forward's residuals (`jzero.zero.residuals`)
    grads: Any  # (a chunk's, the ends'), fp32
    saved: residuals.Saved


def _schedule(state: Any, stack: Any, ends: Any, rows: Any, scale: Any) -> tuple[jax.Array, Any, Any]:
    """One device's stage through the whole schedule: (its loss sum, its accumulated fp32
    gradients of its stack chunks [repeats, blocks, ...] and of the ends)."""
    cfg, cut = state.config, state.stages
    p, m, v = cfg.pipeline.stages, cfg.gradient_accumulation_steps, cfg.pipeline.repeats
    cast = functools.partial(precision.cast_floating, dtype=precision.policy(cfg).compute_dtype)
    s = jax.lax.axis_index(STAGE)
    micro = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), rows)
    slots = pipeline.stash_size(p, m, v)
    on_tick, on_last = (branches.scope(f) for f in pipeline.branch_fractions(p, m, v))
    fns = _chunk_fns(cut, scale)
    ends = cast(ends)
    consts0, chunk0 = (jax.tree.map(lambda x: x[0], micro), jnp.bool_(True)), cast(jax.tree.map(lambda x: x[0], stack))
    shape = jax.eval_shape(cut.embed, ends, consts0[0])
    _, stored_shapes, saved = residuals.shapes(fns[0], consts0, (chunk0, ends), jnp.zeros(shape.shape, shape.dtype))
    zero_grads = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (stack, ends))
    empty = _Empty(jnp.zeros(shape.shape, shape.dtype), residuals.zeros(stored_shapes, saved),
                   (jax.tree.map(lambda x: x[0], zero_grads[0]), zero_grads[1]), saved)

    def tick(carry, t, perm):
        inputs, ring, recv, acc, loss_sum = carry
        op, i, r = pipeline.slot(t, s, p, m, v)
        k, r = jnp.clip(i, 0, m - 1), (jnp.clip(r, 0, v - 1) if v > 1 else 0)
        consts = (jax.tree.map(lambda x: x[k], micro), (s == 0) & (r == 0))
        params = (cast(jax.tree.map(lambda x: x[r], stack)), ends)
        key = pipeline.forward_index(k, r, p, v) % slots
        ops = _ops(fns, empty, on_last, consts, params, recv, inputs[key],
                   lambda: [x[key] for x in ring], (s == p - 1) & (r == v - 1))
        # Only what a tick produces leaves the switch: the stashes and the accumulators are
        # updated in place outside it (inside, each branch would return a copy of them).
        with jax.named_scope(on_tick):
            send, keep, g_chunk, g_ends, loss = jax.lax.switch(op, ops)
        put = jnp.where(op == pipeline.FORWARD, key, slots)  # other ticks write the spare slot
        inputs = inputs.at[put].set(recv)
        ring = [x.at[put].set(new) for x, new in zip(ring, keep, strict=True)]
        acc = (jax.tree.map(lambda a, g: a.at[r].add(g), acc[0], g_chunk), jax.tree.map(jnp.add, acc[1], g_ends))
        return inputs, ring, jax.lax.ppermute(send, STAGE, perm), acc, loss_sum + loss

    even, odd = perms(p, circular=v > 1)

    def iteration(carry, it):
        return tick(tick(carry, 2 * it, even), 2 * it + 1, odd), None

    start = (jnp.zeros((slots + 1, *shape.shape), shape.dtype),
             residuals.zeros(stored_shapes, saved, (slots + 1,)),
             empty.x, zero_grads, jnp.zeros((), jnp.float32))
    (*_, (g_stack, g_ends), loss_sum), _ = jax.lax.scan(iteration, start, jnp.arange(pipeline.ticks(p, m, v) // 2))
    return loss_sum, g_stack, g_ends


def _ops(fns: Any, empty: _Empty, on_last: str, consts: Any, params: Any, recv: Any, kept: Any,
         stored: Any, last: Any) -> list[Any]:
    """A tick's three branches (idle, forward, backward), each -> (what it sends, the residuals
    to store, its chunk's and the ends' fp32 gradients, its loss). ``kept``: the stored input
    (the last virtual stage's); ``stored()``: the stored residuals, sliced inside the branch
    (sliced outside, the slice is an operand copy: +1 slot)."""
    forward, objective = fns

    def idle():
        return empty.x, empty.stored, *empty.grads, jnp.float32(0)

    def run_forward():
        def through():
            return residuals.forward(forward, consts, params, recv)[:2]

        with jax.named_scope(on_last):  # the last virtual stage runs its forward with its backward
            sent, keep = jax.lax.cond(last, lambda: (empty.x, empty.stored), through)
        return sent, keep, *empty.grads, jnp.float32(0)

    def run_backward():
        def from_stash():
            (g_chunk, g_ends), g_x = residuals.pullback(empty.saved, consts, params, stored())(recv)
            return g_x, g_chunk, g_ends, jnp.float32(0)

        def through_head():
            (_, loss), ((g_chunk, g_ends), g_x) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
                params, kept, consts)
            return g_x, g_chunk, g_ends, loss

        with jax.named_scope(on_last):
            g_x, g_chunk, g_ends, loss = jax.lax.cond(last, through_head, from_stash)
        return g_x.astype(empty.x.dtype), empty.stored, *_as_fp32((g_chunk, g_ends)), loss

    return [idle, run_forward, run_backward]


def _as_fp32(tree: Any) -> Any:
    return jax.tree.map(lambda g: g.astype(jnp.float32), tree)

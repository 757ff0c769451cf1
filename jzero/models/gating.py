"""DeepSpeed-MoE's gating (`deepspeed/moe/sharded_moe.py`: ``top1gating``, ``top2gating``,
``topkgating``) as pure functions of one group's router logits.

A group is the tokens one device gates at once (DeepSpeed: a rank's micro-batch), in row-major
(batch, sequence) order. Each gate returns a `Routing`: which (token, expert) routes survive the
capacity limit, their slot in the expert's buffer and their combine weight, the aux
load-balancing loss and the per-expert counts DeepSpeed reports (``exp_counts``, before drops).

    gate | choice                                   | capacity C (drop_tokens)   | aux loss            | weight
    -----+------------------------------------------+----------------------------+---------------------+----------
    k=1  | argmax softmax (RSample: of logits+Gumbel)| ceil(S/E * cf), >= min_cap | E * sum(me * ce)    | gate prob
    k=2  | argmax, then argmax of the rest (+Gumbel) | ceil(S/E * 2cf), >= min_cap| E^2 * mean(me * ce) | renormalised
    k>2  | top-k of softmax                         | ceil(S/E * k cf), >= min_cap| E^2/k * mean(me*ce) | renormalised

me: mean gate probability per expert; ce: fraction of tokens whose first choice (k <= 2; every
choice for k > 2) is that expert. Over capacity, top-1 keeps the first C tokens by position, or
by a random priority with ``use_rts`` (Random Token Selection); top-2 the first C routes,
every first choice ahead of every second; top-k the C routes of highest gate probability
(DeepSpeed's "probs" policy). ``drop_tokens = False``: DeepSpeed sizes C to the largest count,
a data-dependent shape; here C = S, the static bound of it, so no token is dropped and the
outputs are the same (a dropless sparse path would use ``ragged_all_to_all`` and
``ragged_dot`` on GPU/TPU, which XLA:CPU lacks).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class GateSpec:
    """A gate's settings (DeepSpeed's ``TopKGate`` arguments)."""

    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    noisy_gate_policy: str | None = None  # None | "Jitter" | "RSample"
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True


class Routing(NamedTuple):
    kept: jax.Array  # (S, E) bool: the route (token s -> expert e) has a slot
    slot: jax.Array  # (S, E) int32: its slot in expert e's buffer (0 where not kept)
    weight: jax.Array  # (S, E) fp32: its combine weight (0 where not kept)
    aux_loss: jax.Array  # () fp32: DeepSpeed's l_aux
    counts: jax.Array  # (E,) int32: routes per expert before the capacity limit (exp_counts)
    capacity: int  # C, static: slots per expert


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's ``_capacity``: ceil(tokens / experts * factor), at least ``min_capacity``
    (its float32 arithmetic, so the same C comes out)."""
    return max(math.ceil(np.float32(tokens / experts) * np.float32(factor)), min_capacity)


def route(logits: jax.Array, spec: GateSpec, rng: jax.Array | None, training: bool) -> Routing:
    """The `Routing` of one group's fp32 router ``logits`` (S, E). ``rng`` None: no random
    choice (no RTS, Gumbel sampling or RSample noise): first-come order, plain argmax."""
    factor = spec.capacity_factor if training else spec.eval_capacity_factor
    tokens, experts = logits.shape
    cap = capacity(tokens, experts, factor * spec.k, spec.min_capacity) if spec.drop_tokens else tokens
    keys = (None, None) if rng is None else tuple(jax.random.split(rng))
    gate = GATES[min(spec.k, 3)]
    return gate(logits.astype(jnp.float32), spec, cap, keys, training)


def _ranks(priority: jax.Array) -> jax.Array:
    """Each token's rank (0 = first) within its expert's column by descending ``priority``."""
    order = jnp.argsort(-priority, axis=0, stable=True)
    return jnp.argsort(order, axis=0, stable=True)


def _slots(mask: jax.Array) -> jax.Array:
    return (jnp.cumsum(mask, axis=0) - 1) * mask


def top1(logits, spec, cap, keys, training) -> Routing:
    gates = jax.nn.softmax(logits, axis=1)
    experts = gates.shape[1]
    choose = gates
    if spec.noisy_gate_policy == "RSample" and training and keys[0] is not None:
        choose = logits + jax.random.gumbel(keys[0], logits.shape)
    mask = jax.nn.one_hot(jnp.argmax(choose, axis=1), experts, dtype=jnp.int32)
    aux = jnp.sum(gates.mean(0) * mask.mean(0)) * experts
    if spec.use_rts and keys[1] is not None:  # the kept tokens: highest random priority
        rank = _ranks(jnp.where(mask > 0, 1.0 + jax.random.uniform(keys[1], mask.shape), 0.0))
    else:  # the first `cap` by position
        rank = jnp.cumsum(mask, axis=0) - 1
    kept = (mask > 0) & (rank < cap)
    return Routing(kept, _slots(kept.astype(jnp.int32)), gates * kept, aux, mask.sum(0), cap)


def top2(logits, spec, cap, keys, training) -> Routing:
    gates = jax.nn.softmax(logits, axis=1)
    experts = gates.shape[1]
    mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=1), experts, dtype=jnp.int32)
    second = logits
    if spec.top2_2nd_expert_sampling and keys[0] is not None:
        second = logits + jax.random.gumbel(keys[0], logits.shape)
    mask2 = jax.nn.one_hot(jnp.argmax(jnp.where(mask1 > 0, -jnp.inf, second), axis=1), experts, dtype=jnp.int32)
    loc1 = jnp.cumsum(mask1, axis=0) - 1
    loc2 = jnp.cumsum(mask2, axis=0) - 1 + mask1.sum(0, keepdims=True)  # every first choice comes first
    aux = jnp.mean(gates.mean(0) * mask1.mean(0)) * experts * experts
    counts = (mask1 + mask2).sum(0)
    keep1, keep2 = (mask1 > 0) & (loc1 < cap), (mask2 > 0) & (loc2 < cap)
    g1, g2 = jnp.sum(gates * keep1, 1), jnp.sum(gates * keep2, 1)
    denom = jnp.maximum(g1 + g2, jnp.finfo(jnp.float32).eps)
    weight = (g1 / denom)[:, None] * keep1 + (g2 / denom)[:, None] * keep2
    slot = loc1 * keep1 + loc2 * keep2
    return Routing(keep1 | keep2, slot, weight, aux, counts, cap)


def topk(logits, spec, cap, keys, training) -> Routing:
    gates = jax.nn.softmax(logits, axis=1)
    experts = gates.shape[1]
    _, idx = jax.lax.top_k(gates, spec.k)
    mask = jax.nn.one_hot(idx, experts, dtype=jnp.int32).sum(1)
    aux = jnp.mean(gates.mean(0) * mask.mean(0)) * experts * experts / spec.k
    kept = (mask > 0) & (_ranks(gates * mask) < cap)  # DeepSpeed's "probs" drop policy
    masked = gates * kept
    weight = masked / jnp.maximum(masked.sum(1, keepdims=True), jnp.finfo(jnp.float32).eps)
    return Routing(kept, _slots(kept.astype(jnp.int32)), weight, aux, mask.sum(0), cap)


GATES: dict[int, Callable[..., Routing]] = {1: top1, 2: top2, 3: topk}  # k >= 3 -> topk

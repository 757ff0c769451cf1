"""Mixture-of-Experts feed-forward layer with expert parallelism (DeepSpeed-MoE's ``MoE`` layer).

`moe_ffn` is the one code path; `MoE` (Linen) and `NNXMoE` (NNX) only hold its params. Per
group of tokens (`jzero.models.gating`): route, place each kept route in its expert's buffer
(E, C, d), run the experts (a GELU MLP each), and combine their outputs weighted by the gate.
With ``use_residual`` (PR-MoE) a dense MLP runs beside the experts and a learned softmax
coefficient mixes the two, as DeepSpeed does.

Expert parallelism: under the jzero step (`jzero.train.step`) the mesh's "expert" axis has
``ep_size`` devices and each holds E / ep_size experts (`jzero.zero.sharding`: params under an
``"experts"`` key); the layer reads that from its params' shapes (so a backward pass traced
later, outside the step's context, reads it too). Each device gates its own tokens, then one
``all_to_all`` over "expert" sends every expert's buffer to the device holding it and a second
brings the outputs back: two per MoE layer forward (their transposes in backward), each
E x C x d elements per device. Outside the step every expert is local and no data moves.

The layer returns its output and `MoEStats`: the aux loss, the fraction of routes dropped over
capacity and the expert load (max / mean of the routes per expert, before the limit).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jzero.config import Config, ConfigError
from jzero.models import gating
from jzero.zero import bits, phase
from jzero.zero.mesh import EXPERT
from jzero.zero.sharding import EXPERT_KEY

_init = nn.initializers.normal(0.02)
DISPATCH = "moe_dispatch"  # the named scope of the token all-to-alls (`jzero.analysis.profile` op_name)


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer: its gate, hidden sizes and PR-MoE residual."""

    gate: gating.GateSpec
    d_model: int
    d_ff: int
    use_residual: bool = False

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts


class MoEStats(NamedTuple):
    """Per-layer statistics; summed over a model's MoE layers (`zeros`, ``+``)."""

    aux_loss: jax.Array
    dropped: jax.Array  # fraction of routes over capacity
    load: jax.Array  # max / mean routes per expert

    @staticmethod
    def zeros(like: jax.Array) -> "MoEStats":
        """Zero stats typed like ``like`` (inside the step: varying over the same axes)."""
        zero = jnp.zeros_like(like, shape=(), dtype=jnp.float32)
        return MoEStats(zero, zero, zero)

    def __add__(self, other: "MoEStats") -> "MoEStats":  # type: ignore[override]
        return MoEStats(*(a + b for a, b in zip(self, other, strict=True)))


def spec_from_config(config: Config, d_model: int, d_ff: int) -> MoESpec | None:
    """The `MoESpec` of the config's ``moe`` section (None without one)."""
    m = config.moe
    if m is None:
        return None
    gate = gating.GateSpec(num_experts=m.num_experts, k=m.k, capacity_factor=m.capacity_factor,
                           eval_capacity_factor=m.eval_capacity_factor, min_capacity=m.min_capacity,
                           drop_tokens=m.drop_tokens, noisy_gate_policy=m.noisy_gate_policy, use_rts=m.use_rts,
                           top2_2nd_expert_sampling=m.top2_2nd_expert_sampling)
    return MoESpec(gate=gate, d_model=d_model, d_ff=d_ff, use_residual=m.use_residual)


def validate(config: Config) -> None:
    """ConfigError naming the ``moe`` key that is wrong (the mesh checks ``ep_size`` against the
    devices when it is built: `jzero.zero.mesh.make_mesh`)."""
    m = config.moe
    if m is None:
        return
    if config.jzero.model.name != "gpt":
        raise ConfigError(f"moe: only the gpt reference model has MoE layers (jzero.model.name is "
                          f"'{config.jzero.model.name}')")
    checks = [("num_experts", m.num_experts >= 1, "must be >= 1"),
              ("ep_size", m.ep_size >= 1, "must be >= 1"),
              ("ep_size", m.num_experts % max(m.ep_size, 1) == 0,
               f"{m.ep_size} does not divide num_experts {m.num_experts}"),
              ("k", 1 <= m.k <= m.num_experts, f"must be in 1..num_experts ({m.num_experts})"),
              ("capacity_factor", m.capacity_factor > 0, "must be > 0"),
              ("eval_capacity_factor", m.eval_capacity_factor > 0, "must be > 0"),
              ("min_capacity", m.min_capacity >= 0, "must be >= 0"),
              ("noisy_gate_policy", m.noisy_gate_policy != "RSample" or m.k == 1,
               "RSample applies to k = 1 only (DeepSpeed); use Jitter or null"),
              ("aux_loss_coef", m.aux_loss_coef >= 0, "must be >= 0"),
              ("expert_interval", m.expert_interval >= 1, "must be >= 1")]
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"moe.{key}: {why}, got {getattr(m, key)}")


def _mlp(p: Any, x: jax.Array, pattern: str) -> jax.Array:
    """GELU MLP ``out(gelu(fc(x)))``; ``pattern`` maps the batch dims (one MLP or one per expert)."""
    h = jnp.einsum(pattern[0], x, p["fc"]["kernel"]) + p["fc"]["bias"][..., None, :]
    return jnp.einsum(pattern[1], jax.nn.gelu(h), p["out"]["kernel"]) + p["out"]["bias"][..., None, :]


def _experts(p: Any, buffers: jax.Array) -> jax.Array:
    """Every expert's MLP on its buffer (E, C, d), as DeepSpeed's ``Experts`` runs them, one
    per local expert. Holding E / ep_size of the E experts (``p``: this device's, under the
    step), the buffers go to the devices that hold their experts and back (`all_to_all` over
    "expert")."""
    ep = buffers.shape[0] // p["fc"]["kernel"].shape[0]
    if ep > 1:  # (E, C, d) -> (E / ep, ep * C, d): each local expert's slots from every device
        buffers = all_to_all(buffers, 0, 1)
    out = _mlp(p, buffers, ("ecd,edf->ecf", "ecf,efd->ecd"))
    return all_to_all(out, 1, 0) if ep > 1 else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_to_all(x: jax.Array, split: int, concat: int) -> jax.Array:
    """``lax.all_to_all`` over "expert" in ``x``'s dtype (16-bit values moved as their bits, which
    no backend widens); backward: the reverse all-to-all of the cotangent, likewise."""
    with jax.named_scope(DISPATCH):
        moved = jax.lax.all_to_all(bits.raw(x), EXPERT, split_axis=split, concat_axis=concat, tiled=True)
    return bits.restored(moved, x.dtype)


def _all_to_all_fwd(x, split, concat):
    return all_to_all(x, split, concat), None


def _all_to_all_bwd(split, concat, _, ct):
    return (all_to_all(ct, concat, split),)


all_to_all.defvjp(_all_to_all_fwd, _all_to_all_bwd)


def _group(p: Any, tokens: jax.Array, spec: MoESpec, rng: jax.Array | None, training: bool):
    """(output, stats) of one group of tokens (S, d)."""
    x32 = tokens.astype(jnp.float32)
    if spec.gate.noisy_gate_policy == "Jitter" and training and rng is not None:
        rng, key = jax.random.split(rng)
        x32 = x32 * jax.random.uniform(key, x32.shape, minval=1.0 - 1e-2, maxval=1.0 + 1e-2)
    r = gating.route(x32 @ p["gate"]["kernel"].astype(jnp.float32), spec.gate, rng, training)
    slots = jax.nn.one_hot(r.slot, r.capacity, dtype=jnp.float32) * r.kept[..., None]  # (S, E, C)
    buffers = jnp.einsum("sec,sd->ecd", slots.astype(tokens.dtype), tokens)
    out = _experts(p[EXPERT_KEY], buffers)
    combine = slots * r.weight[..., None]
    y = jnp.einsum("sec,ecd->sd", combine, out.astype(jnp.float32)).astype(tokens.dtype)
    if spec.use_residual:
        mlp = _mlp(p["mlp"], tokens, ("sd,df->sf", "sf,fd->sd"))
        coef = jax.nn.softmax((x32 @ p["coefficient"]["kernel"] + p["coefficient"]["bias"]), axis=-1)
        y = (y * coef[:, 0:1] + mlp * coef[:, 1:]).astype(tokens.dtype)
    counts = r.counts.astype(jnp.float32)
    stats = MoEStats(r.aux_loss, 1.0 - r.kept.sum() / (tokens.shape[0] * spec.gate.k), counts.max() / counts.mean())
    return y, stats


def moe_ffn(p: Any, x: jax.Array, spec: MoESpec, rng: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
    """The MoE feed-forward of ``x`` (batch, seq, d): all its tokens one group (the rows one
    device sees in one micro-batch, under the step). ``p``: the params `init_params` makes
    (the local experts under the step). Training or evaluation: `jzero.zero.phase`."""
    b, t, d = x.shape
    y, stats = _group(p, x.reshape(b * t, d), spec, rng, phase.training())
    return y.reshape(b, t, d), stats


def param_shapes(spec: MoESpec, local_experts: int) -> dict[str, Any]:
    """Shapes of the layer's params with ``local_experts`` experts (DeepSpeed's names: ``gate``
    without bias, the experts' ``fc`` / ``out``, PR-MoE's ``mlp`` and ``coefficient``)."""
    d, f, e = spec.d_model, spec.d_ff, local_experts
    shapes = {"gate": {"kernel": (d, spec.num_experts)},
              EXPERT_KEY: {"fc": {"kernel": (e, d, f), "bias": (e, f)}, "out": {"kernel": (e, f, d), "bias": (e, d)}}}
    if spec.use_residual:
        shapes["mlp"] = {"fc": {"kernel": (d, f), "bias": (f,)}, "out": {"kernel": (f, d), "bias": (d,)}}
        shapes["coefficient"] = {"kernel": (d, 2), "bias": (2,)}
    return shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def init_params(rng: jax.Array, shapes: Any) -> Any:
    """Params of ``shapes`` (a tree of shapes): biases zero, the rest N(0, 0.02) (the GPT's init)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(rng, len(leaves))
    return jax.tree.unflatten(treedef, [jnp.zeros(shape) if path[-1].key == "bias" else _init(key, shape)
                                        for (path, shape), key in zip(leaves, keys, strict=True)])


class MoE(nn.Module):
    """Linen MoE layer: ``(y, stats) = MoE(spec)(x)``; the dropout RNG stream drives the gate's
    random choices (RTS, Gumbel sampling, noise), none without it. Applied to params holding a
    subset of the experts (the jzero step's local ones), it runs expert-parallel (`_experts`):
    the experts' shapes are read from the params, not checked against all E."""

    spec: MoESpec

    @nn.compact
    def __call__(self, x):
        shapes = param_shapes(self.spec, self.spec.num_experts)
        p = {name: self.get_variable("params", name) if self.has_variable("params", name)
             else self.param(name, init_params, tree) for name, tree in shapes.items()}
        rng = self.make_rng("dropout") if self.has_rng("dropout") else None
        return moe_ffn(p, x, self.spec, rng)


class NNXMoE(nnx.Module):
    """NNX MoE layer, the same params and `moe_ffn`; ``rngs.dropout`` drives the gate's random
    choices."""

    def __init__(self, spec: MoESpec, *, rngs: nnx.Rngs):
        self.spec = spec
        values = init_params(rngs.params(), param_shapes(spec, spec.num_experts))
        for name, tree in values.items():  # attributes named as the Linen layer's params
            setattr(self, name, nnx.data(jax.tree.map(nnx.Param, tree)))
        self.rngs = rngs

    def __call__(self, x):
        names = param_shapes(self.spec, 1)
        p = {n: jax.tree.map(lambda v: v[...], getattr(self, n), is_leaf=lambda v: isinstance(v, nnx.Param))
             for n in names}
        return moe_ffn(p, x, self.spec, self.rngs.dropout())

"""An AlphaFold 2 style Evoformer (AF2 supplement, Algorithm 6; OpenFold's ``EvoformerBlock``) on
`scan_layers`, with a secondary-structure head on the first MSA row and AF2's distogram head on
the pair representation.

Each block updates the MSA representation ``m`` ``[b, n_seq, L, c_m]`` and the pair
representation ``z`` ``[b, L, L, c_z]``: MSA row attention with pair bias (gated), MSA column
attention, MSA transition, outer product mean, triangle multiplicative updates (outgoing, incoming),
triangle attention (starting, ending node), pair transition. Every attention goes through
`jzero.models.attention` with the mask (padding) and, for row and triangle attention, the pair
bias: DS4Science's ``DS4Sci_EvoformerAttention`` computes exactly these two biases, and the
blockwise implementation is what keeps their ``L x L`` scores per head out of memory. The stack
carries ``(m, z, msa_mask, pair_mask)``; masks are floats (1: a residue) so the carry is one
differentiable pytree. LayerNorms take the two-pass variance (as PyTorch's, which OpenFold uses):
Flax's default E[x^2] - E[x]^2 made the gradients of a padded batch differ by 0.2% between two
XLA:CPU compilations of the same function (docs/design.md, "Evoformer").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jzero.config import AttentionConfig, Config, ConfigError
from jzero.models import attention
from jzero.models.adapters import from_linen
from jzero.models.base import Model, from_section
from jzero.models.layers import scan_layers

RESIDUE_CLASSES = 21  # 20 amino acids + unknown (jzero.tasks.protein.RESIDUES)
SS_CLASSES = 8  # DSSP's 8 states (jzero.tasks.protein.DSSP8)
DISTOGRAM_BINS = 64


# Blocks of 64: a crop of 384 is 36 block pairs, so one pair's scores per scan step are 1/36 of
# the naive attention's (`jzero.models.attention.blockwise.STEP_ELEMENTS` bounds the rest).
BLOCKS = AttentionConfig(block_q=64, block_k=64)


@dataclass(frozen=True)
class EvoformerConfig:
    crop: int = 64  # residues per example
    n_seq: int = 1  # MSA depth (1: single sequence)
    c_m: int = 64
    c_z: int = 32
    msa_heads: int = 4
    msa_head_dim: int = 16
    pair_heads: int = 2
    pair_head_dim: int = 16
    c_opm: int = 16  # outer product mean's hidden
    c_tri: int = 16  # triangle multiplication's hidden
    transition: int = 2  # transition width factor
    n_layers: int = 2  # Evoformer blocks
    relpos: int = 32  # relative positions clipped to +-relpos
    remat: str = "full"
    attention: AttentionConfig = BLOCKS

    @property
    def seq_len(self) -> int:
        """The length every attention runs over but the column one: the crop."""
        return self.crop


# AF2's published Evoformer (supplement 1.6) as the planning preset; "tiny" is the CPU demo.
SIZES: dict[str, EvoformerConfig] = {
    "tiny": EvoformerConfig(),
    "af2": EvoformerConfig(crop=384, n_seq=128, c_m=256, c_z=128, msa_heads=8, msa_head_dim=32, pair_heads=4,
                           pair_head_dim=32, c_opm=32, c_tri=128, transition=4, n_layers=48),
}
POSITIVE = ("crop", "n_seq", "c_m", "c_z", "msa_heads", "msa_head_dim", "pair_heads", "pair_head_dim", "c_opm",
            "c_tri", "transition", "n_layers", "relpos")
MAX_CROP = 1024  # one example's pair representation and scores grow as crop^2 and crop^3


def _attend(cfg: EvoformerConfig, q, k, v, bias, mask):
    """`attention.attention` per example: ``q/k/v`` ``[b, rows, L, h, d]``, ``bias`` ``[b, h, L, L]``
    or None (shared by the rows), ``mask`` ``[b, rows, L]`` (1: a key to attend to)."""
    s = cfg.attention

    def one(q, k, v, bias, mask):
        return attention.attention(q, k, v, bias=None if bias is None else bias[None], mask=mask[:, None, None] > 0,
                                   implementation=s.implementation, block_q=s.block_q, block_k=s.block_k,
                                   blockwise_from=s.blockwise_from)

    return jax.vmap(one, in_axes=(0, 0, 0, None if bias is None else 0, 0))(q, k, v, bias, mask)


class GatedAttention(nn.Module):
    """Gated self-attention over the last axis but one of ``x`` ``[b, rows, L, c]`` (AF2
    Algorithms 7, 8, 13, 14). ``bias``: none (column attention), from ``pair`` ``[b, L, L, c_z]``
    (MSA row attention), or from ``x`` itself (triangle attention, where rows and keys both
    index residues)."""

    cfg: EvoformerConfig
    heads: int
    head_dim: int
    bias: str = "none"  # "none" | "pair" | "self"

    @nn.compact
    def __call__(self, x, mask, pair=None):
        x = nn.LayerNorm(use_fast_variance=False, name="ln")(x)
        shape = (self.heads, self.head_dim)
        q, k, v = (nn.DenseGeneral(shape, use_bias=False, name=n)(x) for n in ("q", "k", "v"))
        gate = jax.nn.sigmoid(nn.DenseGeneral(shape, kernel_init=nn.initializers.zeros,
                                              bias_init=nn.initializers.ones, name="gate")(x))
        bias = None
        if self.bias != "none":
            # The pair's LayerNorm has no offset: it would add one constant to every score, which
            # softmax ignores; its gradient is rounding noise that Adam would amplify.
            source = x if self.bias == "self" else nn.LayerNorm(use_bias=False, use_fast_variance=False,
                                                                 name="ln_pair")(pair)
            bias = nn.Dense(self.heads, use_bias=False, name="pair_bias")(source).transpose(0, 3, 1, 2)
        out = _attend(self.cfg, q, k, v, bias, mask) * gate
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out")(out)


class Transition(nn.Module):
    """LayerNorm, a ``factor``-times wider ReLU layer, back to the width (AF2 Algorithms 9, 15)."""

    factor: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.factor * x.shape[-1], name="up")(nn.LayerNorm(use_fast_variance=False, name="ln")(x)))
        return nn.Dense(x.shape[-1], name="down")(h)


class OuterProductMean(nn.Module):
    """The MSA's outer products, averaged over (unmasked) sequences, into the pair (Algorithm 10;
    OpenFold's order: the projection, then the division by the count)."""

    c_opm: int
    c_z: int

    @nn.compact
    def __call__(self, m, msa_mask):
        m = nn.LayerNorm(use_fast_variance=False, name="ln")(m)
        w = msa_mask[..., None]
        a, b = nn.Dense(self.c_opm, name="a")(m) * w, nn.Dense(self.c_opm, name="b")(m) * w
        outer = jnp.einsum("bsic,bsjd->bijcd", a, b)
        outer = outer.reshape(*outer.shape[:3], -1)
        norm = jnp.einsum("bsi,bsj->bij", msa_mask, msa_mask)[..., None]
        return nn.Dense(self.c_z, name="out")(outer) / (norm + 1e-3)


class TriangleMultiplication(nn.Module):
    """The triangle multiplicative update using outgoing (``x_ij = sum_k a_ik b_jk``) or incoming
    (``sum_k a_ki b_kj``) edges (Algorithms 11-12)."""

    c_tri: int
    outgoing: bool

    @nn.compact
    def __call__(self, z, pair_mask):
        z = nn.LayerNorm(use_fast_variance=False, name="ln")(z)
        w = pair_mask[..., None]

        def gated(name):
            return w * jax.nn.sigmoid(nn.Dense(self.c_tri, name=f"{name}_gate")(z)) * nn.Dense(self.c_tri, name=name)(z)

        a, b = gated("a"), gated("b")
        x = jnp.einsum("bikc,bjkc->bijc" if self.outgoing else "bkic,bkjc->bijc", a, b)
        gate = jax.nn.sigmoid(nn.Dense(z.shape[-1], name="gate")(z))
        return gate * nn.Dense(z.shape[-1], name="out")(nn.LayerNorm(use_fast_variance=False, name="ln_out")(x))


class EvoformerBlock(nn.Module):
    """One Evoformer block on the carry ``(m, z, msa_mask, pair_mask)`` (Algorithm 6; no dropout)."""

    cfg: EvoformerConfig

    @nn.compact
    def __call__(self, carry):
        m, z, msa_mask, pair_mask = carry
        c = self.cfg
        with jax.named_scope("attention"):
            m = m + GatedAttention(c, c.msa_heads, c.msa_head_dim, "pair", name="msa_row")(m, msa_mask, z)
            cols = GatedAttention(c, c.msa_heads, c.msa_head_dim, name="msa_column")
            m = m + cols(m.swapaxes(1, 2), msa_mask.swapaxes(1, 2)).swapaxes(1, 2)
        with jax.named_scope("mlp"):
            m = m + Transition(c.transition, name="msa_transition")(m)
            z = z + OuterProductMean(c.c_opm, c.c_z, name="outer_product_mean")(m, msa_mask)
            z = z + TriangleMultiplication(c.c_tri, True, name="tri_mul_out")(z, pair_mask)
            z = z + TriangleMultiplication(c.c_tri, False, name="tri_mul_in")(z, pair_mask)
        with jax.named_scope("attention"):
            z = z + GatedAttention(c, c.pair_heads, c.pair_head_dim, "self", name="tri_att_start")(z, pair_mask)
            end = GatedAttention(c, c.pair_heads, c.pair_head_dim, "self", name="tri_att_end")
            z = z + end(z.swapaxes(1, 2), pair_mask.swapaxes(1, 2)).swapaxes(1, 2)
        with jax.named_scope("mlp"):
            z = z + Transition(c.transition, name="pair_transition")(z)
        return m, z, msa_mask, pair_mask


class Evoformer(nn.Module):
    """``(residues [b, L] int, mask [b, L], separation_prior [b, L, 64])`` -> (secondary-structure
    logits ``[b, L, 8]``, distogram logits ``[b, L, L, 64]``), fp32. The MSA is the sequence
    itself, ``n_seq`` times. One-hot inputs enter as embeddings (a Dense layer on a one-hot, in
    the params' dtype). ``separation_prior[:, s]``: log-probabilities of the distogram bins at
    separation ``|i - j| = s`` (the task's, from its training structures; zeros: none), added to
    the distogram head's logits: the network learns how a pair departs from its separation's
    distribution, which a zero-initialized head cannot learn in a few hundred Adam steps
    (docs/design.md, "Evoformer and proteins")."""

    cfg: EvoformerConfig

    @nn.compact
    def __call__(self, inputs):
        residues, mask, prior = inputs
        c = self.cfg
        with jax.named_scope("embedding"):
            z = nn.Embed(RESIDUE_CLASSES, c.c_z, name="left")(residues)[:, :, None]
            z = z + nn.Embed(RESIDUE_CLASSES, c.c_z, name="right")(residues)[:, None]
            pos = jnp.arange(residues.shape[1])
            rel = jnp.clip(pos[:, None] - pos[None], -c.relpos, c.relpos) + c.relpos
            z = z + nn.Embed(2 * c.relpos + 1, c.c_z, name="relpos")(rel)
            m = nn.Embed(RESIDUE_CLASSES, c.c_m, name="msa")(residues)  # AF2's MSA + target terms, one input
            m = jnp.broadcast_to(m[:, None], (m.shape[0], c.n_seq, *m.shape[1:]))
            mask = mask.astype(z.dtype)
            carry = (m, z, jnp.broadcast_to(mask[:, None], m.shape[:3]), mask[:, :, None] * mask[:, None])
        m, z, _, _ = scan_layers(EvoformerBlock(c), c.n_layers, remat_policy=c.remat, name="blocks")(carry)
        with jax.named_scope("head"):
            zeros = nn.initializers.zeros  # the heads start at the uniform Q8 prediction and the prior
            ss = nn.Dense(SS_CLASSES, kernel_init=zeros, name="ss")(
                nn.LayerNorm(use_fast_variance=False, name="ln_m")(m[:, 0]))
            dist = nn.Dense(DISTOGRAM_BINS, kernel_init=zeros, name="distogram")(z + z.swapaxes(1, 2))
            dist = dist + prior[:, jnp.abs(pos[:, None] - pos[None])].astype(dist.dtype)
        return ss.astype(jnp.float32), dist.astype(jnp.float32)


def masked_cross_entropy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed cross entropy over the labels >= 0, their count), in fp32."""
    valid = labels >= 0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid, picked, 0.0)), jnp.sum(valid)


def loss(out: tuple[jax.Array, jax.Array], batch: dict) -> tuple[jax.Array, dict]:
    """Mean secondary-structure (Q8) cross entropy over labelled residues plus mean distogram
    cross entropy over labelled pairs (a batch without one of them adds 0 for it); the two as
    ``ss_ce`` and ``distogram_ce`` (held-out ``distogram_loss`` is the task's metric)."""
    ss, dist = out
    ss_sum, ss_n = masked_cross_entropy(ss, batch["ss8"])
    d_sum, d_n = masked_cross_entropy(dist, batch["distogram"])
    ss_loss, d_loss = ss_sum / jnp.maximum(ss_n, 1), d_sum / jnp.maximum(d_n, 1)
    return ss_loss + d_loss, {"ss_ce": ss_loss, "distogram_ce": d_loss}


def evoformer_config(config: Config) -> EvoformerConfig:
    cfg = from_section(config.jzero.model, SIZES, config.jzero.remat, POSITIVE)
    if cfg.crop > MAX_CROP:
        raise ConfigError(f"jzero.model.crop: {cfg.crop} residues is longer than the Evoformer allows "
                          f"({MAX_CROP}: its pair scores grow as crop^3)")
    return cfg


def batch_spec(cfg: EvoformerConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Batches: residue classes, the mask (1: a residue), the separation prior (`Evoformer`), Q8
    labels and distogram bins (-1: none)."""
    row, pair = (batch_size, cfg.crop), (batch_size, cfg.crop, cfg.crop)
    return {"residues": jax.ShapeDtypeStruct(row, jnp.int32), "mask": jax.ShapeDtypeStruct(row, jnp.float32),
            "separation_prior": jax.ShapeDtypeStruct((*row, DISTOGRAM_BINS), jnp.float32),
            "ss8": jax.ShapeDtypeStruct(row, jnp.int32), "distogram": jax.ShapeDtypeStruct(pair, jnp.int32)}


def example_batch(cfg: EvoformerConfig, batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    row, pair = (batch_size, cfg.crop), (batch_size, cfg.crop, cfg.crop)
    return {"residues": rng.integers(0, RESIDUE_CLASSES, row).astype(np.int32), "mask": np.ones(row, np.float32),
            "separation_prior": np.zeros((*row, DISTOGRAM_BINS), np.float32),
            "ss8": rng.integers(0, SS_CLASSES, row).astype(np.int32),
            "distogram": rng.integers(0, DISTOGRAM_BINS, pair).astype(np.int32)}


def model_flops(cfg: EvoformerConfig, batch_size: int) -> dict[str, float]:
    """Training FLOPs of one step (3 x the forward's matmuls): ``attention`` the score and
    weighted-sum products of the four attentions, ``dense`` every projection, the outer product
    and the triangle products."""
    n, L, cm, cz = cfg.n_seq, cfg.crop, cfg.c_m, cfg.c_z
    hm, hz = cfg.msa_heads * cfg.msa_head_dim, cfg.pair_heads * cfg.pair_head_dim
    msa = 2 * n * L * cm * (2 * 5 * hm + 2 * cfg.transition * cm)  # row + column q k v gate out, transition
    msa += 2 * n * L * cm * 2 * cfg.c_opm + 2 * n * L * L * cfg.c_opm ** 2 + 2 * L * L * cfg.c_opm ** 2 * cz
    pair = 2 * L * L * cz * (4 * cfg.c_tri + cz + cfg.c_tri) * 2 + 2 * 2 * L ** 3 * cfg.c_tri  # triangle mult.
    pair += 2 * L * L * cz * (5 * hz + cfg.pair_heads) * 2 + 2 * L * L * cz * cfg.pair_heads  # tri. attn, row bias
    pair += 2 * L * L * cz * 2 * cfg.transition * cz
    attn = 4 * n * L * L * hm + 4 * L * n * n * hm + 2 * 4 * L ** 3 * hz
    heads = 2 * L * cm * SS_CLASSES + 2 * L * L * cz * DISTOGRAM_BINS
    dense = 3.0 * batch_size * (cfg.n_layers * (msa + pair) + heads)
    attention_flops = 3.0 * batch_size * cfg.n_layers * attn
    return {"dense": dense, "attention": attention_flops, "total": dense + attention_flops}


def make(cfg: EvoformerConfig) -> tuple[Any, Any]:
    """(init_fn, loss_fn) for jzero.init on batches of `batch_spec`."""
    spec = batch_spec(cfg, 1)
    return from_linen(Evoformer(cfg), inputs(spec), loss, inputs=inputs)


def inputs(batch: dict) -> tuple[Any, Any, Any]:
    """The model's inputs of a batch (`batch_spec`)."""
    return batch["residues"], batch["mask"], batch["separation_prior"]


def build(config: Config) -> Model:
    cfg = evoformer_config(config)
    init_fn, loss_fn = make(cfg)
    module = Evoformer(cfg)
    return Model(name="evoformer", spec=cfg, init_fn=init_fn, loss_fn=loss_fn,
                 batch_spec=lambda batch_size: batch_spec(cfg, batch_size),
                 example_batch=lambda batch_size: example_batch(cfg, batch_size),
                 flops=lambda batch_size: model_flops(cfg, batch_size), tokens_per_example=cfg.crop,
                 step_metrics=("ss_ce", "distogram_ce"),  # the training batch's two losses
                 forward=jax.jit(lambda params, inputs: module.apply({"params": params}, inputs)))

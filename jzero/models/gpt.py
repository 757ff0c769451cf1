"""A GPT decoder (pre-LN, causal attention, learned or rotary positions, optional tied
embeddings) built on `jzero.models.layers.scan_layers`. Params are fp32; the training step casts them
to the compute dtype, so the model itself has no dtype switches.

With a ``moe`` config section every ``expert_interval``-th block's feed-forward is a
Mixture-of-Experts layer (`jzero.models.moe`): the stack scans units of ``expert_interval - 1`` dense
blocks and one MoE block, carrying the MoE statistics beside the hidden state; the loss adds
``aux_loss_coef`` x the aux loss summed over MoE layers (Megatron-DeepSpeed's rule).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from jzero.config import AttentionConfig, Config, ConfigError, ModelConfig, SparseAttentionConfig
from jzero.models import attention, packing, tiles
from jzero.models.adapters import from_linen
from jzero.models.base import Model, Stages, from_section, logits_fn, token_batches
from jzero.models.kvcache import Decoder, Decoding, KVCache
from jzero.models.layers import run_stack, scan_layers
from jzero.models.moe import MoE, MoESpec, MoEStats, spec_from_config
from jzero.zero import modelaxes


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    positions: str = "learned"  # "learned" | "rotary"
    tie_embeddings: bool = True
    remat: str = "full"
    moe: MoESpec | None = None  # the MoE layers' (None: a dense GPT)
    expert_interval: int = 1  # every expert_interval-th block is an MoE block
    aux_loss_coef: float = 0.0
    attention: AttentionConfig = AttentionConfig()
    sparse_attention: SparseAttentionConfig | None = None  # DeepSpeed's section: the layout of every layer
    loss_tile: int = 1024  # tokens per tile of the LM loss (`jzero.models.tiles`); 0: whole logits
    mlp_tile: int = 0  # tokens per tile of each feed-forward (`jzero.models.tiles`); 0: untiled
    qkv_bias: bool = False  # GPT-2's checkpoints have one
    ln_eps: float = 1e-6  # LayerNorm's epsilon (GPT-2: 1e-5)
    positions_len: int = 0  # rows of the learned position table (0: seq_len; GPT-2: n_positions)

    @property
    def moe_layers(self) -> int:
        return 0 if self.moe is None else self.n_layers // self.expert_interval


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=4, d_ff=1024),
    "125m": GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "350m": GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
    "1.3b": GPTConfig(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=32, d_ff=8192),
}


def gpt_config(model: ModelConfig, remat: str = "full", config: Config | None = None) -> GPTConfig:
    """The preset ``model.size`` with the section's other keys overriding it, and the MoE layers
    of ``config``'s ``moe`` section; checked."""
    cfg = from_section(model, SIZES, remat, ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"))
    if cfg.positions == "rotary" and (cfg.d_model // cfg.n_heads) % 2:
        raise ConfigError("jzero.model.positions: rotary needs an even head size (d_model / n_heads)")
    for key in ("loss_tile", "mlp_tile"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"jzero.model.{key}: must be >= 0 (0: untiled), got {getattr(cfg, key)}")
    if config is not None and config.sparse_attention is not None:
        cfg = dataclasses.replace(cfg, sparse_attention=attention.layouts.checked(config, cfg.seq_len))
    spec = None if config is None else spec_from_config(config, cfg.d_model, cfg.d_ff)
    if spec is None:
        return cfg
    interval = config.moe.expert_interval
    if cfg.n_layers % interval:
        raise ConfigError(f"moe.expert_interval: {interval} does not divide jzero.model.n_layers {cfg.n_layers}")
    return dataclasses.replace(cfg, moe=spec, expert_interval=interval, aux_loss_coef=config.moe.aux_loss_coef)


_init = nn.initializers.normal(0.02)


def _rotary(x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on (batch, seq, heads, head_dim); ``positions`` (batch, seq)
    default to 0..seq-1."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    positions = jnp.arange(t)[None] if positions is None else positions
    angles = positions.astype(jnp.float32)[:, :, None] * freqs
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., ::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


class Block(nn.Module):
    """Pre-LN transformer block; ``cfg`` needs n_heads, d_ff and positions (ViT and CLIP reuse it,
    unmasked for images). With ``moe`` its feed-forward is that MoE layer and it maps
    ``(x, stats) -> (x, stats + this layer's)`` (`jzero.models.moe.MoEStats`). Given a
    `jzero.models.kvcache.Decoding` it decodes: it maps ``x -> (x, decoding)``, its layer's new
    keys and values written to the cache and attention over the cached ones. Given ``packed``
    (`jzero.models.packing.Packed`) its documents attend only within themselves, rotary
    positions restarting at each."""

    cfg: Any
    causal: bool = True
    moe: MoESpec | None = None

    @nn.compact
    def __call__(self, x, packed: packing.Packed | None = None, decode: Decoding | None = None):
        cfg, stats = self.cfg, None
        positions = decode.positions if decode is not None else None if packed is None else packed.positions
        if self.moe is not None:
            x, stats = x
        b, t, d = x.shape
        hd = d // cfg.n_heads
        x = modelaxes.residual(x)
        with jax.named_scope("attention"):  # scope names: `jzero profile` attributes FLOPs by them
            eps = getattr(cfg, "ln_eps", 1e-6)
            h = modelaxes.gathered(nn.LayerNorm(epsilon=eps, name="ln1")(x))
            # No qkv bias unless a checkpoint has one (GPT-2): the key bias has an exactly zero
            # gradient (softmax is shift-invariant), so Adam would only amplify rounding noise in
            # it. The kernel is [d, 3, d], so a column split of its last dim over a tensor group
            # gives each device whole heads.
            qkv = nn.DenseGeneral((3, d), use_bias=getattr(cfg, "qkv_bias", False), kernel_init=_init, name="qkv")(h)
            qkv = checkpoint_name(modelaxes.tokens(qkv.reshape(b, t, 3, cfg.n_heads, hd), axis=3), "qkv")
            # split, not indexed: split's transpose is one concatenate, indexing's three pads and
            # adds (+30% on the attention sublayer's step on XLA:CPU); Ulysses moves each on its own
            q, k, v = (modelaxes.tokens(s.squeeze(2)) for s in jnp.split(qkv, 3, axis=2))
            if cfg.positions == "rotary":
                q, k = _rotary(q, positions), _rotary(k, positions)
            if decode is None:
                attn = attention.configured(q, k, v, causal=self.causal, settings=getattr(cfg, "attention", None),
                                            sparse=getattr(cfg, "sparse_attention", None),
                                            segments=None if packed is None else packed.segments)
            else:
                decode = decode.written(k, v)
                keys, values = decode.keys_values()
                attn = attention.configured(q, keys.astype(q.dtype), values.astype(q.dtype), causal=False,
                                            settings=cfg.attention, mask=decode.visible())
            attn = checkpoint_name(attn.reshape(b, t, d), "attn_out")
            x = modelaxes.residual(x + nn.Dense(d, kernel_init=_init, name="proj")(attn))
        with jax.named_scope("mlp"):
            h = modelaxes.gathered(nn.LayerNorm(epsilon=eps, name="ln2")(x))
            if self.moe is not None:
                y, layer = MoE(self.moe, name="moe")(h)
                return x + y, stats + layer
            fc, out = nn.Dense(cfg.d_ff, kernel_init=_init, name="fc"), nn.Dense(d, kernel_init=_init, name="out")
            tile = getattr(cfg, "mlp_tile", 0)
            if tile and b * t > tile:
                x = x + tiles.tiled_mlp(h, tiles.params_of(fc, d, h.dtype),
                                        tiles.params_of(out, cfg.d_ff, h.dtype), tile=tile)
            else:
                x = x + out(checkpoint_name(jax.nn.gelu(modelaxes.hidden(fc(h))), "mlp_hidden"))
            return x if decode is None else (x, decode)


class MoEUnit(nn.Module):
    """``expert_interval - 1`` dense blocks, then one MoE block; maps ``(x, stats)``."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, carry, packed: packing.Packed | None = None):
        x, stats = carry
        for i in range(self.cfg.expert_interval - 1):
            x = Block(self.cfg, name=f"dense_{i}")(x, packed)
        return Block(self.cfg, moe=self.cfg.moe, name="moe_block")((x, stats), packed)


class GPT(nn.Module):
    """Logits (batch, seq, vocab) in fp32; with MoE layers ``(logits, MoEStats summed over them)``.
    Given a `jzero.models.packing.Text` with targets (or a ``(tokens, targets)`` tuple) instead,
    the mean cross entropy in place of the logits, computed ``loss_tile`` tokens at a time
    (`jzero.models.tiles`: full logits never exist), weighted and packed as the Text says.
    `embed` and `output` are its ends on their own: the KV-cached `decoder` runs the blocks
    between them."""

    cfg: GPTConfig

    def setup(self):
        cfg = self.cfg
        self.wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init)
        if cfg.positions == "learned":
            self.wpe = self.param("wpe", _init, (cfg.positions_len or cfg.seq_len, cfg.d_model))
        unit, length = (Block(cfg), cfg.n_layers) if cfg.moe is None else (MoEUnit(cfg), cfg.moe_layers)
        self.blocks = scan_layers(unit, length, remat_policy=cfg.remat)
        self.ln_f = nn.LayerNorm(epsilon=cfg.ln_eps)
        if not cfg.tie_embeddings:
            self.head = nn.Dense(cfg.vocab_size, kernel_init=_init)

    def __call__(self, tokens):
        cfg, text = self.cfg, packing.as_text(tokens)
        shared = () if text.packed is None else (text.packed,)
        x = self.embed(text.tokens, None if text.packed is None else text.packed.positions)
        if cfg.moe is None:
            x = self.blocks(x, *shared)
        else:
            x, stats = self.blocks((x, MoEStats.zeros(x)), *shared)
        out = self.output(x, text.targets, text.weights)
        return out if cfg.moe is None else (out, stats)

    def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Token (and learned position) embeddings; ``positions`` default to 0..seq-1."""
        with jax.named_scope("embedding"):  # scope names: `jzero profile` attributes FLOPs by them
            x = self.wte(tokens)
            if self.cfg.positions == "learned":
                wpe = self.wpe[: tokens.shape[1]] if positions is None else self.wpe[positions]
                x = x + wpe.astype(x.dtype)
            return x

    def output(self, x: jax.Array, targets: jax.Array | None = None, weights: jax.Array | None = None) -> jax.Array:
        """The final LayerNorm and the LM head: fp32 logits, or the tiled loss given targets."""
        with jax.named_scope("head"):
            x = self.ln_f(x)
            head = getattr(self, "head", None)
            if targets is not None:
                return _tiled_loss(self.cfg, x, targets, weights, self.wte, head)
            return (self.wte.attend(x) if head is None else head(x)).astype(jnp.float32)


def _tiled_loss(cfg: GPTConfig, x: jax.Array, targets: jax.Array, weights: jax.Array | None, embed: nn.Embed,
                head: nn.Dense | None):
    """The head's cross entropy, ``cfg.loss_tile`` tokens at a time, on the head's own params
    (the embedding when tied)."""
    with jax.named_scope("loss"):
        if head is None:
            return tiles.tiled_cross_entropy(x, embed.embedding, targets, tied=True, tile=cfg.loss_tile,
                                             weights=weights)
        params = tiles.params_of(head, cfg.d_model, x.dtype)
        return tiles.tiled_cross_entropy(x, params["kernel"], targets, bias=params["bias"], tied=False,
                                         tile=cfg.loss_tile, weights=weights)


def decoder(cfg: GPTConfig) -> Decoder:
    """The GPT's `jzero.models.kvcache.Decoder`: embed, the blocks scanned with the stacked cache
    carried through the loop (each layer writes its new tokens in place), the head. Dense GPTs
    without a sparse layout (the engine checks)."""
    model, block, hd = GPT(cfg), Block(cfg), cfg.d_model // cfg.n_heads

    def forward(params, tokens, positions, cache, fetch=lambda p: p):
        clipped = jnp.minimum(positions, cfg.seq_len - 1)  # the sentinel's embedding is never read
        ends = {"params": fetch({k: v for k, v in params.items() if k != "blocks"})}
        x = model.apply(ends, tokens, clipped, method=GPT.embed)

        def layer(carry, layer_params):
            x, decode = block.apply({"params": fetch(layer_params)}, carry[0], decode=carry[1])
            return (x, decode._replace(layer=decode.layer + 1)), None

        start = Decoding(cache, jnp.int32(0), positions)
        (x, decode), _ = jax.lax.scan(layer, (x, start), params["blocks"]["stacked"])
        return model.apply(ends, x, method=GPT.output), decode.cache

    return Decoder(forward=forward, cache=lambda rows, dtype: KVCache.zeros(cfg.n_layers, rows, cfg.seq_len,
                                                                            cfg.n_heads, hd, dtype),
                   max_len=cfg.seq_len, vocab_size=cfg.vocab_size)


def stages(cfg: GPTConfig) -> Stages:
    """The dense GPT cut for a pipeline: token (and position) embeddings, any run of its
    blocks under its remat policy, the final LayerNorm and head with the model's own loss."""
    model, block = GPT(cfg), Block(cfg)

    def embed(ends, batch):
        return model.apply({"params": ends}, batch["inputs"], batch.get("positions"), method=GPT.embed)

    def layers(stack, x, batch=None):
        return run_stack(lambda p, h, _, *shared: block.apply({"params": p}, h, *shared), x, stack["stacked"], None,
                         cfg.remat, packing.shared_of(batch))

    def head(ends, x, batch):
        targets = batch["targets"] if cfg.loss_tile else None
        return _loss(cfg, model.apply({"params": ends}, x, targets, batch.get("weights"), method=GPT.output), batch)

    return Stages(stack="blocks", block=type(block).__name__, embed=embed, layers=layers, head=head)


def model_flops(cfg: GPTConfig, tokens: int) -> dict[str, float]:
    """Analytic training FLOPs (forward + backward, no recompute) for ``tokens`` tokens:
    6 x matmul params x tokens (the layers' qkv, proj, fc, out and the LM head; the embedding
    lookup is not a matmul) and attention's score and value matmuls, 12 x layers x d_model x
    seq_len per token (the causal mask is not discounted; a sparse layout counts its blocks: x its
    density, the random blocks drawn from ``layout_seed`` as the model draws them). An MoE
    layer counts its gate and the k experts each token reaches (not the dispatch einsums nor
    the empty capacity slots)."""
    d, f, L, M = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.moe_layers
    matmul_params = L * 4 * d * d + (L - M) * 2 * d * f + cfg.vocab_size * d
    if cfg.moe is not None:  # per token: the gate, k experts' MLPs, PR-MoE's MLP and coefficient
        matmul_params += M * (d * cfg.moe.num_experts + cfg.moe.gate.k * 2 * d * f
                              + (2 * d * f + 2 * d if cfg.moe.use_residual else 0))
    dense = 6.0 * matmul_params * tokens
    attention = 12.0 * L * d * cfg.seq_len * tokens * attention_density(cfg)
    return {"dense": dense, "attention": attention, "total": dense + attention}


def attention_density(cfg: GPTConfig) -> float:
    """The fraction of score blocks the GPT's sparse layout visits (1 without one)."""
    if cfg.sparse_attention is None:
        return 1.0
    return attention.layouts.density(attention.layouts.cached(
        cfg.sparse_attention, cfg.n_heads, cfg.seq_len, cfg.attention.layout_seed))


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross entropy, computed in fp32 (of ``weights x`` it, given weights)."""
    with jax.named_scope("loss"):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        return (ce if weights is None else ce * weights.astype(jnp.float32)).mean()


def build(config: Config) -> Model:
    """The reference GPT of ``config`` (``jzero.model`` and ``jzero.remat``) as a `Model`:
    batches are ``{"inputs", "targets"}`` int32 token arrays of shape (batch, seq_len)."""
    return build_from(gpt_config(config.jzero.model, config.jzero.remat, config))


def build_from(cfg: GPTConfig) -> Model:
    """The GPT of ``cfg`` as a `Model` (see `build`)."""
    init_fn, loss_fn = make(cfg)
    batch_spec, example_batch = token_batches(cfg.seq_len, cfg.vocab_size)

    return Model(name="gpt", spec=cfg, init_fn=init_fn, loss_fn=loss_fn, batch_spec=batch_spec,
                 example_batch=example_batch, tokens_per_example=cfg.seq_len,
                 flops=lambda batch_size: model_flops(cfg, batch_size * cfg.seq_len),
                 step_metrics=MOE_METRICS if cfg.moe is not None else (),
                 stages=None if cfg.moe is not None else stages(cfg),
                 decoder=decoder(cfg) if cfg.moe is None and cfg.sparse_attention is None else None,
                 forward=None if cfg.moe is not None else logits_fn(GPT(dataclasses.replace(cfg, loss_tile=0))))


MOE_METRICS = ("lm_loss", "moe_aux_loss", "moe_dropped", "moe_load")


def make(cfg: GPTConfig) -> tuple[Any, Any]:
    """(init_fn, loss_fn) for jzero.init; batches are {"inputs": (B, T), "targets": (B, T)} int32,
    with optional loss weights and packed documents (`jzero.models.packing`). With MoE layers
    the loss is (cross entropy + aux_loss_coef x the aux loss summed over them,
    `MOE_METRICS`: the cross entropy and the per-layer mean aux loss, dropped fraction and load)."""
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    if cfg.loss_tile:  # the model computes the loss, tile by tile, from the inputs and the targets
        return from_linen(GPT(cfg), (tokens, tokens), functools.partial(_loss, cfg), inputs=packing.text_of)
    return from_linen(GPT(cfg), tokens, functools.partial(_loss, cfg),
                      inputs=functools.partial(packing.text_of, targets=False))


def _loss(cfg: GPTConfig, out: Any, batch: dict) -> Any:
    """The model's tiled cross entropy, or the cross entropy of its logits (``loss_tile`` 0)."""
    def ce_of(out):
        return out if cfg.loss_tile else cross_entropy(out, batch["targets"], batch.get("weights"))

    if cfg.moe is None:
        return ce_of(out)
    out, stats = out
    ce = ce_of(out)
    mean = [v / cfg.moe_layers for v in stats]
    return ce + cfg.aux_loss_coef * stats.aux_loss, dict(zip(MOE_METRICS, (ce, *mean), strict=True))

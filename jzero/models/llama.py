"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one decoder on `scan_layers`: RMSNorm
in fp32, SwiGLU, rotary positions (`jzero.models.rope`), grouped-query attention through
`jzero.attention`, and the family's switches: q/k/v biases (Qwen2), per-head q/k RMSNorm
(Qwen3), a ``head_dim`` other than hidden / heads, sliding windows per layer (Mistral, Qwen2),
tied or untied output.

Submodules and params carry Hugging Face's names (``embed_tokens``, ``layers/stacked/self_attn/
q_proj``, ``mlp/gate_proj``, ``input_layernorm``, ``norm``, ``lm_head``), so a checkpoint is a rename
table away (`jzero.runtime.hf`) and AutoTP's name rules split it as they split HF models.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jzero.config import AttentionConfig, Config, ConfigError
from jzero.models import attention, packing, rope, tiles
from jzero.models.adapters import from_linen
from jzero.models.base import Model, Stages, from_section, logits_fn, token_batches
from jzero.models.gpt import cross_entropy
from jzero.models.kvcache import Decoder, Decoding, KVCache
from jzero.models.layers import run_stack, scan_layers
from jzero.zero import modelaxes


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 64  # the longest sequence trained on (HF: max_position_embeddings, unless less)
    d_model: int = 64  # hidden_size
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query: query head h reads kv head h // (n_heads / n_kv_heads)
    head_dim: int = 16
    d_ff: int = 128  # intermediate_size
    rms_eps: float = 1e-6
    rope: rope.RoPE = rope.RoPE()
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before the rotation
    windows: tuple[int, ...] = ()  # per layer: its sliding window (0 = the whole causal past); () none
    tie_embeddings: bool = False
    remat: str = "full"
    attention: AttentionConfig = AttentionConfig()
    loss_tile: int = 1024  # tokens per tile of the LM loss (`jzero.models.tiles`); 0: whole logits


_init = nn.initializers.normal(0.02)


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalized in fp32, cast back, then times the weight."""

    eps: float

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return weight.astype(x.dtype) * h.astype(x.dtype)


def window_mask(t: int, s: int, window: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """``[b or 1, 1, T, S]`` bool: key j is within ``window`` of query i (j > i - window; all
    when window is 0). ``positions`` [b, T]: the queries' absolute positions (decoding)."""
    queries = jnp.arange(t)[None] + (s - t) if positions is None else positions
    return ((window == 0) | (jnp.arange(s)[None, None, :] > queries[:, :, None] - window))[:, None]


class Attention(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, h, window, packed: packing.Packed | None = None, decode: Decoding | None = None):
        cfg = self.cfg
        b, t, _ = h.shape
        dense = functools.partial(nn.Dense, use_bias=cfg.qkv_bias, kernel_init=_init)
        q = dense(cfg.n_heads * cfg.head_dim, name="q_proj")(h).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = dense(cfg.n_kv_heads * cfg.head_dim, name="k_proj")(h).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = dense(cfg.n_kv_heads * cfg.head_dim, name="v_proj")(h).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = RMSNorm(cfg.rms_eps, name="q_norm")(q), RMSNorm(cfg.rms_eps, name="k_norm")(k)
        positions = (decode.positions if decode is not None else jnp.arange(t)[None] if packed is None
                     else packed.positions)
        q, k = rope.apply(q, positions, cfg.rope), rope.apply(k, positions, cfg.rope)
        q, k, v = (checkpoint_name(modelaxes.tokens(x), "qkv") for x in (q, k, v))
        if decode is None:
            mask = None if not cfg.windows else window_mask(t, t, window)
            out = attention.configured(q, k, v, causal=True, settings=cfg.attention, mask=mask,
                                       segments=None if packed is None else packed.segments)
        else:
            decode = decode.written(k, v)
            keys, values = decode.keys_values()
            mask = decode.visible() & window_mask(t, keys.shape[1], window, decode.positions)
            out = attention.configured(q, keys.astype(q.dtype), values.astype(q.dtype), causal=False,
                                       settings=cfg.attention, mask=mask)
        out = checkpoint_name(out.reshape(b, t, cfg.n_heads * cfg.head_dim), "attn_out")
        return nn.Dense(cfg.d_model, use_bias=False, kernel_init=_init, name="o_proj")(out), decode


class MLP(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, h):
        dense = functools.partial(nn.Dense, use_bias=False, kernel_init=_init)
        gate, up = dense(self.cfg.d_ff, name="gate_proj")(h), dense(self.cfg.d_ff, name="up_proj")(h)
        hidden = checkpoint_name(modelaxes.hidden(jax.nn.silu(gate) * up), "mlp_hidden")
        return dense(self.cfg.d_model, name="down_proj")(hidden)


class Block(nn.Module):
    """A decoder layer; ``window`` its sliding window (0: none); ``packed`` documents attend
    within themselves, RoPE restarting at each. Given a `Decoding` it decodes and returns
    ``(x, decoding)``."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, window=0, packed: packing.Packed | None = None, decode: Decoding | None = None):
        cfg = self.cfg
        x = modelaxes.residual(x)
        with jax.named_scope("attention"):  # scope names: `jzero profile` attributes FLOPs by them
            h = modelaxes.gathered(RMSNorm(cfg.rms_eps, name="input_layernorm")(x))
            out, decode = Attention(cfg, name="self_attn")(h, window, packed, decode)
            x = modelaxes.residual(x + out)
        with jax.named_scope("mlp"):
            h = modelaxes.gathered(RMSNorm(cfg.rms_eps, name="post_attention_layernorm")(x))
            x = x + MLP(cfg, name="mlp")(h)
        return x if decode is None else (x, decode)


class Llama(nn.Module):
    """Logits (batch, seq, vocab) in fp32; given a `jzero.models.packing.Text` with targets (or
    ``(tokens, targets)``), the mean cross entropy computed ``loss_tile`` tokens at a time,
    weighted and packed as the Text says. `embed` and `output` are its ends on their own."""

    cfg: LlamaConfig

    def setup(self):
        cfg = self.cfg
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init)
        # every layer gets its window (0: none), so a packed batch's documents follow it positionally
        self.layers = scan_layers(Block(cfg), cfg.n_layers, remat_policy=cfg.remat,
                                  per_layer=cfg.windows or (0,) * cfg.n_layers)
        self.norm = RMSNorm(cfg.rms_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=_init)

    def __call__(self, tokens):
        text = packing.as_text(tokens)
        shared = () if text.packed is None else (text.packed,)
        return self.output(self.layers(self.embed(text.tokens), *shared), text.targets, text.weights)

    def embed(self, tokens: jax.Array) -> jax.Array:
        with jax.named_scope("embedding"):
            return self.embed_tokens(tokens)

    def output(self, x: jax.Array, targets: jax.Array | None = None, weights: jax.Array | None = None) -> jax.Array:
        """The final RMSNorm and the LM head: fp32 logits, or the tiled loss given targets."""
        with jax.named_scope("head"):
            x = self.norm(x)
            head = getattr(self, "lm_head", None)
            if targets is not None:
                with jax.named_scope("loss"):
                    if head is None:
                        return tiles.tiled_cross_entropy(x, self.embed_tokens.embedding, targets, tied=True,
                                                         tile=self.cfg.loss_tile, weights=weights)
                    kernel = tiles.params_of(head, self.cfg.d_model, x.dtype)["kernel"]
                    return tiles.tiled_cross_entropy(x, kernel, targets, tied=False, tile=self.cfg.loss_tile,
                                                     weights=weights)
            return (self.embed_tokens.attend(x) if head is None else head(x)).astype(jnp.float32)


def _windows(cfg: LlamaConfig, layers: int) -> jax.Array:
    return jnp.asarray(cfg.windows[:layers] if cfg.windows else (0,) * layers, jnp.int32)


def stages(cfg: LlamaConfig) -> Stages | None:
    """The cut for a pipeline: embeddings, any run of layers, norm and head. None (no pipeline)
    when layers differ in their windows: a chunk of the stack does not know where it sits."""
    if len(set(cfg.windows)) > 1:
        return None
    model, block = Llama(cfg), Block(cfg)

    def layers(stack, x, batch=None):
        n = jax.tree.leaves(stack)[0].shape[0]
        return run_stack(lambda p, h, w, *shared: block.apply({"params": p}, h, w, *shared), x, stack["stacked"],
                         _windows(cfg, n), cfg.remat, packing.shared_of(batch))

    def head(ends, x, batch):
        targets = batch["targets"] if cfg.loss_tile else None
        return _loss(cfg, model.apply({"params": ends}, x, targets, batch.get("weights"), method=Llama.output),
                     batch)

    return Stages(stack="layers", block=type(block).__name__, layers=layers, head=head,
                  embed=lambda ends, batch: model.apply({"params": ends}, batch["inputs"], method=Llama.embed))


def decoder(cfg: LlamaConfig) -> Decoder:
    """The KV-cached `Decoder` (`jzero.models.kvcache`): each layer writes its new keys and
    values (kv heads only: grouped-query's cache is n_kv_heads wide) and attends within its window."""
    model, block = Llama(cfg), Block(cfg)

    def forward(params, tokens, positions, cache, fetch=lambda p: p):
        ends = {"params": fetch({k: v for k, v in params.items() if k != "layers"})}
        x = model.apply(ends, tokens, method=Llama.embed)

        def layer(carry, xs):
            layer_params, window = xs
            x, decode = block.apply({"params": fetch(layer_params)}, carry[0], window, decode=carry[1])
            return (x, decode._replace(layer=decode.layer + 1)), None

        start = Decoding(cache, jnp.int32(0), positions)
        (x, decode), _ = jax.lax.scan(layer, (x, start), (params["layers"]["stacked"], _windows(cfg, cfg.n_layers)))
        return model.apply(ends, x, method=Llama.output), decode.cache

    return Decoder(forward=forward, cache=lambda rows, dtype: KVCache.zeros(cfg.n_layers, rows, cfg.seq_len,
                                                                            cfg.n_kv_heads, cfg.head_dim, dtype),
                   max_len=cfg.seq_len, vocab_size=cfg.vocab_size)


def model_flops(cfg: LlamaConfig, tokens: int) -> dict[str, float]:
    """Analytic training FLOPs (6 x matmul params x tokens, and attention's two matmuls; windows
    not discounted), as `jzero.models.gpt.model_flops` counts them."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    matmul_params = cfg.n_layers * (2 * d * q + 2 * d * kv + 3 * d * cfg.d_ff) + cfg.vocab_size * d
    dense = 6.0 * matmul_params * tokens
    attn = 12.0 * cfg.n_layers * q * cfg.seq_len * tokens
    return {"dense": dense, "attention": attn, "total": dense + attn}


def make(cfg: LlamaConfig) -> tuple[Any, Any]:
    """(init_fn, loss_fn) for jzero.init; batches are {"inputs", "targets"} int32 (B, T), with
    optional loss weights and packed documents (`jzero.models.packing`)."""
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    if cfg.loss_tile:
        return from_linen(Llama(cfg), (tokens, tokens), functools.partial(_loss, cfg), inputs=packing.text_of)
    return from_linen(Llama(cfg), tokens, functools.partial(_loss, cfg),
                      inputs=functools.partial(packing.text_of, targets=False))


def _loss(cfg: LlamaConfig, out: Any, batch: dict) -> Any:
    return out if cfg.loss_tile else cross_entropy(out, batch["targets"], batch.get("weights"))


def check(cfg: LlamaConfig) -> LlamaConfig:
    """``cfg``, or a ConfigError naming the field that cannot work."""
    if cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(f"num_key_value_heads: {cfg.n_kv_heads} does not divide num_attention_heads {cfg.n_heads}")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim: rotary positions need an even head size, got {cfg.head_dim}")
    if cfg.rope.type not in rope.TYPES:
        raise ConfigError(f"rope_type: '{cfg.rope.type}' is not supported; supported: {', '.join(rope.TYPES)}")
    if cfg.windows and len(cfg.windows) != cfg.n_layers:
        raise ConfigError(f"layer_types: {len(cfg.windows)} layers for num_hidden_layers {cfg.n_layers}")
    return cfg


def build_from(cfg: LlamaConfig) -> Model:
    """A `Model` of ``cfg`` (checked): batches are {"inputs", "targets"} int32 (batch, seq_len)."""
    cfg = check(cfg)
    init_fn, loss_fn = make(cfg)
    batch_spec, example_batch = token_batches(cfg.seq_len, cfg.vocab_size)

    return Model(name="llama", spec=cfg, init_fn=init_fn, loss_fn=loss_fn, batch_spec=batch_spec,
                 example_batch=example_batch, tokens_per_example=cfg.seq_len,
                 flops=lambda batch_size: model_flops(cfg, batch_size * cfg.seq_len), stages=stages(cfg),
                 decoder=decoder(cfg), forward=logits_fn(Llama(dataclasses.replace(cfg, loss_tile=0))))


SIZES: dict[str, LlamaConfig] = {"tiny": LlamaConfig()}


def build(config: Config) -> Model:
    """The preset ``jzero.model.size`` (a Hugging Face directory's shape comes through
    `jzero.models.build` instead), the section's other keys overriding it."""
    return build_from(from_section(config.jzero.model, SIZES, config.jzero.remat,
                                   ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff")))

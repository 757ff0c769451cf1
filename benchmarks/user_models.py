"""The models a user brings, for the overhead benchmark: a GPT written as plain JAX functions (a
Python loop over layers, no `jzero.scan_layers`) and the same GPT as a Flax Linen module (through
`jzero.from_linen`), beside jzero's reference GPT. Same batch for all three: ``{"inputs",
"targets"}`` of int32 tokens (vocab 256), the mean next-token cross-entropy as the loss.

    init_fn, loss_fn = make("plain", vocab_size=256, seq_len=128, d_model=512, n_layers=8, n_heads=8, d_ff=2048)
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def _attention(x: jax.Array, p: dict, n_heads: int) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, n_heads, d // n_heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // n_heads).astype(x.dtype)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    return out @ p["proj"]


def _block(x: jax.Array, p: dict, n_heads: int) -> jax.Array:
    x = x + _attention(_layer_norm(x, p["ln1_scale"], p["ln1_bias"]), p, n_heads)
    h = jax.nn.gelu(_layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["fc"])
    return x + h @ p["fc_out"]


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def plain(vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int
          ) -> tuple[Callable, Callable]:
    """(init_fn, loss_fn) of a GPT in plain JAX: params a dict of dicts, one entry per layer."""
    def init_fn(rng: jax.Array) -> dict:
        keys = iter(jax.random.split(rng, 4 * n_layers + 3))

        def dense(m: int, n: int) -> jax.Array:
            return jax.random.normal(next(keys), (m, n)) * 0.02

        layers = {f"layer_{i}": {"qkv": dense(d_model, 3 * d_model), "proj": dense(d_model, d_model),
                                 "fc": dense(d_model, d_ff), "fc_out": dense(d_ff, d_model),
                                 "ln1_scale": jnp.ones(d_model), "ln1_bias": jnp.zeros(d_model),
                                 "ln2_scale": jnp.ones(d_model), "ln2_bias": jnp.zeros(d_model)}
                  for i in range(n_layers)}
        return {"embed": dense(vocab_size, d_model), "pos": dense(seq_len, d_model), **layers,
                "ln_f_scale": jnp.ones(d_model), "ln_f_bias": jnp.zeros(d_model)}

    def loss_fn(params: dict, batch: dict, rng: jax.Array) -> jax.Array:
        x = params["embed"][batch["inputs"]] + params["pos"][: batch["inputs"].shape[1]]
        for i in range(n_layers):
            x = _block(x, params[f"layer_{i}"], n_heads)
        x = _layer_norm(x, params["ln_f_scale"], params["ln_f_bias"])
        return _cross_entropy(x @ params["embed"].T, batch["targets"])

    return init_fn, loss_fn


def linen(vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int
          ) -> tuple[Callable, Callable]:
    """(init_fn, loss_fn) of the same GPT as a Flax Linen module, through `jzero.from_linen`."""
    import flax.linen as nn

    import jzero

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            y = nn.LayerNorm(epsilon=1e-5)(x)
            y = nn.MultiHeadDotProductAttention(num_heads=n_heads, use_bias=False)(
                y, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + y
            y = nn.Dense(d_ff, use_bias=False)(nn.LayerNorm(epsilon=1e-5)(x))
            return x + nn.Dense(d_model, use_bias=False)(jax.nn.gelu(y))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            embed = nn.Embed(vocab_size, d_model, embedding_init=nn.initializers.normal(0.02))
            pos = self.param("pos", nn.initializers.normal(0.02), (seq_len, d_model))
            x = embed(tokens) + pos[: tokens.shape[1]]
            for _ in range(n_layers):
                x = Block()(x)
            return embed.attend(nn.LayerNorm(epsilon=1e-5)(x))

    sample = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jzero.from_linen(GPT(), sample, lambda logits, batch: _cross_entropy(logits, batch["targets"]),
                            mode_arg=None)


def reference(vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int
              ) -> tuple[Callable, Callable]:
    """jzero's reference GPT (its layers scanned)."""
    from jzero.models import gpt

    return gpt.make(gpt.GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layers=n_layers,
                                  n_heads=n_heads, d_ff=d_ff))


MODELS: dict[str, Callable[..., tuple[Callable, Callable]]] = {"gpt": reference, "plain": plain, "linen": linen}


def make(name: str, **shape: int) -> tuple[Callable, Callable]:
    return MODELS[name](**shape)

"""Generation by the full forward: every new token re-runs the model over the whole window, no
KV cache. The reference the cached engine must equal token for token (issue 34), and the
end-of-training sample until that engine lands. One request, one key: token ``i`` is drawn with
``fold_in(rng, i)`` (`sampling.sample`).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jzero.inference import sampling
from jzero.models.gpt import GPT, GPTConfig
from jzero.zero import phase

PREVIEW = sampling.SamplingParams(temperature=0.8)  # the end-of-training sample's


def generate(cfg: GPTConfig, params: Any, prompt: jax.Array, num_tokens: int, rng: jax.Array,
             settings: sampling.SamplingParams = PREVIEW) -> jax.Array:
    """``num_tokens`` new tokens after ``prompt`` (1-D int32, shorter than seq_len); a sliding
    window of ``seq_len`` tokens once the context is full."""
    temperature, top_k, top_p = sampling.as_arrays([settings])
    return _generate(cfg, params, prompt, rng, (temperature, top_k, top_p), num_tokens)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _generate(cfg, params, prompt, rng, settings, num_tokens):
    model = GPT(cfg)
    window = jnp.zeros((1, cfg.seq_len), jnp.int32).at[0, : prompt.shape[0]].set(prompt)

    def body(i, carry):
        window, length, out = carry
        with phase.evaluating():
            logits = model.apply({"params": params}, window)
        logits = (logits if cfg.moe is None else logits[0])[:, length - 1]
        token = sampling.sample(logits, jax.random.fold_in(rng, i)[None], *settings)[0]
        full = length == cfg.seq_len
        window = jnp.where(full, jnp.roll(window, -1, axis=1).at[0, -1].set(token),
                           window.at[0, jnp.minimum(length, cfg.seq_len - 1)].set(token))
        return window, jnp.minimum(length + 1, cfg.seq_len), out.at[i].set(token)

    init = (window, jnp.int32(prompt.shape[0]), jnp.zeros((num_tokens,), jnp.int32))
    return jax.lax.fori_loop(0, num_tokens, body, init)[2]

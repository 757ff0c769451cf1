"""A CLIP-style two-tower model (Radford et al.): a ViT image tower and a byte-level text
transformer, each projected to a shared embedding and L2-normalised, a learned temperature, and
the symmetric cross-entropy over the *global* batch: each device's embeddings are gathered over
the data axes (`jzero.gather_rows`, as big_vision does), so every example has every other
example of the step as a negative, however the batch is split over devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero.config import AttentionConfig, Config, ConfigError
from jzero.models import vit
from jzero.models.adapters import from_linen
from jzero.models.base import Model, from_section
from jzero.models.gpt import Block
from jzero.models.layers import scan_layers
from jzero.zero.rows import gather_rows, row_offset

_init = nn.initializers.normal(0.02)


@dataclass(frozen=True)
class CLIPConfig:
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    pool: str = "cls"
    n_layers: int = 2  # image tower
    text_len: int = 32  # caption bytes (0 pads)
    text_layers: int = 2
    d_model: int = 64  # both towers
    n_heads: int = 4
    d_ff: int = 256
    embed_dim: int = 64
    positions: str = "learned"
    remat: str = "full"
    attention: AttentionConfig = AttentionConfig()

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# CLIP ViT-B/16: image tower ViT-B/16, text tower 12 x 512 (here: the image width), 512-d embedding.
SIZES: dict[str, CLIPConfig] = {
    "tiny": CLIPConfig(),
    "b16": CLIPConfig(image_size=224, patch_size=16, channels=3, n_layers=12, text_len=77, text_layers=12,
                      d_model=768, n_heads=12, d_ff=3072, embed_dim=512),
}
POSITIVE = ("image_size", "patch_size", "channels", "n_layers", "text_len", "text_layers", "d_model", "n_heads",
            "d_ff", "embed_dim")
VOCAB = 256  # bytes


def clip_config(config: Config) -> CLIPConfig:
    cfg = from_section(config.jzero.model, SIZES, config.jzero.remat, POSITIVE)
    if cfg.image_size % cfg.patch_size:
        raise ConfigError(f"jzero.model.patch_size: {cfg.patch_size} does not divide image_size {cfg.image_size}")
    return cfg


@dataclass(frozen=True)
class _TextTower:
    n_layers: int
    n_heads: int
    d_ff: int
    d_model: int
    positions: str
    remat: str
    attention: AttentionConfig


def _text_tower(cfg: CLIPConfig) -> _TextTower:
    return _TextTower(cfg.text_layers, cfg.n_heads, cfg.d_ff, cfg.d_model, cfg.positions, cfg.remat,
                      cfg.attention)


class TextEncoder(nn.Module):
    """Byte captions (batch, text_len), 0 = padding -> features (batch, d_model): a causal
    transformer read at each caption's last byte (its end, as CLIP reads its EOT token)."""

    cfg: CLIPConfig

    @nn.compact
    def __call__(self, texts):
        cfg = self.cfg
        x = nn.Embed(VOCAB, cfg.d_model, embedding_init=_init, name="wte")(texts)
        x = x + self.param("wpe", _init, (cfg.text_len, cfg.d_model)).astype(x.dtype)
        x = scan_layers(Block(_text_tower(cfg), causal=True), cfg.text_layers, remat_policy=cfg.remat, name="blocks")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        last = jnp.maximum(jnp.sum(texts != 0, axis=1) - 1, 0)
        return jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]


def _normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-12)


class CLIP(nn.Module):
    cfg: CLIPConfig

    def setup(self):
        cfg = self.cfg
        self.image_tower = vit.ViTEncoder(cfg)
        self.image_proj = nn.Dense(cfg.embed_dim, use_bias=False, kernel_init=_init)
        self.text_tower = TextEncoder(cfg)
        self.text_proj = nn.Dense(cfg.embed_dim, use_bias=False, kernel_init=_init)
        self.logit_scale = self.param("logit_scale", nn.initializers.constant(math.log(1 / 0.07)), ())

    def encode_image(self, images):
        return _normalize(self.image_proj(self.image_tower(images)))

    def encode_text(self, texts):
        return _normalize(self.text_proj(self.text_tower(texts)))

    def __call__(self, inputs):
        images, texts = inputs
        scale = jnp.exp(jnp.minimum(self.logit_scale.astype(jnp.float32), math.log(100.0)))
        return self.encode_image(images), self.encode_text(texts), scale


def contrastive_loss(outputs: tuple[jax.Array, jax.Array, jax.Array], batch: Any) -> jax.Array:
    """Symmetric InfoNCE of this device's rows against every row of the global batch."""
    img, txt, scale = outputs
    with jax.named_scope("loss"):
        labels = row_offset(img.shape[0]) + jnp.arange(img.shape[0])
        per_image = optax.softmax_cross_entropy_with_integer_labels(scale * img @ gather_rows(txt).T, labels)
        per_text = optax.softmax_cross_entropy_with_integer_labels(scale * txt @ gather_rows(img).T, labels)
        return 0.5 * (per_image.mean() + per_text.mean())


def batch_spec(cfg: CLIPConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"images": vit.image_spec(cfg, batch_size),
            "texts": jax.ShapeDtypeStruct((batch_size, cfg.text_len), jnp.int32)}


def make(cfg: CLIPConfig) -> tuple[Any, Any]:
    """(init_fn, loss_fn); batches are {"images": (B, H, W, C) float32, "texts": (B, text_len) int32}."""
    spec = batch_spec(cfg, 1)
    return from_linen(CLIP(cfg), (spec["images"], spec["texts"]), contrastive_loss,
                      inputs=lambda batch: (batch["images"], batch["texts"]))


def model_flops(cfg: CLIPConfig, batch: int) -> dict[str, float]:
    """Both towers (`vit.tower_flops`) with their projections, and the two logit matmuls."""
    patch = cfg.patch_size ** 2 * cfg.channels * cfg.d_model
    img_dense, img_attn = vit.tower_flops(cfg, batch, vit.tokens_per_example(cfg), patch + cfg.d_model * cfg.embed_dim)
    txt_dense, txt_attn = vit.tower_flops(_text_tower(cfg), batch, cfg.text_len, cfg.d_model * cfg.embed_dim)
    dense = img_dense + txt_dense + 2 * 6.0 * cfg.embed_dim * batch * batch
    return {"dense": dense, "attention": img_attn + txt_attn, "total": dense + img_attn + txt_attn}


def build(config: Config) -> Model:
    cfg = clip_config(config)
    init_fn, loss_fn = make(cfg)

    def example_batch(batch_size: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        return {"images": rng.random(vit.image_spec(cfg, batch_size).shape, np.float32),
                "texts": rng.integers(1, VOCAB, (batch_size, cfg.text_len)).astype(np.int32)}

    return Model(name="clip", spec=cfg, init_fn=init_fn, loss_fn=loss_fn,
                 batch_spec=lambda batch_size: batch_spec(cfg, batch_size), example_batch=example_batch,
                 tokens_per_example=vit.tokens_per_example(cfg) + cfg.text_len,
                 flops=lambda batch_size: model_flops(cfg, batch_size))

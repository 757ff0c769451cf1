"""A Vision Transformer (Dosovitskiy et al.): square images cut into patches by a strided
convolution, a class token (or mean pooling), learned positions, pre-LN blocks on
`jzero.models.layers.scan_layers` (the GPT's block, unmasked), a final LayerNorm and a linear head.
``ViTEncoder`` is the image tower CLIP reuses.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero.config import AttentionConfig, Config, ConfigError
from jzero.models.adapters import from_linen
from jzero.models.base import Model, from_section
from jzero.models.gpt import Block
from jzero.models.layers import scan_layers

_init = nn.initializers.normal(0.02)


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    pool: str = "cls"  # "cls" | "mean"
    positions: str = "learned"
    remat: str = "full"
    attention: AttentionConfig = AttentionConfig()

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# ViT-B/16 as in Dosovitskiy et al. (86M params at 224x224, 1000 classes).
SIZES: dict[str, ViTConfig] = {
    "tiny": ViTConfig(),
    "small": ViTConfig(d_model=128, n_layers=4, n_heads=4, d_ff=512),
    "b16": ViTConfig(image_size=224, patch_size=16, channels=3, num_classes=1000, d_model=768, n_layers=12,
                     n_heads=12, d_ff=3072),
}
POSITIVE = ("image_size", "patch_size", "channels", "num_classes", "d_model", "n_layers", "n_heads", "d_ff")


def vit_config(config: Config) -> ViTConfig:
    cfg = from_section(config.jzero.model, SIZES, config.jzero.remat, POSITIVE)
    if cfg.image_size % cfg.patch_size:
        raise ConfigError(f"jzero.model.patch_size: {cfg.patch_size} does not divide image_size {cfg.image_size}")
    return cfg


class ViTEncoder(nn.Module):
    """Images (batch, size, size, channels) -> pooled features (batch, d_model)."""

    cfg: Any

    @nn.compact
    def __call__(self, images):
        cfg = self.cfg
        with jax.named_scope("embedding"):
            p = cfg.patch_size
            x = nn.Conv(cfg.d_model, (p, p), strides=(p, p), padding="VALID", kernel_init=_init, name="patch")(images)
            x = x.reshape(x.shape[0], -1, cfg.d_model)
            if cfg.pool == "cls":
                cls = self.param("cls", nn.initializers.zeros, (1, 1, cfg.d_model)).astype(x.dtype)
                x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, cfg.d_model)), x], axis=1)
            x = x + self.param("pos", _init, (x.shape[1], cfg.d_model)).astype(x.dtype)
        x = scan_layers(Block(cfg, causal=False), cfg.n_layers, remat_policy=cfg.remat, name="blocks")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return x[:, 0] if cfg.pool == "cls" else x.mean(axis=1)


class ViT(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, images):
        x = ViTEncoder(self.cfg, name="encoder")(images)
        with jax.named_scope("head"):
            return nn.Dense(self.cfg.num_classes, kernel_init=nn.initializers.zeros, name="head")(x).astype(jnp.float32)


def tower_flops(cfg: Any, examples: int, seq: int, extra_params: int = 0) -> tuple[float, float]:
    """(dense, attention) training FLOPs of a transformer tower over ``examples`` sequences of
    ``seq`` tokens: 6 x matmul params x tokens, attention 12 x layers x d_model x seq per token."""
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    tokens = examples * seq
    dense = 6.0 * (L * (4 * d * d + 2 * d * f) + extra_params) * tokens
    return dense, 12.0 * L * d * seq * tokens


def tokens_per_example(cfg: ViTConfig) -> int:
    return cfg.num_patches + (cfg.pool == "cls")


def model_flops(cfg: ViTConfig, batch: int) -> dict[str, float]:
    patch = cfg.patch_size ** 2 * cfg.channels * cfg.d_model
    dense, attention = tower_flops(cfg, batch, tokens_per_example(cfg), patch)
    head = 6.0 * cfg.d_model * cfg.num_classes * batch
    return {"dense": dense + head, "attention": attention, "total": dense + head + attention}


def image_spec(cfg: Any, batch_size: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((batch_size, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32)


def classifier(module: nn.Module, cfg: Any) -> tuple[Any, Any]:
    """(init_fn, loss_fn) of a Linen ``module`` mapping images to class logits; batches are
    {"images": (B, H, W, C) float32, "labels": (B,) int32}."""
    def loss(logits, batch):
        with jax.named_scope("loss"):
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return from_linen(module, image_spec(cfg, 1), loss, inputs=lambda batch: batch["images"])


def classification_spec(cfg: Any, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"images": image_spec(cfg, batch_size), "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}


def example_images(cfg: Any, batch_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"images": rng.random(image_spec(cfg, batch_size).shape, np.float32),
            "labels": rng.integers(0, cfg.num_classes, batch_size).astype(np.int32)}


def make(cfg: ViTConfig) -> tuple[Any, Any]:
    return classifier(ViT(cfg), cfg)


def classification_model(name: str, cfg: Any, module: nn.Module, tokens_per_example: int,
                         flops: Callable[[int], dict[str, float]]) -> Model:
    """The `Model` of any Linen ``module`` mapping images to class logits (the ViT, the MLP),
    on the classification task's batches."""
    init_fn, loss_fn = classifier(module, cfg)
    return Model(name=name, spec=cfg, init_fn=init_fn, loss_fn=loss_fn,
                 batch_spec=lambda batch_size: classification_spec(cfg, batch_size),
                 example_batch=lambda batch_size: example_images(cfg, batch_size),
                 tokens_per_example=tokens_per_example, flops=flops,
                 forward=jax.jit(lambda params, x: module.apply({"params": params}, x)))


def build(config: Config) -> Model:
    cfg = vit_config(config)
    return classification_model("vit", cfg, ViT(cfg), tokens_per_example(cfg),
                                lambda batch_size: model_flops(cfg, batch_size))

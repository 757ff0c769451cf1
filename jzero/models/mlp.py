"""A plain MLP classifier: images flattened, a linear embedding to ``d_model``, ``n_layers``
residual blocks (LayerNorm, Dense d_model -> d_ff, GELU, Dense back) on
`jzero.models.layers.scan_layers`, a final LayerNorm and a linear head. The smallest model every
ZeRO stage, the lr finder and the tests can train on the digits in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jzero.config import Config
from jzero.models import vit
from jzero.models.base import Model, from_section
from jzero.models.layers import scan_layers

_init = nn.initializers.normal(0.02)


@dataclass(frozen=True)
class MLPConfig:
    image_size: int = 8
    channels: int = 1
    num_classes: int = 10
    d_model: int = 128
    n_layers: int = 2
    d_ff: int = 256
    remat: str = "full"


SIZES: dict[str, MLPConfig] = {"tiny": MLPConfig(), "small": MLPConfig(d_model=256, n_layers=4, d_ff=1024)}
POSITIVE = ("image_size", "channels", "num_classes", "d_model", "n_layers", "d_ff")


class Residual(nn.Module):
    cfg: MLPConfig

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.cfg.d_ff, kernel_init=_init, name="up")(nn.LayerNorm(name="ln")(x))
        return x + nn.Dense(self.cfg.d_model, kernel_init=_init, name="down")(nn.gelu(h))


class MLP(nn.Module):
    cfg: MLPConfig

    @nn.compact
    def __call__(self, images):
        cfg = self.cfg
        x = nn.Dense(cfg.d_model, kernel_init=_init, name="embed")(images.reshape(images.shape[0], -1))
        x = scan_layers(Residual(cfg), cfg.n_layers, remat_policy=cfg.remat, name="blocks")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(cfg.num_classes, kernel_init=nn.initializers.zeros, name="head")(x).astype(jnp.float32)


def model_flops(cfg: MLPConfig, batch: int) -> dict[str, float]:
    pixels = cfg.image_size ** 2 * cfg.channels
    dense = 6.0 * (pixels * cfg.d_model + cfg.n_layers * 2 * cfg.d_model * cfg.d_ff
                   + cfg.d_model * cfg.num_classes) * batch
    return {"dense": dense, "total": dense}


def build(config: Config) -> Model:
    """{"images": (B, H, W, C) float32, "labels": (B,) int32} batches, as the ViT's."""
    cfg = from_section(config.jzero.model, SIZES, config.jzero.remat, POSITIVE)
    return vit.classification_model("mlp", cfg, MLP(cfg), 1, lambda batch_size: model_flops(cfg, batch_size))


def make(cfg: MLPConfig) -> tuple[Any, Any]:
    """(init_fn, loss_fn) over the ViT's batches."""
    return vit.classifier(MLP(cfg), cfg)

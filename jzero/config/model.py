"""The ``jzero.model`` section: which reference model the CLI builds and its settings. Schema
only; each model (`jzero.models`) reads the keys its presets have and refuses the others."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jzero.config.attention import AttentionConfig


@dataclass(frozen=True)
class ModelConfig:
    """Reference model for the CLI. ``size`` picks a preset; other keys override it (each model
    takes the keys its preset has)."""

    name: str = "gpt"  # a key of jzero.models.MODELS
    hf: str | None = None  # a Hugging Face model directory: the model (name, shape), weights and tokenizer
    size: str = "tiny"
    vocab_size: int | None = None
    seq_len: int | None = None
    d_model: int | None = None
    n_layers: int | None = None  # evoformer: its blocks
    n_heads: int | None = None
    d_ff: int | None = None
    positions: Literal["learned", "rotary"] | None = None
    tie_embeddings: bool | None = None
    image_size: int | None = None  # vit, clip: square images of this many pixels a side
    patch_size: int | None = None
    channels: int | None = None
    num_classes: int | None = None  # vit, mlp
    pool: Literal["cls", "mean"] | None = None
    embed_dim: int | None = None  # clip: the shared image-text embedding
    text_len: int | None = None  # clip: caption length in bytes
    text_layers: int | None = None
    attention: AttentionConfig | None = None  # gpt, vit, clip, evoformer
    loss_tile: int | None = None  # gpt: tokens per tile of the loss, 0 = whole logits
    mlp_tile: int | None = None  # gpt: tokens per tile of each feed-forward, 0 = untiled
    crop: int | None = None  # evoformer: residues per example
    n_seq: int | None = None  # evoformer: MSA depth (1: the single sequence)
    c_m: int | None = None  # evoformer: MSA channels
    c_z: int | None = None  # evoformer: pair channels
    msa_heads: int | None = None
    msa_head_dim: int | None = None
    pair_heads: int | None = None
    pair_head_dim: int | None = None
    c_opm: int | None = None  # evoformer: outer product mean's hidden channels
    c_tri: int | None = None  # evoformer: triangle multiplication's hidden channels
    transition: int | None = None  # evoformer: transition width factor
    relpos: int | None = None  # evoformer: relative positions clipped to +-relpos

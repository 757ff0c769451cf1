"""The attention sections: ``jzero.model.attention`` (which implementation, its blocks) and
DeepSpeed's ``sparse_attention`` (the block layout). Schema only; `jzero.models.attention`
checks and uses them. Imports no jzero module."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AttentionConfig:
    """``jzero.model.attention``: which `jzero.attention` implementation the reference models call
    ("auto": cuDNN on a GPU where it applies, else blockwise from ``blockwise_from`` tokens up,
    naive below) and the blockwise query / key block sizes; ``layout_seed`` draws the random
    blocks of a ``sparse_attention`` layout (the same on every device and every restart)."""

    implementation: Literal["auto", "naive", "blockwise", "cudnn"] = "auto"
    block_q: int = 512
    block_k: int = 512
    blockwise_from: int = 256
    layout_seed: int = 0


@dataclass(frozen=True)
class SparseAttentionConfig:
    """``sparse_attention``: DeepSpeed Sparse Attention's block layout, its keys and its config
    parser's defaults (``deepspeed/runtime/config.py``). Checked, and built into a layout, by
    `jzero.models.attention.layouts`."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    block: int = 16
    different_layout_per_head: bool = False
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1
    num_random_blocks: int = 0
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: tuple[int, ...] | None = None
    num_sliding_window_blocks: int = 3

"""DeepSpeed Sparse Attention's block layouts, built as DeepSpeed builds them.

`make_layout(section, num_heads, seq_len)` gives the int ``[heads, blocks, blocks]`` layout of
``deepspeed/ops/sparse_attention/sparsity_config.py`` (``SparsityConfig.make_layout``) for the
ds_config ``sparse_attention`` section: 1 where a block of queries attends a block of keys.
Each mode is a list of named layers (local windows, globals, random blocks, a sliding window)
set in DeepSpeed's order, so the random blocks (Python's ``random.sample``, the same calls in the
same order from a ``random.Random(seed)``) equal DeepSpeed's after ``random.seed(seed)``.
tests/golden/sparse/layouts.json holds DeepSpeed 0.19.6's own layouts (recorded by
tests/golden/sparse/record.py; DeepSpeed removed Sparse Attention after 0.19.6).

DeepSpeed's kernels are Triton and GPU-only; these layouts drive `jzero.models.attention.blockwise`,
which visits only the blocks set here, on every backend.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from jzero.config import Config, ConfigError, SparseAttentionConfig

# The keys each mode reads (DeepSpeed's `get_sparse_*_config`, plus ``attention`` for the two
# modes whose classes take it but whose config parser drops it); the others are refused.
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": ("block",),
    "fixed": ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
              "horizontal_global_attention", "num_different_global_patterns"),
    "variable": ("block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                 "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                "num_global_blocks", "attention"),
    "bslongformer": ("block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices", "attention"),
}


def _fixed_local(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    n = lay.shape[1]
    for i in range(0, n, s.num_local_blocks):
        end = min(i + s.num_local_blocks, n)
        for row in range(i, end):
            lay[h, row, i:(row + 1 if s.attention == "unidirectional" else end)] = 1


def _fixed_global(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    n, g = lay.shape[1], s.num_global_blocks
    first = s.num_local_blocks - (1 + h % s.num_different_global_patterns) * g
    end = n - (n % s.num_local_blocks)
    starts = list(range(first, end, s.num_local_blocks))
    if end < n:  # a short last local window: its global blocks, kept inside the sequence
        starts.append(min(end + first, n - g))
    for i in starts:
        lay[h, 0 if s.attention == "bidirectional" else i:, i:i + g] = 1
        if s.horizontal_global_attention:
            lay[h, i:i + g, :] = 1


def _random(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    n = lay.shape[1]
    if n < s.num_random_blocks:
        raise ConfigError(f"sparse_attention.num_random_blocks: {s.num_random_blocks} is more than the "
                          f"{n} blocks in a row")
    causal = s.mode == "bigbird" and s.attention == "unidirectional"
    for row in range(n):
        lay[h, row, rng.sample(range(0, row + 1 if causal else n), s.num_random_blocks)] = 1


def _variable_local(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    n, start = lay.shape[1], 0
    windows = list(s.local_window_blocks)
    while start < n:  # the last window size repeats over the rest of the sequence
        size = windows.pop(0) if windows else s.local_window_blocks[-1]
        end = min(start + size, n)
        for row in range(start, end):
            lay[h, row, start:(row + 1 if s.attention == "unidirectional" else end)] = 1
        start += size


def _global_indices(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    n = lay.shape[1]
    ends = s.global_block_end_indices or [i + 1 for i in s.global_block_indices]
    for start, end in zip(s.global_block_indices, ends, strict=True):
        if start >= n:
            continue
        end = min(end, n)
        if s.horizontal_global_attention or s.mode == "bslongformer":
            lay[h, start:end, :] = 1
        first = 0 if s.attention == "bidirectional" or s.mode == "bslongformer" else start
        lay[h, first:, start:end] = 1


def _sliding(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    n, w = lay.shape[1], s.num_sliding_window_blocks // 2
    if n < s.num_sliding_window_blocks:
        raise ConfigError(f"sparse_attention.num_sliding_window_blocks: {s.num_sliding_window_blocks} is more "
                          f"than the {n} blocks in a row")
    for row in range(n):
        lay[h, row, max(0, row - w):min(row + w + 1, n)] = 1


def _bigbird_global(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    if lay.shape[1] < s.num_global_blocks:
        raise ConfigError(f"sparse_attention.num_global_blocks: {s.num_global_blocks} is more than the "
                          f"{lay.shape[1]} blocks in a row")
    lay[h, :s.num_global_blocks, :] = 1
    lay[h, :, :s.num_global_blocks] = 1


def _dense(s: SparseAttentionConfig, h: int, lay: np.ndarray, rng: random.Random) -> None:
    lay[h] = 1


Part = Callable[[SparseAttentionConfig, int, np.ndarray, random.Random], None]

# Each mode's parts in DeepSpeed's order; "tril" modes then drop every block above the diagonal
# under unidirectional attention (DeepSpeed's ``torch.tril``).
MODES: dict[str, tuple[tuple[Part, ...], bool]] = {
    "dense": ((_dense,), False),
    "fixed": ((_fixed_local, _fixed_global), False),
    "variable": ((_random, _variable_local, _global_indices), False),
    "bigbird": ((_random, _sliding, _bigbird_global), True),
    "bslongformer": ((_sliding, _global_indices), True),
}


def make_layout(section: SparseAttentionConfig, num_heads: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """DeepSpeed's ``make_layout(seq_len)`` for ``section`` with ``num_heads`` heads: int64
    ``[num_heads, seq_len // block, seq_len // block]``; random blocks drawn from
    ``random.Random(seed)``."""
    check(section)
    if seq_len % section.block:
        raise ConfigError(f"sparse_attention.block: the sequence length {seq_len} is not a multiple of the "
                          f"block {section.block}")
    n = seq_len // section.block
    lay = np.zeros((num_heads, n, n), np.int64)
    parts, tril = MODES[section.mode]
    rng = random.Random(seed)
    for h in range(num_heads if section.different_layout_per_head else 1):
        for part in parts:
            part(section, h, lay, rng)
        if tril and section.attention == "unidirectional":
            lay[h] = np.tril(lay[h])
    if not section.different_layout_per_head:
        lay[1:] = lay[0]
    return lay


@functools.lru_cache(maxsize=64)
def cached(section: SparseAttentionConfig, num_heads: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """`make_layout`, built once per (section, heads, length, seed) and read-only."""
    lay = make_layout(section, num_heads, seq_len, seed)
    lay.setflags(write=False)
    return lay


def checked(config: Config, seq_len: int) -> SparseAttentionConfig:
    """``config``'s ``sparse_attention`` section, checked (`check`, and against the raw keys given:
    one its mode does not read is refused) for a model of ``seq_len`` tokens."""
    section = config.sparse_attention
    raw = config.source.get("sparse_attention", {})
    extra = sorted(set(raw) - {"mode", *MODE_KEYS[section.mode]})
    if extra:
        raise ConfigError(f"sparse_attention.{extra[0]}: not a key of mode {section.mode!r} (its keys: "
                          f"{', '.join(MODE_KEYS[section.mode])})")
    check(section)
    if seq_len % section.block:
        raise ConfigError(f"sparse_attention.block: {section.block} does not divide the sequence length {seq_len}")
    return section


def check(section: SparseAttentionConfig) -> None:
    """ConfigError naming the key where ``section`` breaks one of DeepSpeed's own rules."""
    for rule, message in _rules(section):
        if rule:
            raise ConfigError(f"sparse_attention.{message}")


def _rules(s: SparseAttentionConfig) -> list[tuple[bool, str]]:
    ends = s.global_block_end_indices
    return [
        (s.block < 1, f"block: must be >= 1, got {s.block}"),
        (s.mode == "fixed" and s.num_local_blocks % s.num_global_blocks != 0,
         f"num_local_blocks: {s.num_local_blocks} is not a multiple of num_global_blocks {s.num_global_blocks}"),
        (s.attention != "bidirectional" and s.horizontal_global_attention,
         "horizontal_global_attention: only bidirectional attention has it"),
        (s.num_different_global_patterns > 1 and not s.different_layout_per_head,
         "num_different_global_patterns: more than 1 needs different_layout_per_head: true"),
        (s.mode == "fixed" and s.num_different_global_patterns > s.num_local_blocks // s.num_global_blocks,
         f"num_different_global_patterns: at most num_local_blocks / num_global_blocks = "
         f"{s.num_local_blocks // max(s.num_global_blocks, 1)}"),
        (ends is not None and len(ends) != len(s.global_block_indices),
         "global_block_end_indices: must have as many entries as global_block_indices"),
        (ends is not None and any(a >= b for a, b in zip(s.global_block_indices, ends or [], strict=False)),
         "global_block_end_indices: each end must be greater than its start"),
        (not s.local_window_blocks or min(s.local_window_blocks) < 1,
         "local_window_blocks: a non-empty list of sizes >= 1"),
    ]


def density(layout: Any) -> float:
    """The fraction of blocks a layout visits."""
    return float(np.mean(np.asarray(layout) != 0))

"""Documents into rows of the sequence length, and global batches of them.

A document of n tokens gives n - 1 (input, target) pairs; a row holds ``seq_len`` pairs.
`plan` places documents greedily in order: a document goes in the current row if its pairs
fit, else it starts the next row (the current row's rest is padding: weight 0, segment 0).
A document longer than a row is cut into pieces of ``seq_len`` pairs, each a document of its
own (positions from 0, since no position past ``seq_len`` was ever trained); consecutive
pieces overlap by one token so that no target is lost, and the tail, the last piece, starts
the row after the full ones, where later documents may join it. Without packing every piece
has a row to itself. Each placed piece has a segment id (1, 2, ... within its row) and
positions counting from 0, so attention and positions see it as if it ran alone
(`jzero.models.packing`).

Batches are a pure function of ``(seed, split, step)``: epoch ``e`` visits the rows in the
order ``default_rng([seed, split, e]).permutation``, and step ``s`` takes the next ``batch``
rows of that sequence, so a resumed run sees the same data and each process materialises
only its own rows. The loss weights are normalized over the global batch
(`jzero.models.packing.normalized`) once the rows are one array.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding

from jzero.config import ConfigError
from jzero.models import packing
from jzero.tasks.text import SPLITS
from jzero.tasks.tokencache import Tokens


@dataclass(frozen=True)
class Plan:
    """Pieces placed in rows: piece i's ``pairs`` pairs start at token ``start[i]`` of the
    stream and sit in row ``row[i]`` from column ``column[i]`` as segment ``segment[i]``."""

    row: np.ndarray
    column: np.ndarray
    start: np.ndarray
    pairs: np.ndarray
    segment: np.ndarray
    rows: int
    seq_len: int

    def pieces_of(self, r: int) -> range:
        """The pieces in row ``r`` (rows are filled in order, so they are consecutive)."""
        lo, hi = np.searchsorted(self.row, [r, r + 1])
        return range(int(lo), int(hi))


def plan(starts: np.ndarray, seq_len: int, pack: bool = True) -> Plan:
    """Documents ``starts[i]:starts[i + 1]`` of a token stream placed into rows."""
    row, column, start, pairs, segment = [], [], [], [], []
    r, used, seg = 0, 0, 0
    for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        for first in range(lo, hi - 1, seq_len):
            n = min(seq_len, hi - 1 - first)
            if used and (not pack or used + n > seq_len):
                r, used, seg = r + 1, 0, 0
            seg += 1
            row.append(r), column.append(used), start.append(first), pairs.append(n), segment.append(seg)
            used += n
    if not row:
        raise ConfigError("jzero.data.path: no document has two tokens, so there is nothing to predict")
    arrays = (np.asarray(a, np.int64) for a in (row, column, start, pairs, segment))
    return Plan(*arrays, rows=r + 1, seq_len=seq_len)


def rows(data: Tokens, layout: Plan, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``ids`` of ``layout`` as a batch: inputs, targets, weights, segments, positions."""
    t = layout.seq_len
    out = {k: np.zeros((len(ids), t), np.int32) for k in ("inputs", "targets", "segments", "positions")}
    out["weights"] = np.zeros((len(ids), t), np.float32)
    for i, r in enumerate(ids.tolist()):
        for p in layout.pieces_of(r):
            c, s, n = layout.column[p], layout.start[p], layout.pairs[p]
            window = np.asarray(data.tokens[s:s + n + 1])
            out["inputs"][i, c:c + n], out["targets"][i, c:c + n] = window[:-1], window[1:]
            out["weights"][i, c:c + n] = np.asarray(data.mask[s + 1:s + n + 1])
            out["segments"][i, c:c + n] = layout.segment[p]
            out["positions"][i, c:c + n] = np.arange(n)
    return out


def row_ids(layout: Plan, seed: int, split: str, step: int, batch_size: int) -> np.ndarray:
    """The rows of step ``step``'s global batch: the next ``batch_size`` of the epochs' orders."""
    index = step * batch_size + np.arange(batch_size)
    epochs = index // layout.rows
    out = np.empty(batch_size, np.int64)
    for e in np.unique(epochs).tolist():
        order = np.random.default_rng([seed, SPLITS[split], e]).permutation(layout.rows)
        out[epochs == e] = order[index[epochs == e] % layout.rows]
    return out


def global_batch(data: Tokens, layout: Plan, seed: int, split: str, step: int, batch_size: int,
                 sharding: NamedSharding) -> dict:
    """The global batch as sharded arrays, weights normalized over it; this process builds
    only its own rows."""
    n_proc, proc = jax.process_count(), jax.process_index()
    per = batch_size // n_proc
    ids = row_ids(layout, seed, split, step, batch_size)[proc * per:(proc + 1) * per]
    local = rows(data, layout, ids)
    batch = {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, layout.seq_len))
             for k, v in local.items()}
    batch["weights"] = _normalize(batch["weights"])
    return batch


_normalize = jax.jit(packing.normalized)


def split(data: Tokens, heldout_fraction: float) -> tuple[Tokens, Tokens]:
    """(train, held-out) by documents: the last ``heldout_fraction`` of them (at least one) held
    out; ConfigError with fewer than two documents."""
    n = len(data)
    if n < 2:
        raise ConfigError(f"jzero.data.path: {n} document; a held-out split needs at least two")
    cut = min(n - 1, max(1, int(round(n * (1 - heldout_fraction)))))
    return _documents(data, 0, cut), _documents(data, cut, n)


def _documents(data: Tokens, lo: int, hi: int) -> Tokens:
    base = int(data.starts[lo])
    return Tokens(data.tokens[base:int(data.starts[hi])], data.mask[base:int(data.starts[hi])],
                  np.asarray(data.starts[lo:hi + 1]) - base, data.source)

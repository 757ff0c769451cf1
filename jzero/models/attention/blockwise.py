"""Memory-efficient attention: the score matrix one block pair at a time, never whole.

Queries are cut into blocks of ``block_q`` rows, keys and values into blocks of ``block_k``; a
static list of (query block, key block) *pairs* says which blocks meet: every pair for dense
attention, the lower triangle under a causal mask, the set blocks of a DeepSpeed sparse layout
(`jzero.models.attention.layouts`, per head or shared). The pairs run in chunks under one
``lax.scan`` with an online softmax (Dao et al. 2022): each query row keeps a running max ``m``,
sum ``l`` and weighted sum ``acc``, rescaled when a later block raises the max. Work is exactly
proportional to the pairs visited, whatever their pattern: no row is padded to the longest
(a global row with every block and a local row with three cost what they visit).

A `jax.custom_vjp` saves only q, k, v, the output and each row's log-sum-exp; the backward
recomputes every pair's probabilities from them. Memory: O(T x d) plus one chunk of scores,
against the naive O(T x S) per head. A row whose every key is masked gets 0 and no gradient.

Shapes inside: rows ``[R, b, KV, G, block_q, d]`` (R = layout heads x query blocks; KV x G the
heads, grouped per key/value head), columns ``[C, b, KV, block_k, d]``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jzero.zero import modelaxes

CHUNK_ELEMENTS = 512 * 512  # scores a scan step computes per (batch, head) at most ...
STEP_ELEMENTS = 1 << 22  # ... and in all (batch x heads x pairs x bq x bk), at least one pair
_PAIRS_PER_STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("jzero_pairs_per_step", default=None)


@contextlib.contextmanager
def pairs_per_step(n: int) -> Iterator[None]:
    """Trace blockwise attention with ``n`` block pairs per scan step instead of the default
    (`CHUNK_ELEMENTS`): tests use it to cross many chunk boundaries on small inputs."""
    token = _PAIRS_PER_STEP.set(n)
    try:
        yield
    finally:
        _PAIRS_PER_STEP.reset(token)


class Pairs(NamedTuple):
    """The visited block pairs, padded to whole chunks: ``[steps, chunk]`` int32 arrays of row,
    column and (for bias and mask tiles) layout-head / query-block / key-block indices, and
    ``live`` (False on padding)."""
    row: np.ndarray
    col: np.ndarray
    head: np.ndarray
    qblock: np.ndarray
    kblock: np.ndarray
    live: np.ndarray


class Geometry(NamedTuple):
    """Static facts of one call: sizes, blocks, the causal offset and the pairs."""
    t: int
    s: int
    bq: int
    bk: int
    nq: int
    nk: int
    heads: int  # layout heads: 1 (shared) or the query heads
    causal: bool
    scale: float
    pairs: Pairs


def block_pairs(layout: np.ndarray, t: int, s: int, bq: int, bk: int, causal: bool) -> np.ndarray:
    """``[n, 3]`` (layout head, query block, key block) of the set blocks of ``layout``
    ``[heads, nq, nk]``, less those a causal mask (aligned at the end: query i sees keys up to
    i + s - t) leaves empty, in row order."""
    lay = np.asarray(layout) != 0
    if causal:
        first_q = np.arange(lay.shape[1]) * bq  # a block is empty when its first query sees none of its keys
        first_k = np.arange(lay.shape[2]) * bk
        lay = lay & (first_k[None, :] <= (np.minimum(first_q + bq, t) - 1 + s - t)[:, None])[None]
    return np.argwhere(lay).astype(np.int32)


def _pairs(found: np.ndarray, nq: int, nk: int, bq: int, bk: int, rows: int) -> Pairs:
    """``found`` in scan steps of as many pairs as `CHUNK_ELEMENTS` and `STEP_ELEMENTS` allow for
    ``rows`` (batch x heads) score rows per pair: an Evoformer's triangle attention has a batch of
    L rows, whose scores a per-(batch, head) bound alone would let grow to the naive L^3."""
    most = _PAIRS_PER_STEP.get() or max(1, min(CHUNK_ELEMENTS, STEP_ELEMENTS // rows) // (bq * bk))
    steps = -(-max(1, len(found)) // most)
    chunk = -(-max(1, len(found)) // steps)  # as even as the steps allow: under one pair of padding a step
    pad = steps * chunk - len(found)
    live = np.concatenate([np.ones(len(found), bool), np.zeros(pad, bool)])
    full = np.concatenate([found, np.zeros((pad, 3), np.int32)])
    h, i, j = full.T
    fields = (h * nq + i, h * nk + j, h, i, j, live)
    return Pairs(*(f.reshape(steps, chunk) for f in fields))


def geometry(t: int, s: int, d: int, bq: int, bk: int, causal: bool, layout: np.ndarray | None,
             rows: int = 1) -> Geometry:
    """The `Geometry` of a call: blocks clipped to the lengths; ``layout`` (blocks of bq x bk;
    None: dense) decides the pairs; ``rows`` (batch x heads) how many fit one scan step."""
    bq, bk = min(bq, t), min(bk, s)
    nq, nk = -(-t // bq), -(-s // bk)
    layout = np.ones((1, nq, nk), np.int8) if layout is None else np.asarray(layout)
    if layout.shape[1:] != (nq, nk):
        raise ValueError(f"attention layout: {layout.shape[1:]} blocks, the lengths need ({nq}, {nk})")
    found = block_pairs(layout, t, s, bq, bk, causal)
    return Geometry(t, s, bq, bk, nq, nk, layout.shape[0], causal, 1.0 / float(np.sqrt(d)),
                    _pairs(found, nq, nk, bq, bk, rows))


# ---- layouts in and out ---------------------------------------------------------------------

def _rows(x: jax.Array, g: Geometry, kv: int) -> jax.Array:
    """``[b, T, h, d]`` -> rows ``[R, b, KV, G, bq, d]`` (zero-padded to whole blocks)."""
    b, t, h, d = x.shape
    x = jnp.pad(x, ((0, 0), (0, g.nq * g.bq - t), (0, 0), (0, 0)))
    if g.heads == 1:
        return x.reshape(b, g.nq, g.bq, kv, h // kv, d).transpose(1, 0, 3, 4, 2, 5)
    x = x.reshape(b, g.nq, g.bq, h, d).transpose(3, 1, 0, 2, 4)  # per-head layout: one head per row
    return x.reshape(h * g.nq, b, 1, 1, g.bq, d)


def _unrows(x: jax.Array, g: Geometry, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `_rows`: rows back to ``shape`` ``[b, T, h, d]`` (padding dropped)."""
    b, t, h, d = shape
    if g.heads == 1:
        x = x.transpose(1, 0, 4, 2, 3, 5).reshape(b, g.nq * g.bq, h, d)
    else:
        x = x.reshape(h, g.nq, b, g.bq, d).transpose(2, 1, 3, 0, 4).reshape(b, g.nq * g.bq, h, d)
    return x[:, :t]


def _cols(x: jax.Array, g: Geometry, heads: int) -> jax.Array:
    """``[b, S, kv, d]`` -> columns ``[C, b, KV, bk, d]`` (per-head layouts: kv repeated to the
    query heads)."""
    b, s, kv, d = x.shape
    x = jnp.pad(x, ((0, 0), (0, g.nk * g.bk - s), (0, 0), (0, 0)))
    if g.heads == 1:
        return x.reshape(b, g.nk, g.bk, kv, d).transpose(1, 0, 3, 2, 4)
    x = jnp.repeat(x, heads // kv, axis=2).reshape(b, g.nk, g.bk, heads, d).transpose(3, 1, 0, 2, 4)
    return x.reshape(heads * g.nk, b, 1, g.bk, d)


def _uncols(x: jax.Array, g: Geometry, shape: tuple[int, ...], heads: int) -> jax.Array:
    """The inverse of `_cols`: columns back to ``shape`` ``[b, S, kv, d]`` (a per-head layout's
    repeated kv heads summed back into their group)."""
    b, s, kv, d = shape
    if g.heads == 1:
        return x.transpose(1, 0, 3, 2, 4).reshape(b, g.nk * g.bk, kv, d)[:, :s]
    x = x.reshape(heads, g.nk, b, g.bk, d).transpose(2, 1, 3, 0, 4).reshape(b, g.nk * g.bk, heads, d)
    return x[:, :s].reshape(b, s, kv, heads // kv, d).sum(3)


# ---- bias and mask tiles --------------------------------------------------------------------

def _tiles(x: jax.Array, g: Geometry, fill: Any) -> jax.Array:
    """A ``[B, H, T, S]`` (each dim full or 1) bias or mask -> tiles ``[n, B, Hin, bq', bk']``
    indexed by `_tile_index` (a broadcast dim stays 1 and is not tiled)."""
    bb, hh, tt, ss = x.shape
    nq, bq = (g.nq, g.bq) if tt > 1 else (1, 1)
    nk, bk = (g.nk, g.bk) if ss > 1 else (1, 1)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, nq * bq - tt), (0, nk * bk - ss)), constant_values=fill)
    x = x.reshape(bb, hh, nq, bq, nk, bk)
    per_head = g.heads > 1 and hh > 1
    x = x.transpose(1, 2, 4, 0, 3, 5) if per_head else x.transpose(2, 4, 0, 1, 3, 5)[None]
    return x.reshape(-1, bb, 1 if per_head else hh, bq, bk)


def _untiles(tiles: jax.Array, g: Geometry, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `_tiles`: tiles back to ``[B, H, T, S]`` (padding dropped)."""
    bb, hh, tt, ss = shape
    nq, bq = (g.nq, g.bq) if tt > 1 else (1, 1)
    nk, bk = (g.nk, g.bk) if ss > 1 else (1, 1)
    if g.heads > 1 and hh > 1:
        x = tiles.reshape(hh, nq, nk, bb, bq, bk).transpose(3, 0, 1, 4, 2, 5)
    else:
        x = tiles.reshape(nq, nk, bb, hh, bq, bk).transpose(2, 3, 0, 4, 1, 5)
    return x.reshape(bb, hh, nq * bq, nk * bk)[:, :, :tt, :ss]


def _tile_index(shape: tuple[int, ...], g: Geometry, head: jax.Array, qb: jax.Array, kb: jax.Array) -> jax.Array:
    """Which `_tiles` tile each pair (layout head, query block, key block) reads."""
    _, hh, tt, ss = shape
    nq, nk = (g.nq if tt > 1 else 1), (g.nk if ss > 1 else 1)
    h = head if (g.heads > 1 and hh > 1) else 0
    return (h * nq + (qb if tt > 1 else 0)) * nk + (kb if ss > 1 else 0)


def _tile_view(tile: jax.Array, kv: int) -> jax.Array:
    """Tiles ``[c, B, Hin, bq', bk']`` -> broadcastable against scores ``[c, b, KV, G, bq, bk]``."""
    c, bb, hin, bq, bk = tile.shape
    return tile.reshape(c, bb, kv, hin // kv, bq, bk) if hin > 1 else tile.reshape(c, bb, 1, 1, bq, bk)


# ---- one chunk of pairs ---------------------------------------------------------------------

def _segment_tiles(segments: Any, g: Geometry) -> Any:
    """Segment ids (q's ``[b, T]``, k's ``[b, S]``) as ``[nq, b, bq]`` and ``[nk, b, bk]`` tiles
    (padding: -1, a segment no key or query has), or None."""
    if segments is None:
        return None
    sq, sk = segments

    def tiles(x, n, block):
        x = jnp.pad(x, ((0, 0), (0, n * block - x.shape[1])), constant_values=-1)
        return x.reshape(x.shape[0], n, block).transpose(1, 0, 2)

    return tiles(sq, g.nq, g.bq), tiles(sk, g.nk, g.bk)


def _scores(g: Geometry, qb, kb, xs, bias_tiles, mask_tiles, kv: int, bias_shape, mask_shape, seg_tiles=None):
    """A chunk's scaled scores + bias ``[c, b, KV, G, bq, bk]`` (fp32), -inf where a key does not
    count. The mask enters as a small additive tile (0 / -inf, broadcast over batch and heads):
    a full-size boolean would be hoisted out of the loop by XLA for every step at once."""
    row, col, head, qi, kj, live = xs
    s = jnp.einsum("cbkgqd,cbksd->cbkgqs", qb, kb, preferred_element_type=jnp.float32) * g.scale
    qpos = qi[:, None] * g.bq + jnp.arange(g.bq)[None]
    kpos = kj[:, None] * g.bk + jnp.arange(g.bk)[None]
    ok = (kpos[:, None, :] < g.s) & live[:, None, None]
    if g.causal:
        ok = ok & (kpos[:, None, :] <= qpos[:, :, None] + (g.s - g.t))
    ok = ok[:, None, None, None]
    if mask_tiles is not None:
        ok = ok & _tile_view(mask_tiles[_tile_index(mask_shape, g, head, qi, kj)], kv)
    if seg_tiles is not None:  # packed rows: a query sees only its own document's keys
        same = seg_tiles[0][qi][:, :, :, None] == seg_tiles[1][kj][:, :, None, :]
        ok = ok & same[:, :, None, None]
    if bias_tiles is not None:
        s = s + _tile_view(bias_tiles[_tile_index(bias_shape, g, head, qi, kj)], kv).astype(jnp.float32)
    return s + jnp.where(ok, 0.0, -jnp.inf)


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
    """What the custom VJP takes as static (compared by identity: it holds numpy arrays)."""
    g: Geometry
    kv: int
    heads: int
    bias_shape: tuple[int, ...] | None
    mask_shape: tuple[int, ...] | None


def _forward(st: _Static, q, k, v, bias, mask, segments):
    g, kv = st.g, st.kv
    seg = _segment_tiles(segments, g)
    qr, kc, vc = _rows(q, g, kv if g.heads == 1 else 1), _cols(k, g, st.heads), _cols(v, g, st.heads)
    bt = None if bias is None else _tiles(bias, g, 0)
    mt = None if mask is None else _tiles(mask, g, False)
    stat = qr.shape[:-1]
    init = _varying((jnp.full(stat, -jnp.inf, jnp.float32), jnp.zeros(stat, jnp.float32),
                     jnp.zeros(qr.shape, jnp.float32)), q, k, v, bias, mask)

    def step(carry, xs):
        m, total, acc = carry
        row, col = xs[0], xs[1]
        s = _scores(g, qr[row], kc[col], xs, bt, mt, qr.shape[2], st.bias_shape, st.mask_shape, seg)
        m_new = m.at[row].max(s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = _rescale(m, m_safe)
        p = jnp.exp(s - m_safe[row][..., None])
        pv = jnp.einsum("cbkgqs,cbksd->cbkgqd", p.astype(v.dtype), vc[col], preferred_element_type=jnp.float32)
        return (m_new, (total * alpha).at[row].add(p.sum(-1)), (acc * alpha[..., None]).at[row].add(pv)), None

    (m, total, acc), _ = jax.lax.scan(step, init, _xs(g))
    seen = total > 0  # rows with at least one key; the others give 0 and, by a 1 / sum of 0, no gradient
    safe = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    # the row's max and 1 / sum, not their log-sum-exp: at a max of -1e8 (a finfo.min-style bias
    # over a whole row) m + log(sum) rounds back to m, and the backward's probabilities were 1
    # instead of 1 / S
    stats = (jnp.where(jnp.isfinite(m), m, 0.0), jnp.where(seen, 1.0 / safe, 0.0))
    return _unrows(out, g, q.shape).astype(q.dtype), stats


def _varying(init: Any, *operands: Any) -> Any:
    """The scan's initial carry typed as varying over every manual mesh axis an operand varies
    over (inside a ``shard_map``, as the jzero step runs the model), so it matches the carry out."""
    axes = set()
    for x in operands:
        if x is not None:
            axes |= set(jax.typeof(x).manual_axis_type.varying)
    if not axes:
        return init
    return jax.tree.map(lambda a: jax.lax.pcast(a, tuple(sorted(axes)), to="varying"), init)


def _rescale(m_old: jax.Array, m_new: jax.Array) -> jax.Array:
    """What a row's running sums are multiplied by when its max rises from ``m_old`` to ``m_new``
    (0 for a row that had seen no key)."""
    return jnp.exp(m_old - m_new)


def _xs(g: Geometry) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(a) for a in g.pairs)


def _backward(st: _Static, q, k, v, bias, mask, segments, out, stats, dout):
    g, kv_rows = st.g, (st.kv if st.g.heads == 1 else 1)
    seg = _segment_tiles(segments, g)
    qr, kc, vc = _rows(q, g, kv_rows), _cols(k, g, st.heads), _cols(v, g, st.heads)
    dor = _rows(dout, g, kv_rows).astype(jnp.float32)
    delta = jnp.sum(dor * _rows(out, g, kv_rows).astype(jnp.float32), -1)
    bt = None if bias is None else _tiles(bias, g, 0)
    mt = None if mask is None else _tiles(mask, g, False)
    init = _varying((jnp.zeros(qr.shape, jnp.float32), jnp.zeros(kc.shape, jnp.float32),
                     jnp.zeros(vc.shape, jnp.float32), None if bt is None else jnp.zeros(bt.shape, jnp.float32)),
                    q, k, v, bias, mask, dout)

    def step(carry, xs):
        dq, dk, dv, db = carry
        row, col, head, qi, kj, _ = xs
        qb, kb, vb, dob = qr[row], kc[col], vc[col], dor[row]
        s = _scores(g, qb, kb, xs, bt, mt, qr.shape[2], st.bias_shape, st.mask_shape, seg)
        p = jnp.exp(s - stats[0][row][..., None]) * stats[1][row][..., None]
        dv = dv.at[col].add(jnp.einsum("cbkgqs,cbkgqd->cbksd", p.astype(v.dtype).astype(jnp.float32), dob))
        dp = jnp.einsum("cbkgqd,cbksd->cbkgqs", dob, vb.astype(jnp.float32))
        ds = p * (dp - delta[row][..., None])
        dq = dq.at[row].add(jnp.einsum("cbkgqs,cbksd->cbkgqd", ds, kb.astype(jnp.float32)) * g.scale)
        dk = dk.at[col].add(jnp.einsum("cbkgqs,cbkgqd->cbksd", ds, qb.astype(jnp.float32)) * g.scale)
        if db is not None:
            db = db.at[_tile_index(st.bias_shape, g, head, qi, kj)].add(_to_tile(ds, db.shape))
        return (dq, dk, dv, db), None

    (dq, dk, dv, db), _ = jax.lax.scan(step, init, _xs(g))
    dq = _unrows(dq, g, q.shape).astype(q.dtype)
    dk, dv = (_uncols(x, g, y.shape, st.heads).astype(y.dtype) for x, y in ((dk, k), (dv, v)))
    dbias = None if db is None else _untiles(db, g, st.bias_shape).astype(bias.dtype)
    return dq, dk, dv, dbias


def _to_tile(ds: jax.Array, tile_shape: tuple[int, ...]) -> jax.Array:
    """A chunk's score gradients ``[c, b, KV, G, bq, bk]`` summed to bias tiles ``[c, B, Hin, bq', bk']``
    (over every dim the bias broadcasts)."""
    c, b, kv, gg, bq, bk = ds.shape
    x = ds.reshape(c, b, kv * gg, bq, bk)
    axes = tuple(ax for ax, want in enumerate(tile_shape) if want == 1 and x.shape[ax] > 1)
    return jnp.sum(x, axis=axes, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: _Static, q, k, v, bias, mask, segments):
    return _forward(st, q, k, v, bias, mask, segments)[0]


def _attend_fwd(st, q, k, v, bias, mask, segments):
    out, stats = _forward(st, q, k, v, bias, mask, segments)
    # kept on heads, where the backward reads it: left to the partitioner, the copy the backward
    # saves may take the layout the caller gives the output (tokens, under Ulysses) and move back
    out = modelaxes.heads(out)
    return out, (q, k, v, bias, mask, segments, out, stats)


def _no_gradient(x: Any) -> Any:
    return jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), x)


def _attend_bwd(st, res, dout):
    q, k, v, bias, mask, segments, out, stats = res
    dq, dk, dv, dbias = _backward(st, q, k, v, bias, mask, segments, out, stats, dout)
    return dq, dk, dv, dbias, _no_gradient(mask), _no_gradient(segments)


_attend.defvjp(_attend_fwd, _attend_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, mask: jax.Array | None,
                        causal: bool, layout: np.ndarray | None, block_q: int, block_k: int,
                        segments: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Attention of ``q`` ``[b, T, h, d]`` over ``k`` / ``v`` ``[b, S, kv, d]``; ``bias`` / ``mask``
    already ``[B, H, T', S']`` with each dim full or 1 (`jzero.models.attention` normalizes them);
    ``layout`` ``[1 or h, nq, nk]`` blocks of ``block_q x block_k`` (None: dense); ``segments``
    (q's ``[b, T]``, k's ``[b, S]`` int ids): a query attends only keys of its own segment,
    tested tile by tile (no ``[T, S]`` mask is built)."""
    g = geometry(q.shape[1], k.shape[1], q.shape[-1], block_q, block_k, causal, layout,
                 q.shape[0] * q.shape[2])
    st = _Static(g, k.shape[2], q.shape[2], None if bias is None else bias.shape,
                 None if mask is None else mask.shape)
    return _attend(st, q, k, v, bias, mask, segments)

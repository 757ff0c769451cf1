"""`attention`: the one attention function every jzero model calls (docs/design.md, "Attention").

Implementations, picked by name (`IMPLEMENTATIONS`), all with the same semantics:

* ``naive``: the ``[b, h, T, S]`` score matrix, softmax, weighted sum (short sequences, reference);
* ``blockwise``: `jzero.models.attention.blockwise`, O(T x block) memory, any backend, and the one
  that visits only a sparse ``layout``'s blocks (`jzero.models.attention.layouts`);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` where it applies;
* ``auto``: cudnn on a GPU where it applies, else blockwise for a sparse layout or from
  ``blockwise_from`` tokens up, naive below.

Semantics: q ``[b, T, h, d]``, k / v ``[b, S, kv, d]`` (grouped-query when kv divides h: query
head i reads key head i // (h / kv)); ``bias`` broadcastable to ``[b, h, T, S]``, added to the
scaled scores (gradients flow to it); ``mask`` boolean, likewise, True where a query may attend;
``causal``: query i sees keys up to i + S - T (aligned at the end, as decoding needs); ``layout``:
``[1 or h, T / block, S / block]`` blocks that may attend; ``segments``: int ids (one ``[b, T]``
array for self-attention, or q's ``[b, T]`` and k's ``[b, S]``), a query attending only keys of
its own segment (documents packed into one row; blockwise tests them tile by tile, no ``[T, S]``
mask). A query row that can attend to nothing gives 0 and passes no gradient, never NaN.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jzero.config import AttentionConfig, ConfigError, SparseAttentionConfig
from jzero.models.attention import layouts
from jzero.models.attention.blockwise import blockwise_attention
from jzero.zero import modelaxes


def _normalized(x: Any, name: str, full: tuple[int, int, int, int]) -> jax.Array | None:
    """``x`` as 4-D ``[B, H, T, S]``, each dim ``full``'s or 1; ValueError naming ``name`` otherwise."""
    if x is None:
        return None
    x = jnp.asarray(x)
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    if x.ndim > 4 or any(n not in (1, f) for n, f in zip(shape, full, strict=True)):
        raise ValueError(f"attention {name}: shape {tuple(x.shape)} does not broadcast to [batch, heads, T, S] = "
                         f"{list(full)}")
    return x.reshape(shape)


def _layout_mask(layout: np.ndarray, t: int, s: int) -> np.ndarray:
    """A block layout expanded to the boolean ``[1, heads, T, S]`` mask it stands for."""
    lay = np.asarray(layout) != 0
    return np.repeat(np.repeat(lay, t // lay.shape[1], axis=1), s // lay.shape[2], axis=2)[None]


def _allowed(t: int, s: int, mask: jax.Array | None, causal: bool, layout: np.ndarray | None) -> jax.Array:
    ok = jnp.ones((1, 1, t, s), bool)
    if causal:
        ok = ok & (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t))
    if layout is not None:
        ok = ok & _layout_mask(layout, t, s)
    return ok if mask is None else ok & mask


def _same_segment(segments: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``[b, 1, T, S]`` bool: query and key in the same segment."""
    sq, sk = segments
    return (sq[:, :, None] == sk[:, None, :])[:, None]


def _naive(q, k, v, bias, mask, causal, layout, segments=None, **_) -> jax.Array:
    """The whole score matrix in fp32 and ``jax.nn.softmax`` (whose backward needs only its
    output). Keys a row may not attend (masked, or biased to -inf) score -1e30, not -inf: a row
    with none gets a finite uniform softmax, and its output is then set to 0 (so it passes no
    gradient). In q's dtype, as the other implementations."""
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    k, v = (jnp.repeat(x, h // kv, axis=2) if kv < h else x for x in (k, v))  # grouped-query: kv per head
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    ok = _allowed(t, s, mask, causal, layout)
    if segments is not None:
        ok = ok & _same_segment(segments)
    if bias is not None:
        ok = ok & ~jnp.isneginf(scores)
    probs = jax.nn.softmax(jnp.where(ok, scores, -1e30), axis=-1)
    seen = jnp.any(ok, axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)
    return jnp.where(seen.transpose(0, 2, 1, 3), out, 0).astype(q.dtype)  # on the output: no score-sized copy


def _blockwise(q, k, v, bias, mask, causal, layout, segments=None, block_q: int = 512, block_k: int = 512,
               **_) -> jax.Array:
    """`blockwise_attention`; under a layout the blocks are the layout's."""
    if layout is not None:
        block_q, block_k = q.shape[1] // layout.shape[1], k.shape[1] // layout.shape[2]
    return blockwise_attention(q, k, v, bias, mask, causal, layout, block_q, block_k, segments)


def cudnn_unavailable(q: jax.Array, k: jax.Array, causal: bool, layout: Any) -> str | None:
    """Why cuDNN's fused attention cannot run this call (None: it can)."""
    platform = jax.default_backend()
    reasons = [
        (platform != "gpu", f"the backend is {platform}, cuDNN needs a GPU"),
        (q.dtype not in (jnp.bfloat16, jnp.float16), f"dtype {q.dtype}: cuDNN takes bf16 or fp16"),
        (layout is not None, "a sparse layout needs the blockwise implementation"),
        (causal and q.shape[1] != k.shape[1], "causal with T != S (aligned at the end) is not cuDNN's mask"),
        (q.shape[-1] % 8 or q.shape[-1] > 128, f"head_dim {q.shape[-1]}: cuDNN takes multiples of 8 up to 128"),
    ]
    return next((why for bad, why in reasons if bad), None)


def _cudnn(q, k, v, bias, mask, causal, layout, segments=None, **_) -> jax.Array:
    """cuDNN's fused attention (``jax.nn.dot_product_attention``; segments as a mask);
    ValueError saying why not."""
    why = cudnn_unavailable(q, k, causal, layout)
    if why:
        raise ValueError(f"attention implementation 'cudnn': {why}")
    if segments is not None:
        mask = _same_segment(segments) if mask is None else mask & _same_segment(segments)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=causal, implementation="cudnn")


IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {"naive": _naive, "blockwise": _blockwise, "cudnn": _cudnn}


def resolve(implementation: str, q: jax.Array, k: jax.Array, causal: bool, layout: Any,
            blockwise_from: int = 256) -> str:
    """The implementation ``auto`` stands for on this call (others stand for themselves)."""
    if implementation != "auto":
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {implementation!r}: valid: auto, "
                             f"{', '.join(IMPLEMENTATIONS)}")
        return implementation
    if cudnn_unavailable(q, k, causal, layout) is None:
        return "cudnn"
    long = max(q.shape[1], k.shape[1]) >= blockwise_from
    return "blockwise" if layout is not None or long else "naive"


_ABSENT: contextvars.ContextVar[bool] = contextvars.ContextVar("jzero_attention_absent", default=False)


@contextlib.contextmanager
def absent() -> Iterator[None]:
    """Trace `attention` as q itself (no scores, no softmax): `jzero estimate` compiles the step
    once more this way, and the difference in temporaries is attention's share."""
    token = _ABSENT.set(True)
    try:
        yield
    finally:
        _ABSENT.reset(token)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, bias: Any = None, mask: Any = None,
              causal: bool = False, layout: Any = None, implementation: str = "auto", block_q: int = 512,
              block_k: int = 512, blockwise_from: int = 256, segments: Any = None) -> jax.Array:
    """Softmax attention of ``q`` over ``k`` / ``v`` (module docstring for the semantics);
    ``[b, T, h, d]`` in q's dtype."""
    b, t, h, d = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[-1] != d or h % k.shape[2]:
        raise ValueError(f"attention: k and v must be [batch, S, kv_heads, head_dim] with kv_heads dividing "
                         f"the {h} query heads; got q {q.shape}, k {k.shape}, v {v.shape}")
    s = k.shape[1]
    full = (b, h, t, s)
    if layout is not None:
        layout = np.asarray(layout)
        if layout.ndim != 3 or layout.shape[0] not in (1, h) or t % layout.shape[1] or s % layout.shape[2]:
            raise ValueError(f"attention layout: shape {layout.shape} must be [1 or {h} heads, T / block, "
                             f"S / block] for T={t}, S={s}")
    if _ABSENT.get():
        return q
    name = resolve(implementation, q, k, causal, layout, blockwise_from)
    if mask is not None:
        mask = _normalized(jnp.asarray(mask, bool), "mask", full)
    segments = _segments(segments, b, t, s)
    q, k, v = (modelaxes.heads(x) for x in (q, k, v))  # Ulysses: whole sequences, a share of the heads
    out = IMPLEMENTATIONS[name](q, k, v, _normalized(bias, "bias", full), mask, causal, layout,
                                segments=segments, block_q=block_q, block_k=block_k)
    return modelaxes.tokens(modelaxes.heads(out))  # pinned on heads first: the backward moves dout, not scores


def _segments(segments: Any, b: int, t: int, s: int) -> tuple[jax.Array, jax.Array] | None:
    """(q's ``[b, T]``, k's ``[b, S]``) int32 segment ids, or None; ValueError naming the shapes."""
    if segments is None:
        return None
    sq, sk = (segments, segments) if not isinstance(segments, (tuple, list)) else segments
    sq, sk = jnp.asarray(sq, jnp.int32), jnp.asarray(sk, jnp.int32)
    if sq.shape != (b, t) or sk.shape != (b, s):
        raise ValueError(f"attention segments: expected q's [{b}, {t}] and k's [{b}, {s}] int ids (one [b, T] array "
                         f"for self-attention), got {sq.shape} and {sk.shape}")
    return sq, sk


def long_context(spec: Any) -> bool:
    """Whether a model (its spec) attends over long sequences: at least ``blockwise_from`` tokens,
    or under a sparse layout. Only there is attention's share of the step's memory worth the
    second compile that measures it (`jzero estimate`, the train summary); a vision tower's few
    dozen patches (its spec has no ``seq_len``) never are."""
    settings = getattr(spec, "attention", None)
    if settings is None:
        return False
    return getattr(spec, "sparse_attention", None) is not None or getattr(spec, "seq_len", 0) >= settings.blockwise_from


def check_settings(settings: AttentionConfig | None) -> None:
    """ConfigError naming the ``jzero.model.attention`` key that is out of range."""
    for key in ("block_q", "block_k", "blockwise_from"):
        value = getattr(settings or AttentionConfig(), key)
        if value < 1:
            raise ConfigError(f"jzero.model.attention.{key}: must be >= 1, got {value}")


def configured(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, settings: AttentionConfig | None,
               sparse: SparseAttentionConfig | None = None, bias: Any = None, mask: Any = None,
               segments: Any = None) -> jax.Array:
    """`attention` as a model's config says: ``jzero.model.attention`` (None: its defaults) and the
    ``sparse_attention`` section's layout for q's heads and length (None: dense)."""
    settings = settings or AttentionConfig()
    layout = None if sparse is None else layouts.cached(sparse, q.shape[2], q.shape[1], settings.layout_seed)
    return attention(q, k, v, bias=bias, mask=mask, causal=causal, layout=layout,
                     implementation=settings.implementation, block_q=settings.block_q, block_k=settings.block_k,
                     blockwise_from=settings.blockwise_from, segments=segments)

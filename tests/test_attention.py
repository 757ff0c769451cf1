"""`jzero.attention`: blockwise against the naive reference (values and gradients of q, k, v and
the bias, fp32 rtol 1e-5, bf16 2e-2) over every feature the semantics name, with a negative
control (a wrong online-softmax rescale must fail); sparse layouts against naive attention with
the layout expanded as a mask; the errors a caller meets."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzero.models import attention as attn
from jzero.models.attention import blockwise

B, H, D = 2, 4, 8


def _inputs(t, s, kv=H, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, t, H, D), dtype)
    k = jax.random.normal(keys[1], (B, s, kv, D), dtype)
    v = jax.random.normal(keys[2], (B, s, kv, D), dtype)
    return q, k, v, keys[3]


def _value_and_grads(impl, q, k, v, bias, **kw):
    """The output and the gradients of a fixed random projection of it w.r.t. q, k, v, bias."""
    def loss(q, k, v, bias):
        out = attn.attention(q, k, v, bias=bias, implementation=impl, **kw)
        weights = jax.random.normal(jax.random.key(7), out.shape, jnp.float32)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias)
    return out, grads


def _assert_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert not np.isnan(np.asarray(x, np.float32)).any()
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def _compare(t, s, *, kv=H, bias_shape=None, mask_fn=None, causal=False, dtype=jnp.float32, rtol=1e-5,
             atol=1e-5, block=4, chunk=8):
    q, k, v, key = _inputs(t, s, kv, dtype)
    bias = None if bias_shape is None else jax.random.normal(key, bias_shape, dtype)
    mask = None if mask_fn is None else mask_fn(t, s)
    kw = dict(mask=mask, causal=causal)
    ref = _value_and_grads("naive", q, k, v, bias, **kw)
    with blockwise.pairs_per_step(chunk):
        got = _value_and_grads("blockwise", q, k, v, bias, block_q=block, block_k=block, **kw)
    _assert_close(got, ref, rtol, atol)
    return got


def _padding(t, s):
    """Batch row 1 has its last 5 keys padded out."""
    lengths = np.array([s, s - 5])
    return (np.arange(s)[None, :] < lengths[:, None])[:, None, None, :]


CASES = {
    "plain": dict(t=16, s=16),
    "causal": dict(t=16, s=16, causal=True),
    "padding mask": dict(t=16, s=16, mask_fn=_padding),
    "bias per batch": dict(t=16, s=16, bias_shape=(B, 1, 16, 16), causal=True),
    "bias per head": dict(t=16, s=16, bias_shape=(1, H, 16, 16)),
    "grouped-query": dict(t=16, s=16, kv=2, causal=True),
    "T != S, causal at the end": dict(t=6, s=18, causal=True, bias_shape=(B, H, 6, 18)),
    "T not a multiple of the block": dict(t=18, s=13, mask_fn=_padding, bias_shape=(1, H, 18, 13)),
}


@pytest.mark.parametrize("case", CASES)
def test_blockwise_equals_naive_fp32(case):
    _compare(**CASES[case])


def test_blockwise_equals_naive_bf16():
    _compare(t=16, s=16, kv=2, causal=True, bias_shape=(B, 1, 16, 16), dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)


def test_a_fully_masked_row_gives_zero_and_no_gradient():
    def mask_fn(t, s):
        m = np.ones((1, 1, t, s), bool)
        m[..., 3, :] = False  # query 3 sees nothing
        return m

    out, grads = _compare(t=16, s=16, mask_fn=mask_fn, bias_shape=(1, H, 16, 16))
    assert np.all(np.asarray(out)[:, 3] == 0)
    assert np.all(np.asarray(grads[0])[:, 3] == 0)  # dq of that row
    assert np.all(np.asarray(grads[3])[:, :, 3] == 0)  # dbias of that row


@pytest.mark.parametrize("impl", ["naive", "blockwise", "auto"])
def test_a_row_biased_to_minus_infinity_gives_zero_and_no_gradient(impl):
    """A bias of -inf over a whole query row is a row that sees no key: 0 and no gradient, as a
    masked row (the naive path gave NaN on 36819f1); a partly -inf row is a padding mask."""
    q, k, v, _ = _inputs(16, 16)
    bias = np.zeros((1, H, 16, 16), np.float32)
    bias[..., 3, :] = -np.inf
    bias[..., 5, :6] = -np.inf
    mask = np.ones((1, 1, 16, 16), bool)
    mask[..., 3, :], mask[..., 5, :6] = False, False
    out, grads = _value_and_grads(impl, q, k, v, jnp.asarray(bias), block_q=4, block_k=4)
    masked, masked_grads = _value_and_grads("naive", q, k, v, None, mask=mask)
    assert np.all(np.asarray(out)[:, 3] == 0) and np.all(np.asarray(grads[0])[:, 3] == 0)
    assert np.isfinite(np.asarray(grads[3])).all()  # the bias's own gradient: 0 where it is -inf
    _assert_close(out, masked, 1e-5, 1e-5)
    _assert_close(grads[:3], masked_grads, 1e-5, 1e-5)


@pytest.mark.parametrize("fill", [-1e8, float(np.finfo(np.float32).min)])
def test_a_row_biased_to_a_huge_finite_negative_equals_naive(fill):
    """Hugging Face's masking adds finfo.min: a whole row of it is a uniform softmax over every
    key. Blockwise saved m + log(sum) for its backward, which rounds to m at that magnitude: its
    gradients were S times naive's (found trying jzero as a user)."""
    q, k, v, key = _inputs(16, 16)
    bias = np.array(jax.random.normal(key, (1, H, 16, 16)))
    bias[..., 6, :] = fill
    ref = _value_and_grads("naive", q, k, v, jnp.asarray(bias))
    with blockwise.pairs_per_step(8):
        got = _value_and_grads("blockwise", q, k, v, jnp.asarray(bias), block_q=4, block_k=4)
    _assert_close(got[:1] + (got[1][:3],), ref[:1] + (ref[1][:3],), 1e-5, 1e-5)


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
def test_the_output_takes_qs_dtype(impl):
    q, k, v, _ = _inputs(16, 16)
    assert attn.attention(q.astype(jnp.bfloat16), k, v, implementation=impl, block_q=4, block_k=4).dtype == jnp.bfloat16


def test_a_wrong_online_rescale_fails(monkeypatch):
    """Negative control: without the rescale of earlier blocks when the running max rises, the
    comparison above must fail (several key blocks per row, each chunk one pair)."""
    monkeypatch.setattr(blockwise, "_rescale", lambda m_old, m_new: jnp.ones_like(m_old))
    with pytest.raises(AssertionError):
        _compare(t=16, s=16, chunk=1)


def test_a_layout_equals_naive_attention_with_the_layout_as_a_mask():
    q, k, v, key = _inputs(32, 32)
    rng = np.random.default_rng(0)
    layout = rng.integers(0, 2, (H, 8, 8))
    layout[:, 2, :] = 1  # a global row: many more blocks than the others
    layout[:, 5, :] = 0  # an empty row: zero out, zero grads
    bias = jax.random.normal(key, (1, H, 32, 32))
    mask = attn._layout_mask(layout, 32, 32)
    ref = _value_and_grads("naive", q, k, v, bias, mask=mask, causal=True)
    with blockwise.pairs_per_step(5):
        got = _value_and_grads("blockwise", q, k, v, bias, layout=layout, causal=True)
    _assert_close(got, ref, 1e-5, 1e-5)
    assert np.all(np.asarray(got[0])[:, 20:24] == 0)


def test_blockwise_visits_only_the_pairs_it_needs():
    layout = np.tril(np.ones((1, 8, 8), int))
    dense = blockwise.block_pairs(np.ones((1, 8, 8)), 32, 32, 4, 4, causal=True)
    assert len(dense) == int(layout.sum())  # causal drops the blocks above the diagonal
    assert len(blockwise.block_pairs(np.ones((1, 2, 6)), 8, 24, 4, 4, causal=True)) == 2 * 6 - 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(bias=np.zeros((3, 1, 1, 1))), "attention bias: shape"),
    (dict(mask=np.ones((1, 1, 5, 16), bool)), "attention mask: shape"),
    (dict(implementation="flash"), "valid: auto, naive, blockwise, cudnn"),
    (dict(implementation="cudnn"), "attention implementation 'cudnn': the backend is cpu"),
    (dict(layout=np.ones((3, 4, 4))), "attention layout: shape"),
])
def test_bad_arguments_are_one_line_errors(kwargs, match):
    q, k, v, _ = _inputs(16, 16)
    with pytest.raises(ValueError, match=match):
        attn.attention(q, k, v, **kwargs)


def test_auto_picks_naive_short_and_blockwise_long_or_sparse():
    q, k, _, _ = _inputs(16, 16)
    assert attn.resolve("auto", q, k, False, None, blockwise_from=1024) == "naive"
    assert attn.resolve("auto", q, k, False, None, blockwise_from=16) == "blockwise"
    assert attn.resolve("auto", q, k, False, np.ones((1, 4, 4)), blockwise_from=1024) == "blockwise"


def test_only_long_context_models_pay_for_the_attention_share():
    """`jzero estimate` and the train summary compile the step once more to measure attention's
    share only for long sequences (>= blockwise_from tokens) or a sparse layout."""
    from jzero.config import AttentionConfig
    from jzero.models import gpt, vit

    assert not attn.long_context(gpt.GPTConfig(seq_len=255))
    assert attn.long_context(gpt.GPTConfig(seq_len=256))
    assert not attn.long_context(gpt.GPTConfig(seq_len=256, attention=AttentionConfig(blockwise_from=512)))
    assert attn.long_context(gpt.GPTConfig(seq_len=64, sparse_attention=object()))
    assert not attn.long_context(vit.ViTConfig())


def _packed_case(causal, kv):
    """Three documents (5, 11 and 7 tokens, then 9 of padding) packed into one 32-token row,
    beside each document run on its own."""
    rng = np.random.default_rng(3)
    lengths, t, h, d = (5, 11, 7), 32, 4, 8
    q = jnp.asarray(rng.normal(size=(1, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, t, kv, d)), jnp.float32) for _ in range(2))
    segments = np.full((1, t), 3, np.int32)  # the padding: a segment of its own
    start = 0
    for i, n in enumerate(lengths):
        segments[0, start:start + n] = i
        start += n
    return q, k, v, jnp.asarray(segments), lengths, causal


@pytest.mark.parametrize("impl", ["naive", "blockwise"])
@pytest.mark.parametrize("causal,kv", [(True, 4), (False, 2)])
def test_packed_documents_attend_as_if_alone(impl, causal, kv):
    """Segment ids (documents packed into one row): each document's outputs and the gradients
    of a loss over them equal the document run on its own (rtol 1e-5); blockwise with blocks of
    4 so segment edges fall inside tiles and chunks. Negative control: without segments the
    packed outputs differ."""
    q, k, v, segments, lengths, causal = _packed_case(causal, kv)
    ct = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)

    def packed(q, k, v, segs):
        out = attn.attention(q, k, v, causal=causal, implementation=impl, block_q=4, block_k=4, segments=segs)
        return jnp.sum(out * ct), out

    with blockwise.pairs_per_step(3):
        (_, out), grads = jax.value_and_grad(packed, argnums=(0, 1, 2), has_aux=True)(q, k, v, segments)
        _, unsegmented = packed(q, k, v, None)
    start = 0
    for n in lengths:
        part = slice(start, start + n)

        def alone(q, k, v, ct_part=ct[:, part]):
            out = attn.attention(q, k, v, causal=causal, implementation="naive")
            return jnp.sum(out * ct_part)

        want = attn.attention(q[:, part], k[:, part], v[:, part], causal=causal, implementation="naive")
        np.testing.assert_allclose(out[:, part], want, rtol=1e-5, atol=1e-6)
        for g, w in zip(grads, jax.grad(alone, argnums=(0, 1, 2))(q[:, part], k[:, part], v[:, part]), strict=True):
            np.testing.assert_allclose(g[:, part], w, rtol=1e-5, atol=1e-6)
        start += n
    assert not np.allclose(unsegmented[:, lengths[0]:sum(lengths)], out[:, lengths[0]:sum(lengths)], atol=1e-3)


def test_segments_of_the_wrong_shape_are_one_line_errors():
    q = jnp.zeros((2, 8, 2, 4))
    with pytest.raises(ValueError, match=r"attention segments: expected q's \[2, 8\] and k's \[2, 8\] int ids"):
        attn.attention(q, q, q, segments=jnp.zeros((2, 7), jnp.int32))

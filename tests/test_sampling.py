"""Sampling (`jzero.inference.sampling`): the kept sets of top-k / top-p equal a numpy reference
row by row; draws follow the renormalized distribution and never leave the kept set; temperature
0 is the argmax; a row's token depends on its own key only; bad settings are one line; and the
uncached generation (the cached engine's future reference) takes the argmax of each full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jzero.inference import sampling, uncached
from jzero.models import gpt


def _reference_kept(logits, temperature, top_k, top_p):
    """Hugging Face's order in plain numpy: temperature, top-k, then top-p over what top-k kept."""
    scaled = logits / (temperature if temperature > 0 else 1.0)
    order = np.argsort(-scaled, kind="stable")
    k = top_k if top_k > 0 else len(logits)
    top = order[:k]
    probs = np.exp(scaled[top] - scaled[top].max())
    probs /= probs.sum()
    n = int(np.searchsorted(np.cumsum(probs), top_p - 1e-7) + 1)  # smallest prefix reaching top_p
    out = np.zeros(len(logits), bool)
    out[top[:min(n, k)]] = True
    return out


def test_kept_sets_equal_the_reference_per_row():
    rng = np.random.default_rng(0)
    settings = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 8, 0.6), (1.0, 1, 1.0), (2.0, 0, 0.05)]
    logits = rng.normal(size=(len(settings), 50)).astype(np.float32) * 3
    t, k, p = (np.array(col) for col in zip(*settings, strict=True))
    got = np.asarray(sampling.kept(jnp.asarray(logits), jnp.asarray(t, jnp.float32), jnp.asarray(k),
                                   jnp.asarray(p, jnp.float32)))
    for row, (temperature, top_k, top_p) in enumerate(settings):
        want = _reference_kept(logits[row], temperature, top_k, top_p)
        np.testing.assert_array_equal(got[row], want, err_msg=f"row {row}: {settings[row]}")
    assert got[4].sum() == 1 and got[0].all()


def test_draws_follow_the_renormalized_distribution():
    """20,000 draws of one row (top-k 3, temperature 0.7): frequencies within 4 standard errors of
    the renormalized probabilities, nothing outside the top 3."""
    logits = jnp.array([2.0, 1.5, 1.0, 0.5, -1.0])
    n = 20_000
    keys = jax.random.split(jax.random.key(0), n)
    tokens = jax.jit(sampling.sample)(jnp.tile(logits, (n, 1)), keys, jnp.full(n, 0.7), jnp.full(n, 3, jnp.int32),
                                      jnp.ones(n))
    freq = np.bincount(np.asarray(tokens), minlength=5) / n
    probs = np.asarray(jax.nn.softmax(logits[:3] / 0.7))
    assert freq[3:].sum() == 0
    np.testing.assert_array_less(np.abs(freq[:3] - probs), 4 * np.sqrt(probs * (1 - probs) / n))


def test_greedy_and_rows_independent_of_the_batch():
    logits = jax.random.normal(jax.random.key(1), (4, 32))
    keys = jax.random.split(jax.random.key(2), 4)
    temperature = jnp.array([0.0, 1.0, 0.0, 0.8])
    top_k, top_p = jnp.array([0, 0, 3, 10]), jnp.array([1.0, 0.9, 1.0, 0.95])
    tokens = np.asarray(sampling.sample(logits, keys, temperature, top_k, top_p))
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    for row in range(4):  # alone, with its own key, each row draws the same token
        alone = sampling.sample(logits[row:row + 1], keys[row:row + 1], temperature[row:row + 1],
                                top_k[row:row + 1], top_p[row:row + 1])
        assert int(alone[0]) == tokens[row]
    again = np.asarray(sampling.sample(logits, keys, temperature, top_k, top_p))
    np.testing.assert_array_equal(again, tokens)


@pytest.mark.parametrize("params,message", [
    (sampling.SamplingParams(temperature=-0.1), r"temperature: must be >= 0"),
    (sampling.SamplingParams(top_k=-1), r"top_k: must be an integer >= 0"),
    (sampling.SamplingParams(top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (sampling.SamplingParams(top_p=1.5), r"top_p: must be in \(0, 1\]"),
])
def test_bad_settings_are_one_line(params, message):
    with pytest.raises(ValueError, match=message):
        sampling.as_arrays([sampling.SamplingParams(), params])


def test_uncached_greedy_generation_is_the_argmax_of_each_full_forward():
    """`uncached.generate` at temperature 0, against a host loop that runs the tiny GPT on the
    growing sequence and takes each last position's argmax (past seq_len: the last window)."""
    cfg = gpt.GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64)
    params = jax.jit(gpt.make(cfg)[0])(jax.random.key(0))
    prompt = np.array([5, 17, 99, 3], np.int32)
    tokens = uncached.generate(cfg, params, jnp.asarray(prompt), 16, jax.random.key(1),
                               sampling.SamplingParams(temperature=0.0))
    forward = jax.jit(lambda p, x: gpt.GPT(cfg).apply({"params": p}, x))
    seq = list(prompt)
    for _ in range(16):
        window = np.zeros((1, cfg.seq_len), np.int32)
        recent = seq[-cfg.seq_len:]
        window[0, :len(recent)] = recent
        seq.append(int(np.argmax(forward(params, window)[0, len(recent) - 1])))
    np.testing.assert_array_equal(np.asarray(tokens), seq[len(prompt):])

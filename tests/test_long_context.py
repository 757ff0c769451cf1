"""Long sequences through the reference GPT: the compiled training step's temporaries
(``memory_analysis()``, one layer, one sequence per device, no remat) with blockwise attention
against naive, at T = 2048 and 4096: blockwise must stay O(T), naive grows with T^2; the
language-model loss in tiles equals the whole-logits loss."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzero
from jzero.analysis import estimate, profile
from jzero.models.gpt import cross_entropy
from jzero.models.tiles import mlp, tiled_cross_entropy, tiled_mlp

from helpers import ROOT, jzero_cli, read_csv


def _temp_bytes(implementation, seq_len):
    cfg = jzero.load_config({
        "train_batch_size": 1, "jzero": {
            "mesh": {"devices": 1}, "remat": "none",
            "model": {"n_layers": 1, "seq_len": seq_len, "attention": {"implementation": implementation}}}})
    return profile.memory(estimate.compile_step(cfg).compiled).temp


@pytest.fixture(scope="module")
def temps():
    return {(impl, t): _temp_bytes(impl, t) for impl in ("naive", "blockwise") for t in (2048, 4096)}


def test_blockwise_temporaries_are_a_fraction_of_naive_at_4096(temps):
    assert temps["blockwise", 4096] * 8 <= temps["naive", 4096], temps


def test_blockwise_temporaries_grow_linearly_naive_quadratically(temps):
    assert temps["blockwise", 4096] <= 2.3 * temps["blockwise", 2048], temps
    assert temps["naive", 4096] >= 3.5 * temps["naive", 2048], temps


def test_tiled_loss_equals_the_whole_logits_loss():
    """Tiles of 7 tokens over 2 x 20 (padding in the last tile), tied and untied heads: the same
    loss and gradients as the plain cross entropy of the full logits (rtol 1e-5)."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (2, 20, 16))
    targets = jax.random.randint(keys[1], (2, 20), 0, 50)
    for tied, weight, bias in ((True, jax.random.normal(keys[2], (50, 16)), None),
                               (False, jax.random.normal(keys[2], (16, 50)), jax.random.normal(keys[3], (50,)))):
        def whole(x, w, b, tied=tied):
            logits = x @ (w.T if tied else w) + (0 if b is None else b)
            return cross_entropy(logits, targets)

        def tiled(x, w, b, tied=tied):
            return tiled_cross_entropy(x, w, targets, bias=b, tied=tied, tile=7)

        want = jax.value_and_grad(whole, argnums=(0, 1, 2))(x, weight, bias)
        got = jax.jit(jax.value_and_grad(tiled, argnums=(0, 1, 2)))(x, weight, bias)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_tiled_mlp_equals_the_whole_mlp():
    """Tiles of 7 tokens over 2 x 20 (padding in the last tile): the feed-forward's values and
    gradients (input and both layers' params) equal the untiled ones (rtol 1e-5). In fp64: the
    bias gradients sum 40 terms of both signs, and fp32 summed in another order differs by more
    than 1e-5 of the small result."""
    keys = jax.random.split(jax.random.key(0), 6)
    with jax.enable_x64(True):
        def normal(key, shape, scale=1.0):
            return jax.random.normal(key, shape, jnp.float64) * scale

        x, weights = normal(keys[0], (2, 20, 16)), normal(keys[5], (2, 20, 16))
        fc = {"kernel": normal(keys[1], (16, 64), 0.25), "bias": normal(keys[2], (64,))}
        out = {"kernel": normal(keys[3], (64, 16), 0.125), "bias": normal(keys[4], (16,))}

        def loss(fn):
            return lambda x, fc, out: jnp.sum(fn(x, fc, out) * weights)

        want = jax.value_and_grad(loss(mlp), argnums=(0, 1, 2))(x, fc, out)
        got = jax.jit(jax.value_and_grad(loss(lambda *a: tiled_mlp(*a, tile=7)), argnums=(0, 1, 2)))(x, fc, out)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


def _long_config(implementation):
    raw = json.loads((ROOT / "configs" / "gpt_long.json").read_text())
    raw["jzero"]["model"]["attention"] = {"implementation": implementation}
    return jzero.load_config(raw, dp_size=2)


def test_estimate_says_what_attention_costs_and_what_blockwise_saved():
    """`jzero estimate` of configs/gpt_long.json: attention's share of the temporaries, and that
    naive attention would need >= 4x the per-device peak (what blockwise saved >= 3x the peak)."""
    row = estimate.estimate(_long_config("auto")).row()
    assert 0 < row["attention_temp_gib"] < row["peak_gib"], row
    assert row["saved_by_blockwise_attention_gib"] >= 3 * row["peak_gib"], row
    assert "saved_by_tiled_loss_gib" in row


@pytest.mark.slow
def test_the_long_context_config_trains(tmp_path):
    """`jzero train configs/gpt_long.json` (T = 4096, blockwise by auto) cut to its first 40 steps
    (all 120 take 2.5 minutes on 2 free cores, over 4 beside another test; by step 40 the held-out
    loss has fallen 45%): its summary shows attention's share of the temporaries, and its held-out
    loss falls by at least 30%."""
    proc = jzero_cli("train", "configs/gpt_long.json", "--out", str(tmp_path / "run"), "--steps", "40",
                     timeout=900, optimized=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "of which attention" in proc.stdout + proc.stderr  # the summary's share of the temporaries
    held_out = [float(r["eval_loss"]) for r in read_csv(tmp_path / "run" / "metrics.csv") if r["eval_loss"]]
    assert held_out[-1] <= 0.7 * held_out[0], held_out

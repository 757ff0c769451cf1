"""The reference Evoformer (`jzero.models.evoformer`): shapes, a finite loss and gradients
reaching every block; its pair-biased attention (MSA row attention, triangle attention) with
blockwise attention inside equal to naive attention, values and gradients, the pair bias's
included (rtol 1e-5); at crop 384 blockwise keeps the temporaries of row + triangle attention
>= 8x below naive (compiled programs); and under ZeRO stages 0-3 it equals the plain
single-device optax loop."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzero
from jzero import tasks
from jzero.config import AttentionConfig, ConfigError
from jzero.models import evoformer

from helpers import ROOT, init_on, jzero_cli, plain_loop, read_csv

TINY = dataclasses.replace(evoformer.SIZES["tiny"], crop=16, n_seq=2, c_m=16, c_z=8, msa_heads=2, msa_head_dim=4,
                           pair_heads=2, pair_head_dim=4, c_opm=4, c_tri=8)
STEPS = 6
FIXTURE = ROOT / "tests" / "data" / "protein"


def _batch(cfg, n=2, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.arange(cfg.crop)[None] < rng.integers(cfg.crop // 2, cfg.crop + 1, (n, 1))
    ss8 = np.where(mask & (rng.random((n, 1)) < 0.7), rng.integers(0, 8, (n, cfg.crop)), -1)
    pairs = mask[:, :, None] & mask[:, None] & (rng.random((n, 1, 1)) < 0.5)
    dist = np.where(pairs, rng.integers(0, 64, (n, cfg.crop, cfg.crop)), -1)
    prior = np.asarray(jax.nn.log_softmax(rng.normal(size=(n, cfg.crop, 64))), np.float32)
    return {"residues": rng.integers(0, 21, (n, cfg.crop)).astype(np.int32), "mask": mask.astype(np.float32),
            "separation_prior": prior, "ss8": ss8.astype(np.int32), "distogram": dist.astype(np.int32)}


def test_shapes_gradients_reach_every_block_and_padding_changes_nothing():
    """Shapes; zero heads give the uniform Q8 prediction and the separation prior as the
    distogram (each pair its separation's row); gradients reach every block; and what sits
    past a chain's end (masked residues) leaves the loss and every gradient bitwise unchanged:
    masks stop it in every attention, the outer product mean and the triangle updates."""
    init_fn, loss_fn = evoformer.make(TINY)
    params = jax.jit(init_fn)(jax.random.key(0))
    batch = _batch(TINY, 4)
    forward = jax.jit(evoformer.Evoformer(TINY).apply)
    ss, dist = forward({"params": params}, evoformer.inputs(batch))
    assert ss.shape == (4, 16, 8) and dist.shape == (4, 16, 16, 64)
    assert not np.asarray(ss).any()
    separation = np.abs(np.arange(16)[:, None] - np.arange(16))
    np.testing.assert_array_equal(np.asarray(dist), batch["separation_prior"][:, separation])
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(3), p.shape), params)
    grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b, jax.random.key(0))[0]))
    value, grads = grad(params, batch)
    assert np.isfinite(value) and value > np.log(8)
    for path, g in jax.tree_util.tree_leaves_with_path(grads["blocks"]):
        name = jax.tree_util.keystr(path)
        # Zero by design: the MSA holds n_seq copies of one sequence, so column attention's keys
        # are equal and its scores constant whatever q and k are.
        if re.search(r"msa_column.*\['[qk]'\]", name):
            assert float(jnp.abs(g).max()) == 0, name
        else:
            assert float(jnp.abs(g).max()) > 0, name
    other = dict(batch, residues=np.where(batch["mask"] > 0, batch["residues"], (batch["residues"] + 7) % 21))
    assert (other["residues"] != batch["residues"]).sum() >= 8
    value2, grads2 = grad(params, other)
    assert float(value) == float(value2)
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["pair", pytest.param("self", marks=pytest.mark.slow)])
def test_pair_biased_attention_blockwise_equals_naive(kind):
    """MSA row attention (bias from the pair) and triangle attention (bias from its own input):
    values and gradients of params, input and pair (through the bias) agree, padding masked:
    rtol 1e-5, atol 1e-6 of each array's largest element (a weight's gradient sums thousands of
    rows, and an element that cancels to near zero keeps the fp32 rounding of its larger terms,
    summed in blocks by one implementation and in one pass by the other)."""
    rows = 3 if kind == "pair" else 40
    x = jax.random.normal(jax.random.key(1), (2, rows, 40, 16))
    pair = jax.random.normal(jax.random.key(2), (2, 40, 40, 8)) if kind == "pair" else None
    mask = jnp.broadcast_to((jnp.arange(40) < 33).astype(jnp.float32), (2, rows, 40))
    out = {}
    for impl in ("naive", "blockwise"):
        cfg = dataclasses.replace(TINY, attention=AttentionConfig(implementation=impl, block_q=16, block_k=16))
        module = evoformer.GatedAttention(cfg, 2, 4, kind)
        params = module.init(jax.random.key(0), x, mask, pair)["params"]

        def f(params, x, pair, module=module):
            return jnp.sum(jnp.sin(module.apply({"params": params}, x, mask, pair)))

        out[impl] = jax.value_and_grad(f, argnums=(0, 1, 2))(params, x, pair)
    assert float(jnp.abs(out["naive"][1][0]["pair_bias"]["kernel"]).max()) > 0  # the bias's gradient is tested
    got = jax.tree_util.tree_leaves_with_path(out["blockwise"])
    for (path, a), b in zip(got, jax.tree.leaves(out["naive"]), strict=True):
        if "ln_pair" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            # Zero by symmetry: it shifts every score of a row alike, which softmax ignores.
            assert max(float(jnp.abs(a).max()), float(jnp.abs(b).max())) < 1e-5
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))


def _attention_temp_bytes(implementation):
    """Temporaries of one block's MSA row attention (8 sequences) + triangle attention (starting
    node) at crop 384, forward and backward, tiny channels."""
    L, n = 384, 8
    settings = dataclasses.replace(evoformer.BLOCKS, implementation=implementation)
    cfg = dataclasses.replace(TINY, crop=L, attention=settings)
    row = evoformer.GatedAttention(cfg, 2, 8, "pair")
    tri = evoformer.GatedAttention(cfg, 2, 8, "self")
    m, z = jnp.zeros((1, n, L, 16)), jnp.zeros((1, L, L, 8))
    msa_mask, pair_mask = jnp.ones((1, n, L)), jnp.ones((1, L, L))
    params = {"row": row.init(jax.random.key(0), m, msa_mask, z)["params"],
              "tri": tri.init(jax.random.key(0), z, pair_mask)["params"]}

    def f(params, m, z):
        dm = row.apply({"params": params["row"]}, m, msa_mask, z)
        dz = tri.apply({"params": params["tri"]}, z, pair_mask)
        return jnp.sum(dm) + jnp.sum(dz)

    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(params, m, z).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_blockwise_cuts_row_and_triangle_attention_temporaries_8x_at_crop_384():
    naive, blockwise = _attention_temp_bytes("naive"), _attention_temp_bytes("blockwise")
    assert blockwise * 8 <= naive, (blockwise, naive)


def test_config_keys_and_one_line_errors():
    def build(**model):
        return evoformer.evoformer_config(jzero.load_config(
            {"train_batch_size": 8, "jzero": {"model": {"name": "evoformer", **model}}}, dp_size=8))

    assert build(size="af2").n_layers == 48 and build(crop=32).crop == 32
    with pytest.raises(ConfigError, match=r"jzero.model.crop: 4096 residues is longer than the Evoformer allows"):
        build(crop=4096)
    with pytest.raises(ConfigError, match=r"jzero.model.d_ff: the evoformer model has no such setting"):
        build(d_ff=64)
    with pytest.raises(ConfigError, match=r"jzero.model.c_z: must be >= 1"):
        build(c_z=0)


def _rows(ndev, accum):
    """The global batch: 8 rows, or one a device per micro-batch where that is more."""
    return max(8, ndev * accum)


@functools.cache
def reference(ndev, accum):
    batches = [_batch(TINY, _rows(ndev, accum), seed) for seed in range(STEPS)]

    def split(b):
        return jax.tree.map(lambda x: x.reshape(ndev, accum, -1, *x.shape[1:]).swapaxes(0, 1)
                            .reshape(ndev * accum, -1, *x.shape[1:]), b)

    return plain_loop(*evoformer.make(TINY), batches, split)[0], batches


# One case by default (stage 3 at 2 devices with accumulation: the hooks and the micro-batch
# loop); the slow suite runs stages 0-3 x 8 and 2 devices x accumulation 1 and 4.
CASES = [(3, 2, 4)]
MATRIX = [(s, n, a) for s in (0, 1, 2, 3) for n in (8, 2) for a in (1, 4)]


@pytest.mark.parametrize("stage,ndev,accum", [
    pytest.param(*case, id="zero{}-{}dev-accum{}".format(*case), marks=() if case in CASES else pytest.mark.slow)
    for case in MATRIX])
def test_matches_plain_optax_loop(stage, ndev, accum):
    state = init_on(*evoformer.make(TINY), stage, ndev, accum, _rows(ndev, accum))
    want, batches = reference(ndev, accum)
    losses = []
    for batch in batches:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want, rtol=1e-5)


@pytest.mark.slow
def test_jzero_train_on_the_fixture_logs_metrics_beside_baselines(tmp_path):
    """`jzero train configs/evoformer_tiny.json` on the committed fixture (no extra install): the
    held-out metrics and their baselines reach metrics.csv and the summary, and the preview shows
    a held-out chain's true and predicted secondary structure."""
    proc = jzero_cli("train", "configs/evoformer_tiny.json", "--out", str(tmp_path / "run"), "--steps", "6",
                     "--set", f"jzero.data.path={FIXTURE}", "--set", "jzero.train.eval_interval=3", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in read_csv(tmp_path / "run" / "metrics.csv") if r["q3_accuracy"]]
    assert [int(r["step"]) for r in rows] == [1, 3, 6]
    for name in tasks.PROTEIN_METRICS:
        assert 0 <= float(rows[-1][name]) < 20, name
    assert float(rows[-1]["distogram_loss"]) < float(rows[0]["distogram_loss"])
    out = proc.stdout + proc.stderr
    assert "held-out q3_majority" in out and re.search(r"\ntrue +[HEC]+\npredicted +[HEC]+", out)

"""Mixture-of-Experts (`jzero.models.gating`, `jzero.models.moe`): the gates equal DeepSpeed's own (a golden
file recorded from ``deepspeed.moe.sharded_moe``) and hand-derived fixtures; the MoE GPT with
expert parallelism 1/2/4/8 at every ZeRO stage equals a single-device loop of the same math;
expert params take 1/ep_size of the bytes; each MoE layer moves its tokens with two all-to-alls
of E x C x d elements."""
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jzero
from jzero.analysis import profile
from jzero.config import ConfigError
from jzero.models import gating, gpt, moe
from jzero.zero import phase
from jzero.zero.sharding import ZERO_RULES

from helpers import EPS, LR, WD, assert_params_close, jzero_cli, plain_loop, read_csv, row_blocks, token_batches

GOLDEN = Path(__file__).resolve().parent / "golden" / "gating" / "deepspeed_gating.json"


def combine(r: gating.Routing) -> np.ndarray:
    """DeepSpeed's combine weights (S, E, C) from a Routing."""
    slots = jax.nn.one_hot(r.slot, r.capacity) * r.kept[..., None]
    return np.asarray(slots * r.weight[..., None])


def deterministic(num_experts, k, cf=1.0, min_capacity=4, drop_tokens=True, **kw):
    return gating.GateSpec(num_experts=num_experts, k=k, capacity_factor=cf, min_capacity=min_capacity,
                           drop_tokens=drop_tokens, use_rts=False, top2_2nd_expert_sampling=False, **kw)


# ---------------------------------------------------------------------------------------------
# Gating
# ---------------------------------------------------------------------------------------------
CASES = json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_gate_equals_deepspeed(case):
    logits = np.asarray(case["logits"], np.float32)
    spec = deterministic(logits.shape[1], case["k"], case["capacity_factor"], case["min_capacity"],
                         case["drop_tokens"])
    r = gating.route(jnp.asarray(logits), spec, None, training=True)
    ours, theirs = combine(r), np.asarray(case["combine"], np.float32)
    c = theirs.shape[2]
    if case["drop_tokens"]:
        assert r.capacity == c
    else:  # DeepSpeed sizes C to the largest count; ours is its static bound S, the rest empty
        assert r.capacity == logits.shape[0] >= c and not ours[:, :, c:].any()
    np.testing.assert_allclose(float(r.aux_loss), case["l_aux"], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(r.counts), case["exp_counts"])
    if case["k"] == 1 and (np.asarray(case["exp_counts"]) > c).any():
        # Over capacity, DeepSpeed's top-1 without RTS keeps the C tokens torch.topk returns among
        # equal (0/1) scores, an unspecified order; jzero keeps the first C by position. The same
        # number is kept per expert, each at its gate probability, in slots 0.. by position.
        np.testing.assert_array_equal((ours > 0).sum((0, 2)), (theirs > 0).sum((0, 2)))
        np.testing.assert_allclose(ours.sum(2).max(1)[ours.sum((1, 2)) > 0],
                                   jax.nn.softmax(logits, axis=1).max(1)[ours.sum((1, 2)) > 0], rtol=1e-6)
        both = (ours.sum(2) > 0) & (theirs.sum(2) > 0)
        np.testing.assert_allclose(ours.sum(2)[both], theirs.sum(2)[both], rtol=1e-6)
    else:
        np.testing.assert_allclose(ours[:, :, :c], theirs, rtol=1e-6, atol=1e-7)


def test_golden_cases_drop_tokens():
    """Negative control for the golden: every gate drops routes over capacity in some case (there
    is something to get wrong), and the drop_tokens = False cases drop none."""
    dropping = {c["k"] for c in CASES if c["drop_tokens"]
                and np.count_nonzero(np.asarray(c["combine"])) < c["k"] * len(c["logits"])}
    assert dropping == {1, 2, 3}
    for c in CASES:
        if not c["drop_tokens"]:
            assert np.count_nonzero(np.asarray(c["combine"])) == c["k"] * len(c["logits"])


# Six tokens, two experts: tokens 0, 1, 2, 4 prefer expert 0, tokens 3 and 5 expert 1.
HAND = np.log(np.array([[3, 1], [3, 1], [4, 1], [1, 2], [1.5, 1], [1, 4]], np.float32))


def test_top1_by_hand():
    gates = np.exp(HAND.astype(np.float64))
    gates /= gates.sum(1, keepdims=True)
    # capacity = ceil(6 / 2 x 1.0) = 3: expert 0 keeps tokens 0, 1, 2 by position; token 4 is dropped.
    r = gating.route(jnp.asarray(HAND), deterministic(2, 1, min_capacity=1), None, training=True)
    assert r.capacity == 3
    np.testing.assert_array_equal(np.asarray(r.kept), [[1, 0], [1, 0], [1, 0], [0, 1], [0, 0], [0, 1]])
    np.testing.assert_array_equal(np.asarray(r.slot)[[0, 1, 2, 3, 5], [0, 0, 0, 1, 1]], [0, 1, 2, 0, 1])
    np.testing.assert_allclose(np.asarray(r.weight).sum(1), [0.75, 0.75, 0.8, 2 / 3, 0, 0.8], rtol=1e-6)
    me, ce = gates.mean(0), np.array([4, 2]) / 6
    np.testing.assert_allclose(float(r.aux_loss), 2 * np.sum(me * ce), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(r.counts), [4, 2])
    # drop_tokens = False: nothing dropped, the same weights for the kept tokens.
    keep_all = gating.route(jnp.asarray(HAND), deterministic(2, 1, min_capacity=1, drop_tokens=False), None, True)
    assert np.asarray(keep_all.kept).sum() == 6 and keep_all.capacity == 6
    np.testing.assert_allclose(np.asarray(keep_all.weight)[4, 0], 0.6, rtol=1e-6)


def test_top2_by_hand():
    """Capacity ceil(6 / 2 x 2 x 0.5) = 3; first choices fill the slots before second choices,
    and a token whose second choice is dropped keeps its first at full weight."""
    r = gating.route(jnp.asarray(HAND), deterministic(2, 2, cf=0.5, min_capacity=1), None, training=True)
    assert r.capacity == 3
    kept = np.asarray(r.kept)
    # expert 0: first choices of 0, 1, 2 (slots 0-2); token 4's first choice is over capacity.
    # expert 1: first choices of 3, 5 (slots 0, 1), then second choices by position: token 0 (slot 2);
    # token 4 loses both (its second choice comes after token 1's and 2's).
    np.testing.assert_array_equal(kept, [[1, 1], [1, 0], [1, 0], [0, 1], [0, 0], [0, 1]])
    np.testing.assert_array_equal(np.asarray(r.slot)[0], [0, 2])
    np.testing.assert_allclose(np.asarray(r.weight)[0], [0.75, 0.25], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.weight)[1], [1.0, 0.0], rtol=1e-6)  # renormalised over kept
    gates = np.exp(HAND.astype(np.float64))
    gates /= gates.sum(1, keepdims=True)
    np.testing.assert_allclose(float(r.aux_loss), 4 * np.mean(gates.mean(0) * np.array([4, 2]) / 6), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(r.counts), [6, 6])


def test_random_token_selection_keeps_capacity_tokens_at_random():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)) + jnp.array([3., 0, 0, 0])
    spec = gating.GateSpec(num_experts=4, k=1, capacity_factor=1.0, min_capacity=1)
    picks = [gating.route(logits, spec, jax.random.key(s), training=True) for s in range(3)]
    first_come = gating.route(logits, spec, None, training=True)
    for r in picks:
        kept = np.asarray(r.kept)
        np.testing.assert_array_equal(kept.sum(0), np.minimum(np.asarray(r.counts), r.capacity))
        for e in range(4):  # the kept tokens fill slots 0.. in position order
            np.testing.assert_array_equal(np.asarray(r.slot)[kept[:, e], e], np.arange(kept[:, e].sum()))
    sets = {tuple(np.flatnonzero(np.asarray(r.kept)[:, 0])) for r in picks}
    assert len(sets) == 3 and tuple(np.flatnonzero(np.asarray(first_come.kept)[:, 0])) == tuple(range(16))


def test_capacity_uses_deepspeeds_float32_rule():
    assert gating.capacity(16, 4, 1.0, 2) == 4 and gating.capacity(16, 4, 0.25, 3) == 3
    assert gating.capacity(13, 3, 1.3, 1) == math.ceil(np.float32(13 / 3) * np.float32(1.3)) == 6


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------
SPEC = moe.MoESpec(gate=deterministic(4, 2, cf=1.0, min_capacity=1), d_model=8, d_ff=16, use_residual=True)


def test_nnx_layer_is_the_linen_layer():
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    linen = moe.MoE(SPEC)
    params = linen.init({"params": jax.random.key(0)}, x)["params"]
    layer = moe.NNXMoE(SPEC, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param))) == jax.tree.map(jnp.shape, params)
    state = nnx.state(layer, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(layer, state)
    y_nnx, stats_nnx = layer(x)
    y_linen, stats_linen = linen.apply({"params": params}, x)
    np.testing.assert_allclose(y_nnx, y_linen, rtol=1e-6)
    np.testing.assert_allclose(stats_nnx.aux_loss, stats_linen.aux_loss, rtol=1e-6)


def test_evaluation_uses_eval_capacity_factor():
    spec = moe.MoESpec(gate=gating.GateSpec(num_experts=4, capacity_factor=0.25, eval_capacity_factor=4.0,
                                            min_capacity=1, use_rts=False), d_model=8, d_ff=16)
    x = jax.random.normal(jax.random.key(1), (4, 8, 8))
    params = moe.MoE(spec).init({"params": jax.random.key(0)}, x)["params"]
    _, train = moe.MoE(spec).apply({"params": params}, x)
    with phase.evaluating():
        _, evaluation = moe.MoE(spec).apply({"params": params}, x)
    assert float(train.dropped) > 0.3 and float(evaluation.dropped) == 0.0


# ---------------------------------------------------------------------------------------------
# The MoE GPT under the step
# ---------------------------------------------------------------------------------------------
STEPS, BATCH = 10, 32
MOE = {"num_experts": 8, "k": 2, "capacity_factor": 1.0, "min_capacity": 1, "use_residual": True, "use_rts": False,
       "top2_2nd_expert_sampling": False, "aux_loss_coef": 0.01}


def moe_config(stage, ep, accum=1, ndev=8, remat="full", hpz=1, **moe_keys):
    return jzero.load_config({
        "train_batch_size": BATCH, "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "zero_hpz_partition_size": hpz},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
        "gradient_clipping": 0.0, "moe": {**MOE, "ep_size": ep, **moe_keys},
        "jzero": {"remat": remat, "model": {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2,
                                            "n_heads": 2, "d_ff": 64}}}, dp_size=ndev)


def gpt_fns(config):
    return gpt.make(gpt.gpt_config(config.jzero.model, config.jzero.remat, config))


@functools.cache
def reference(groups):
    """The plain loop on the loss of each gating group (one device's rows of one micro-batch in
    the step: ``groups`` contiguous blocks of rows), averaged."""
    return plain_loop(*gpt_fns(moe_config(0, 1)), token_batches(STEPS, BATCH, 16, 64), row_blocks(groups))


# ep 1/2/4/8 x stages 0-3 on 8 devices; four in the default suite (every ep and stage once,
# one with accumulation), the other twelve in the slow suite.
FAST = [(0, 1, 1), (1, 2, 2), (2, 4, 1), (3, 8, 1)]
MATRIX = [(s, ep, 2 if (s, ep) in ((1, 2), (3, 2)) else 1) for s in (0, 1, 2, 3) for ep in (1, 2, 4, 8)]


@pytest.mark.parametrize("stage,ep,accum", [
    pytest.param(*c, id="zero{}-ep{}-accum{}".format(*c), marks=() if c in FAST else pytest.mark.slow)
    for c in MATRIX])
def test_moe_gpt_matches_single_device_loop(stage, ep, accum):
    cfg = moe_config(stage, ep, accum)
    init_fn, loss_fn = gpt_fns(cfg)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    fc = state.params["blocks"]["stacked"]["moe_block"]["moe"]["experts"]["fc"]["kernel"]
    assert fc.addressable_shards[0].data.shape[1] == 8 // ep  # E / ep_size experts per device
    losses = []
    for batch in token_batches(STEPS, BATCH, 16, 64):
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_losses, ref_params = reference(8 * accum)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(assert_params_close, jax.device_get(state.params), ref_params)
    assert losses[-1] < losses[0] and 0 < float(metrics["aux"]["moe_dropped"]) < 0.5


def test_bad_ep_size_for_the_devices_is_one_line():
    with pytest.raises(ConfigError, match=r"moe.ep_size: 4 does not divide the 2 devices of the mesh$"):
        jzero.make_mesh(moe_config(0, 4, ndev=2), devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match=r"moe.ep_size: 4 does not divide the ZeRO group of 2 devices"):
        jzero.make_mesh(moe_config(0, 4, hpz=2))


# ---------------------------------------------------------------------------------------------
# Memory and communication, from the compiled step
# ---------------------------------------------------------------------------------------------
@functools.cache
def compiled_step(stage, ep, remat="full", bf16=False):
    cfg = moe_config(stage, ep, remat=remat)
    if bf16:
        cfg = jzero.load_config({**cfg.source, "bf16": {"enabled": True}})
    init_fn, loss_fn = gpt_fns(cfg)
    state = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, mesh=jzero.make_mesh(cfg))
    batch = {k: jax.ShapeDtypeStruct((BATCH, 16), jnp.int32, sharding=state.plan.batch) for k in ("inputs", "targets")}
    return jzero.train_step.lower(state, batch).compile(), state


def param_counts(state):
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    expert = sum(math.prod(x.shape) for p, x in leaves if "experts" in jax.tree_util.keystr(p))
    return expert, sum(math.prod(x.shape) for _, x in leaves) - expert


@pytest.mark.parametrize("stage,ep", [(0, 2), (1, 8), (3, 4)])
def test_expert_params_take_one_ep_size_th_of_the_bytes(stage, ep):
    """Expert leaves: E / ep_size experts per device, ZeRO-sharded further over the 8 / ep_size
    devices holding the same experts; the rest per the ZeRO table over all 8 devices."""
    compiled, state = compiled_step(stage, ep)
    report = profile.memory(compiled)
    expert, other = param_counts(state)
    rule = ZERO_RULES[stage]

    def shards(sharded, experts):
        return (ep if experts else 1) * (8 // ep if experts else 8) ** sharded

    assert report.expert_params == pytest.approx(4 * expert / shards(rule.params, True), rel=0.02)
    assert report.params - report.expert_params == pytest.approx(4 * other / shards(rule.params, False), rel=0.02)
    assert report.expert_opt_state == pytest.approx(8 * expert / shards(rule.opt_state, True), rel=0.02)
    assert report.opt_state - report.expert_opt_state == pytest.approx(8 * other / shards(rule.opt_state, False),
                                                                       rel=0.02)


@pytest.mark.parametrize("ep,bf16", [(2, False), (8, True)])
def test_two_all_to_alls_per_moe_layer_forward_and_their_transposes(ep, bf16):
    """Without remat: 2 forward + 2 backward per MoE layer, each the (E, C, d) buffer of one
    device in the compute dtype (bf16 as its 16 bits: XLA:CPU would widen a bf16 all-to-all)."""
    compiled, state = compiled_step(2, ep, remat="none", bf16=bf16)
    a2a = [c for c in profile.comm(compiled).collectives if c.kind == "all-to-all"]
    tokens = BATCH // 8 * 16  # one device's rows x seq_len: its gating group
    capacity = gating.capacity(tokens, 8, 2 * MOE["capacity_factor"], MOE["min_capacity"])
    assert sum(c.count for c in a2a) == 4 * 2  # 2 MoE layers
    assert all(c.group_size == ep and c.elements == 8 * capacity * 32 for c in a2a)
    assert {c.dtype for c in a2a} == ({"u16"} if bf16 else {"f32"})
    control, _ = compiled_step(2, 1, remat="none")  # no expert parallelism: nothing moves
    assert not [c for c in profile.comm(control).collectives if c.kind == "all-to-all" and c.group_size > 1]


def test_full_remat_recomputes_the_forward_all_to_alls():
    compiled, _ = compiled_step(2, 2, remat="full")
    assert sum(c.count for c in profile.comm(compiled).collectives if c.kind == "all-to-all") == 6 * 2


# ---------------------------------------------------------------------------------------------
# Checkpoints restore onto another expert-parallel size
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # three compiled steps and an Orbax save / restore
def test_checkpoint_restores_onto_another_ep_size_and_continues(tmp_path):
    from jzero.runtime.checkpoint import Checkpointer

    batches = token_batches(4, BATCH, 16, 64)
    cfg = moe_config(1, 2)
    init_fn, loss_fn = gpt_fns(cfg)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    for batch in batches[:3]:
        state, _ = jzero.train_step(state, batch)
    with Checkpointer(tmp_path, cfg) as ckpt:
        assert ckpt.save(state, force=True)
    saved = jax.device_get(state.params)
    _, metrics = jzero.train_step(state, batches[3])
    other = moe_config(3, 8)
    target = jzero.abstract_init(init_fn, other, loss_fn=loss_fn, mesh=jzero.make_mesh(other))
    restored = Checkpointer(tmp_path).restore(target)
    fc = restored.params["blocks"]["stacked"]["moe_block"]["moe"]["experts"]["fc"]["kernel"]
    assert fc.sharding.spec == target.plan.params["blocks"]["stacked"]["moe_block"]["moe"]["experts"]["fc"][
        "kernel"].spec and fc.addressable_shards[0].data.shape[1] == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), saved)
    _, again = jzero.train_step(restored, batches[3])
    np.testing.assert_allclose(float(again["loss"]), float(metrics["loss"]), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# NNX under the step; the demo config trains
# ---------------------------------------------------------------------------------------------
class NNXMoEModel(nnx.Module):
    """Embed -> one MoE layer (residual) -> head, in NNX: the layer's experts are split over
    "expert" by the step exactly as the Linen GPT's are."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 8, rngs=rngs)
        self.moe = moe.NNXMoE(SPEC, rngs=rngs)
        self.head = nnx.Linear(8, 64, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        y, stats = self.moe(x)
        return self.head(x + y), stats


def nnx_loss(out, batch):
    logits, stats = out
    return gpt.cross_entropy(logits, batch["targets"]) + 0.01 * stats.aux_loss


def test_nnx_moe_model_under_the_step_matches_single_device_loop():
    init_fn, loss_fn = jzero.from_nnx(NNXMoEModel, nnx_loss)
    cfg = moe_config(3, 4)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    assert state.params["moe"]["experts"]["fc"]["kernel"].addressable_shards[0].data.shape[0] == 1
    batches = token_batches(3, BATCH, 16, 64)
    ref_losses, ref_params = plain_loop(init_fn, loss_fn, batches, row_blocks(8))
    for batch, ref in zip(batches, ref_losses, strict=True):
        state, metrics = jzero.train_step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), ref, rtol=1e-5)
    jax.tree.map(assert_params_close, jax.device_get(state.params), ref_params)


@pytest.mark.slow  # the demo config end to end, 600 steps: about 75 s on 2 cores (XLA's full pipeline)
def test_cli_trains_the_moe_demo_balanced(tmp_path):
    proc = jzero_cli("train", "configs/gpt_moe_tiny.json", "--out", str(tmp_path), "--no-resume", timeout=600,
                     optimized=True)
    assert proc.returncode == 0, proc.stderr
    rows = read_csv(tmp_path / "metrics.csv")
    evals = [float(r["eval_loss"]) for r in rows if r["eval_loss"]]
    assert evals[-1] <= 0.6 * evals[0]  # held-out loss falls by 40% or more
    assert float(rows[-1]["moe_load"]) <= 1.5 and float(rows[-1]["moe_dropped"]) < 0.1
    assert "moe_load" in proc.stdout


@pytest.mark.slow  # an AOT compile of a 4.1B-param MoE model for 64 devices: about 15 s
def test_estimate_of_the_moe_planning_config_splits_experts_and_matches_formulas():
    proc = jzero_cli("estimate", "configs/gpt_moe_1.3b.json", "--devices", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)["stages"][0]
    assert row["persistent_bytes_per_param"] == pytest.approx(row["jzero_formula_bytes_per_param"], rel=0.02)
    assert row["comm_elements_per_param"] == pytest.approx(row["deepspeed_comm_per_param"], rel=0.02)
    layers, experts, tokens, d = 12, 8, 4 * 2048, 2048  # 24 layers, every other one MoE; 4 rows of 2048
    expert_params = layers * experts * (2 * d * 4 * d + 4 * d + d)  # fc, out kernels and biases
    assert row["expert_params_gib"] * 2**30 == pytest.approx(4 * expert_params / 8, rel=0.02)  # fp32 / ep_size 8
    assert row["all_to_alls_per_step"] == layers * 6  # 2 forward, 2 recomputed (remat full), 2 backward
    capacity = gating.capacity(tokens, experts, 1.0, 4)
    assert row["all_to_all_gib"] * 2**30 == layers * 6 * experts * capacity * d * 2  # bf16

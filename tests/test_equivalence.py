"""Every ZeRO stage, device count and accumulation setting reproduces a plain single-device
jit + optax loop (docs/design.md, "Tests"): losses rtol 1e-5, params rtol 1e-4, fp32, 10 AdamW steps."""
import functools

import jax
import numpy as np
import pytest

import jzero

from helpers import BATCH, EPS, LR, MODELS, WD, assert_params_close, config, reference


@functools.cache
def run(model, stage, ndev, accum):
    """Train with jzero; returns (losses, final params on host, specs after init, final state)."""
    make_fns, make_batches = MODELS[model]
    init_fn, loss_fn = make_fns()
    cfg = config(stage, accum)
    mesh = jzero.make_mesh(cfg, devices=jax.devices()[:ndev])
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=mesh)
    init_specs = jax.tree.map(lambda x: x.sharding.spec, (state.params, state.opt_state))
    losses = []
    for batch in make_batches():
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params), init_specs, state


CASES = [(m, s, n, a) for m in MODELS for s in (0, 1, 2, 3) for n in (8, 2, 1) for a in (1, 4)]


@pytest.mark.parametrize("model,stage,ndev,accum", CASES,
                         ids=[f"{m}-zero{s}-{n}dev-accum{a}" for m, s, n, a in CASES])
def test_matches_plain_optax_loop(model, stage, ndev, accum):
    ref_losses, ref_params = reference(model)
    losses, params, _, _ = run(model, stage, ndev, accum)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(assert_params_close, params, ref_params)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_keeps_plan_sharding(stage):
    """After init and after steps, every params / opt_state leaf has exactly the Plan's spec."""
    _, _, init_specs, state = run("gpt", stage, 8, 4)
    plan = state.plan
    want = jax.tree.map(lambda s: s.spec, (plan.params, plan.opt_state))
    after = jax.tree.map(lambda x: x.sharding.spec, (state.params, state.opt_state))
    assert jax.tree.structure(want) == jax.tree.structure(after)
    for w, i, a in zip(jax.tree.leaves(want), jax.tree.leaves(init_specs), jax.tree.leaves(after), strict=True):
        assert i == w and a == w, (w, i, a)
    sharded = [s for s in jax.tree.leaves(want[0]) if "fsdp" in tuple(s)]
    assert bool(sharded) == (stage == 3)
    opt_sharded = [s for s in jax.tree.leaves(want[1]) if "fsdp" in tuple(s)]
    assert bool(opt_sharded) == (stage >= 1)


def test_stage3_params_hold_one_nth_per_device():
    _, _, _, state = run("gpt", 3, 8, 4)
    for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.plan.params), strict=True):
        if "fsdp" in tuple(s.spec):
            shards = x.addressable_shards
            assert len(shards) == 8
            assert all(sh.data.size * 8 == x.size for sh in shards)
            assert len({str(sh.index) for sh in shards}) == 8  # eight distinct slices, no duplicates


def test_hpz_shards_inside_groups_of_4_and_trains_like_fsdp_8():
    """zero_hpz_partition_size 4 on 8 devices (mesh replica 2 x fsdp 4), stage 3: the losses of
    ZeRO-3 over all 8, params all-gathered and grads reduce-scattered only inside each group of
    4, and gradients summed across the 2 groups by an all-reduce over pairs."""
    from jzero.analysis import profile

    make_fns, make_batches = MODELS["gpt"]
    init_fn, loss_fn = make_fns()
    cfg = jzero.load_config({
        "train_batch_size": BATCH, "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0, "zero_hpz_partition_size": 4},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
        "gradient_clipping": 0.0})
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    assert dict(state.plan.mesh.shape) == {"stage": 1, "replica": 2, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 1}
    batches = make_batches()
    report = profile.comm(jzero.train_step.lower(state, batches[0]).compile())
    losses = []
    for batch in batches:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, run("gpt", 3, 8, 1)[0], rtol=1e-5)
    quads, pairs = ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))
    moving = [c for c in report.collectives if c.group_size > 1]
    gathers = [c for c in moving if c.kind == "all-gather"]
    scatters = [c for c in moving if c.kind == "reduce-scatter"]
    assert gathers and scatters
    assert all(c.groups == quads for c in gathers + scatters), [(c.kind, c.groups) for c in gathers + scatters]
    assert any(c.kind == "all-reduce" and c.groups == pairs for c in moving)


@pytest.mark.parametrize("stage,accum", [(2, 1), (0, 2)])
def test_stacked_params_used_outside_scan_layers_are_refused(stage, accum):
    """The step hands leaves under a "stacked" key to scan_layers' hooks; a loss that reads them
    directly would get no gradient, so the step refuses it (stage 0 without accumulation has no
    hooks and trains it)."""
    import jax.numpy as jnp

    def loss_fn(params, batch, rng):
        return jnp.mean((batch["x"] @ params["stacked"][0]) ** 2)

    cfg = jzero.load_config({"train_batch_size": BATCH, "gradient_accumulation_steps": accum,
                             "zero_optimization": {"stage": stage}})
    state = jzero.init(lambda rng: {"stacked": jnp.ones((2, 8, 8))}, cfg, loss_fn=loss_fn, rng=0)
    batch = {"x": np.ones((BATCH, 8), np.float32)}
    with pytest.raises(ValueError, match="'stacked' key must be used through jzero.scan_layers"):
        jzero.train_step(state, batch)
    plain = jzero.init(lambda rng: {"stacked": jnp.ones((2, 8, 8))}, config(0, 1), loss_fn=loss_fn, rng=0)
    assert np.isfinite(float(jzero.train_step(plain, batch)[1]["loss"]))

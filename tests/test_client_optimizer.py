"""Client optimizers (DeepSpeed's ``optimizer=``): ``jzero.init(..., tx=...)`` takes any optax
transformation. optax.adamw equals the config's AdamW; Lion, Adafactor and a hand-built chain
equal their plain single-device loops at every stage; their param-shaped state takes the
param's ZeRO layout (compiled bytes); fp16, clipping, accumulation and offload work with them;
two optimizers are one clear error."""
import functools

import jax
import numpy as np
import optax
import pytest

import jzero
from jzero.analysis import profile
from jzero.config import ConfigError

from helpers import BATCH, EPS, LR, MODELS, WD, optax_loop

N = 8
MASK = {"w1": True, "b1": False, "w2": True, "b2": False}  # decay the matrices only
CLIENTS = {
    "lion": lambda: optax.lion(LR, weight_decay=WD),
    # Factored second moments (min_dim_size_to_factor 8): v_row and v_col are not shaped like
    # their params, so they stay replicated while v of the unfactored leaves is sharded.
    "adafactor": lambda: optax.adafactor(10 * LR, min_dim_size_to_factor=8),
    # not a GradientTransformation itself: what Flax users pass for accumulation in the optimizer
    "multisteps": lambda: optax.MultiSteps(optax.adamw(LR, eps=EPS, weight_decay=WD), every_k_schedule=2),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(eps=EPS),
                                 optax.add_decayed_weights(WD, mask=MASK), optax.scale(-LR)),
}


def config(stage, accum=1, **extra):
    return jzero.load_config({"train_batch_size": BATCH, "gradient_accumulation_steps": accum,
                              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                              "gradient_clipping": 0.0, **extra})


def train(cfg, tx=None, steps=None):
    """(losses, final state, lr metrics) of the MLP under ``cfg`` and the client ``tx``."""
    make_fns, make_batches = MODELS["mlp"]
    init_fn, loss_fn = make_fns()
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), tx=tx)
    losses, lrs = [], []
    for batch in (make_batches() * 2)[:steps]:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        lrs.append(metrics.get("lr"))
    return np.array(losses), state, lrs


@functools.cache
def plain(name):
    """The plain loop: one device, the whole batch, the same optax transformation."""
    return optax_loop("mlp", CLIENTS[name]())


def test_optax_adamw_equals_the_config_adamw():
    """Same hyperparameters, 20 steps: the losses agree bit for bit (the config's AdamW is
    optax.adamw under inject_hyperparams, betas kept as Python floats; it reports the lr, the
    bare client does not)."""
    adam = {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": WD}}
    ours, _, lrs = train(config(3, optimizer=adam))
    client, _, client_lrs = train(config(3), tx=optax.adamw(LR, eps=EPS, weight_decay=WD))
    np.testing.assert_array_equal(client, ours)
    assert all(lr is not None for lr in lrs) and all(lr is None for lr in client_lrs)
    _, _, injected = train(config(3), tx=optax.inject_hyperparams(optax.adamw)(learning_rate=LR), steps=2)
    assert [float(lr) for lr in injected] == pytest.approx([LR, LR])


@pytest.mark.parametrize("name", CLIENTS)
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 1,
                                   pytest.param(2, marks=pytest.mark.slow), 3])  # 0, 2: the slow suite
def test_client_optimizers_equal_their_plain_loops(name, stage):
    ref_losses, ref_params = plain(name)
    losses, state, _ = train(config(stage), tx=CLIENTS[name](), steps=len(ref_losses))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, d: np.testing.assert_allclose(a, d, rtol=1e-5, atol=1e-5 * max(np.abs(d).max(), LR)),
                 jax.device_get(state.params), ref_params)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name,per_param", [("lion", (4 + 4) / N), ("chain", (4 + 8) / N)])
def test_param_shaped_state_takes_the_zero_layout(name, per_param):
    """At stage 3 every param-shaped state leaf is laid out like its param (sharded 8 ways), so
    the persistent bytes per param read from the compiled step are (4 + state) / 8."""
    _, state, _ = train(config(3), tx=CLIENTS[name](), steps=1)
    plan = state.plan
    for leaf, spec in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(plan.opt_state), strict=True):
        assert leaf.sharding.spec == spec.spec
    batch = MODELS["mlp"][1]()[0]
    mem = profile.memory(jzero.train_step.lower(state, batch).compile())
    assert mem.per_param(mem.persistent) == pytest.approx(per_param, rel=0.03)


def test_adafactor_factored_rows_stay_replicated_and_moments_shard():
    _, state, _ = train(config(3), tx=CLIENTS["adafactor"](), steps=1)
    factored = state.opt_state[0]
    assert factored.v_row["w1"].shape == (16,) and factored.v_row["w1"].sharding.is_fully_replicated
    assert factored.v["b1"].shape == (64,) and not factored.v["b1"].sharding.is_fully_replicated


def test_fp16_clipping_accumulation_and_offload_work_with_a_client_optimizer():
    """The config's AdamW and the client optax.adamw give the same losses with fp16 loss
    scaling, clipping at 1.0, 4 micro-batches and the optimizer offloaded (stage 2)."""
    extra = {"fp16": {"enabled": True, "initial_scale_power": 8}, "gradient_clipping": 1.0,
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    adam = {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": WD}}
    ours, _, _ = train(config(2, accum=4, **extra, optimizer=adam))
    client, state, _ = train(config(2, accum=4, **extra), tx=optax.adamw(LR, eps=EPS, weight_decay=WD))
    np.testing.assert_allclose(client, ours, rtol=1e-6)
    assert state.plan.offload is not None and client[-1] < client[0]


@pytest.mark.parametrize("extra,tx,message", [
    ({"optimizer": {"type": "AdamW"}}, optax.adamw(1e-3), "optimizer: the config has one and a client optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, optax.adamw(1e-3), "scheduler: the config has one and a client optimizer"),
    ({}, "adamw", r"tx: expected an optax.GradientTransformation \(or optax.MultiSteps\), got str"),
])
def test_two_optimizers_or_not_an_optimizer_is_one_clear_error(extra, tx, message):
    make_fns, _ = MODELS["mlp"]
    init_fn, loss_fn = make_fns()
    with pytest.raises(ConfigError, match=message):
        jzero.init(init_fn, config(1, **extra), loss_fn=loss_fn, rng=0, tx=tx)

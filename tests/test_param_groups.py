"""Parameter groups and frozen parameters (`jzero.zero.groups`): ``jzero.param_groups`` and
``jzero.frozen`` equal a plain optax loop built with ``optax.multi_transform`` (rtol 1e-5) at
every stage, with the reference GPT's stacked leaves and accumulation; frozen leaves keep their
values bit for bit, hold no optimizer state (compiled bytes) and send no gradient over the
wire (compiled collectives); they survive a checkpoint and can live in the compute dtype."""
import functools

import jax
import numpy as np
import optax
import pytest

import jzero
from jzero.analysis import profile
from jzero.config import ConfigError
from jzero.runtime.checkpoint import Checkpointer
from jzero.zero import groups

from helpers import BATCH, EPS, LR, MODELS, WD, assert_params_close, optax_loop

# The GPT: embeddings frozen; biases and norms without decay at half the lr (the usual groups).
JZERO = {"param_groups": [{"pattern": r"(bias|scale)$", "weight_decay": 0.0, "lr_scale": 0.5, "name": "no_decay"}],
         "frozen": {"patterns": [r"^(wte|wpe)"]}}


def hand_labels(params):
    """The same grouping written out by hand, independent of jzero's regex rule."""
    def label(path, _):
        keys = [getattr(k, "key", None) for k in path]
        if keys[0] in ("wte", "wpe"):
            return "frozen"
        return "no_decay" if keys[-1] in ("bias", "scale") else "default"

    return jax.tree_util.tree_map_with_path(label, params)


def reference_tx():
    return optax.multi_transform({"default": optax.adamw(LR, eps=EPS, weight_decay=WD),
                                  "no_decay": optax.adamw(LR / 2, eps=EPS, weight_decay=0.0),
                                  "frozen": optax.set_to_zero()}, hand_labels)


def config(stage, accum=1, jzero_section=JZERO, **extra):
    return jzero.load_config({
        "train_batch_size": BATCH, "gradient_accumulation_steps": accum, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": WD}},
        "jzero": jzero_section, **extra})


@functools.cache
def run(stage, accum, jzero_section=None):
    make_fns, make_batches = MODELS["gpt"]
    init_fn, loss_fn = make_fns()
    cfg = config(stage, accum, JZERO if jzero_section is None else jzero_section)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0))
    first = jax.device_get(state.params)
    losses = []
    for batch in make_batches():
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), first, state


@pytest.mark.parametrize("stage,accum", [(0, 4), pytest.param(1, 1, marks=pytest.mark.slow),
                                         pytest.param(2, 4, marks=pytest.mark.slow),
                                         pytest.param(3, 1, marks=pytest.mark.slow), (3, 4)])
def test_groups_and_frozen_equal_a_plain_multi_transform_loop(stage, accum):
    ref_losses, ref_params = optax_loop("gpt", reference_tx())
    losses, first, state = run(stage, accum)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    params = jax.device_get(state.params)
    jax.tree.map(assert_params_close, params, ref_params)
    for name in ("wte", "wpe"):  # frozen: bit for bit
        jax.tree.map(np.testing.assert_array_equal, params[name], first[name])
    assert losses[-1] < losses[0]


def test_the_label_rule_matches_the_hand_written_one():
    params = jax.eval_shape(MODELS["gpt"][0]()[0], jax.random.key(0))
    assert jzero.param_labels(config(1)) is not None
    assert jax.tree.leaves(groups.param_labels(config(1))(params)) == jax.tree.leaves(hand_labels(params))


def freeze_all_but_the_head(stage):
    """The GPT with everything but the attention output projections frozen (89.5% of the params)."""
    make_fns, make_batches = MODELS["gpt"]
    init_fn, loss_fn = make_fns()
    section = {"frozen": {"patterns": [r"^(?!blocks/stacked/proj/kernel$)"]}}
    states = {}
    for name, jz in (("all", {}), ("frozen", section)):
        states[name] = jzero.abstract_init(init_fn, config(stage, 1, jz), loss_fn=loss_fn)
    batch = make_batches()[0]
    return {name: jzero.train_step.lower(s, batch).compile() for name, s in states.items()}, states


def test_freezing_90_percent_cuts_optimizer_state_and_gradient_traffic():
    """Stage 2, 8 devices: optimizer-state bytes per device fall by >= 85% and the gradient
    reductions' elements by as much (read from the compiled step)."""
    compiled, states = freeze_all_but_the_head(2)
    params = states["all"].params
    frozen = sum(x.size for x, f in zip(jax.tree.leaves(params), jax.tree.leaves(
        groups.frozen_mask(states["frozen"].config, params)), strict=True) if f)
    total = sum(x.size for x in jax.tree.leaves(params))
    assert frozen / total > 0.88
    mem = {name: profile.memory(c) for name, c in compiled.items()}
    assert mem["frozen"].opt_state <= 0.15 * mem["all"].opt_state

    def reduced(c):
        return profile.comm(c).total_elements(("reduce-scatter", "all-reduce"))

    assert reduced(compiled["frozen"]) <= 0.15 * reduced(compiled["all"])


def test_frozen_leaves_survive_a_checkpoint_and_can_live_in_the_compute_dtype(tmp_path):
    make_fns, make_batches = MODELS["gpt"]
    init_fn, loss_fn = make_fns()
    cfg = config(3, 1, {**JZERO, "frozen": {"patterns": [r"^(wte|wpe)"], "compute_dtype": True}},
                 bf16={"enabled": True})
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    assert state.params["wte"]["embedding"].dtype == jax.numpy.bfloat16
    assert state.params["ln_f"]["scale"].dtype == jax.numpy.float32
    state, _ = jzero.train_step(state, make_batches()[0])
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, force=True)
    restored = Checkpointer(tmp_path / "ckpt").restore(jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_each_group_is_described_once():
    params = jax.eval_shape(MODELS["gpt"][0]()[0], jax.random.key(0))
    lines = groups.describe(config(1), params)
    assert [line.split(":")[0] for line in lines] == ["default", "no_decay", "frozen"]
    assert "weight_decay 0.01, lr 0.001 (x1)" in lines[0] and "weight_decay 0, lr 0.0005 (x0.5)" in lines[1]
    assert lines[2].endswith("not trained") and groups.describe(config(1, 1, {}), params) == []


@pytest.mark.parametrize("section,message", [
    ({"param_groups": [{"pattern": "(bias"}]}, r"jzero.param_groups\[0\].pattern: '\(bias' is not a regular"),
    ({"frozen": {"patterns": ["[x"]}}, r"jzero.frozen.patterns\[0\]: '\[x' is not a regular expression"),
    ({"param_groups": [{"pattern": "a", "name": "frozen"}]}, "the group name 'frozen' is taken"),
    ({"param_groups": [{"pattern": "a", "lr_scale": -1}]}, r"jzero.param_groups\[0\].lr_scale: must be >= 0"),
    ({"param_groups": [{"patern": "a"}]}, r"jzero.param_groups\[0\].patern: unknown key; did you mean 'pattern'"),
])
def test_bad_groups_are_one_line_errors(section, message):
    with pytest.raises(ConfigError, match=message):
        config(1, 1, section)


def test_groups_with_a_client_optimizer_are_refused_and_frozen_works():
    make_fns, make_batches = MODELS["mlp"]
    init_fn, loss_fn = make_fns()
    raw = {"train_batch_size": BATCH, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match="jzero.param_groups: they shape the config's optimizer"):
        jzero.init(init_fn, jzero.load_config({**raw, "jzero": {"param_groups": [{"pattern": "b"}]}}),
                   loss_fn=loss_fn, rng=0, tx=optax.adamw(LR))
    state = jzero.init(init_fn, jzero.load_config({**raw, "jzero": {"frozen": {"patterns": ["^w1$"]}}}),
                       loss_fn=loss_fn, rng=0, tx=optax.adamw(LR))
    before = np.asarray(state.params["w1"])
    state, _ = jzero.train_step(state, make_batches()[0])
    np.testing.assert_array_equal(np.asarray(state.params["w1"]), before)

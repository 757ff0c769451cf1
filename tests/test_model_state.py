"""Model state (`jzero.zero.modelstate`): BatchNorm statistics of Linen and NNX models ride in the
TrainState. Against a plain single-device Flax loop that carries them the usual way (Linen's
``mutable=["batch_stats"]``, NNX's ``BatchStat`` variables), each device's rows as one block
that threads the statistics through its micro-batches and the blocks' statistics averaged:
params and statistics after 10 steps at rtol 1e-5, every stage x 1/2/8 devices x accumulation
1/4. Evaluation reads the carried statistics; checkpoints and exports keep them."""
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.config import ConfigError
from jzero.runtime.checkpoint import Checkpointer

from helpers import cli_env

STEPS, BATCH, LR, EPS, FEATURES = 10, 128, 1e-2, 1e-6, 8  # 4 rows per BatchNorm at 8 devices x 4


# No bias before a BatchNorm (as in ResNets): its gradient is exactly zero (the norm subtracts
# the mean), so Adam would only amplify rounding noise in it.
class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return nn.Dense(1)(nn.relu(x))


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(FEATURES, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.inp(x))))


def mse(out, batch):
    return jnp.mean((out[:, 0] - batch["y"]) ** 2)


def batches():
    rng = np.random.default_rng(3)
    out = []
    for _ in range(STEPS):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32) * 2 + 1
        out.append({"inputs": x, "y": (0.5 * x @ np.linspace(-1, 1, FEATURES)).astype(np.float32)})
    return out


SAMPLE = jax.ShapeDtypeStruct((1, FEATURES), jnp.float32)
ADAPTERS = {"linen": lambda: jzero.from_linen(LinenNet(), SAMPLE, mse), "nnx": lambda: jzero.from_nnx(NNXNet, mse)}


# ------------------------------------------------------------------------------------------
# The plain Flax references: (apply in training, apply in evaluation), each (params, stats, x).
# ------------------------------------------------------------------------------------------
def linen_reference():
    module = LinenNet()
    variables = module.init(jax.random.key(0), jnp.zeros((1, FEATURES)), train=False)

    def train(params, stats, x):
        out, updated = module.apply({"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
        return out, updated["batch_stats"]

    def evaluate(params, stats, x):
        return module.apply({"params": params, "batch_stats": stats}, x, train=False)

    return variables["params"], variables["batch_stats"], train, evaluate


def nnx_reference():
    graphdef, params, stats = nnx.split(NNXNet(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    def run(params, stats, x, training):
        model = nnx.merge(graphdef, params, stats)
        model.train() if training else model.eval()
        return model(x), nnx.state(model, nnx.BatchStat)

    def train(params, stats, x):
        return run(params, stats, x, True)

    def evaluate(params, stats, x):
        return run(params, stats, x, False)[0]

    return params, stats, train, evaluate


REFERENCES = {"linen": linen_reference, "nnx": nnx_reference}


def pure(tree):
    """A Flax state tree (NNX ``State`` or Linen dict) as nested dicts of numpy arrays."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    return jax.device_get(tree)


@functools.cache
def reference(api, ndev, accum):
    """The plain loop: one device, optax.adamw; the batch as ``ndev`` blocks of ``accum``
    micro-batches; each block threads the statistics through its micro-batches, the blocks'
    statistics are averaged. Returns (losses, params, statistics, evaluate, last batch)."""
    params, stats, train, evaluate = REFERENCES[api]()
    tx = optax.adamw(LR, eps=EPS, weight_decay=0.0)
    opt_state = tx.init(params)

    def block_loss(p, rows, stats):
        def micro(stats, mb):
            out, stats = train(p, stats, mb["inputs"])
            return stats, mse(out, mb)

        stats, losses = jax.lax.scan(micro, stats, rows)
        return losses.mean(), stats

    @jax.jit
    def step(params, opt_state, stats, batch):
        blocks = jax.tree.map(lambda x: x.reshape(ndev, accum, -1, *x.shape[1:]), batch)

        def total(p):
            losses, new = jax.vmap(block_loss, in_axes=(None, 0, None))(p, blocks, stats)
            return losses.mean(), jax.tree.map(lambda s: s.mean(0), new)

        (loss, stats), grads = jax.value_and_grad(total, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats, loss

    losses = []
    for batch in batches():
        params, opt_state, stats, loss = step(params, opt_state, stats, batch)
        losses.append(float(loss))
    return np.array(losses), pure(params), pure(stats), functools.partial(evaluate, params, stats)


def config(stage, accum):
    return jzero.load_config({
        "train_batch_size": BATCH, "gradient_accumulation_steps": accum, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}}})


@functools.cache
def run(api, stage, ndev, accum):
    init_fn, loss_fn = ADAPTERS[api]()
    cfg = config(stage, accum)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0, mesh=jzero.make_mesh(cfg, devices=jax.devices()[:ndev]))
    losses = []
    for batch in batches():
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def assert_close(actual, desired):
    """rtol 1e-5, with an absolute floor at 1e-5 of the leaf's scale for elements that pass
    near zero: the larger of its RMS and the lr, since each Adam step moves an element by about
    the lr and the reduction-order rounding of m / sqrt(v) is absolute on that scale (seen: a
    one-element bias ending at 2.6e-3 after moving ~0.1, off by 1.1e-7 between 8 devices and 1)."""
    jax.tree.map(lambda a, d: np.testing.assert_allclose(
        a, d, rtol=1e-5, atol=1e-5 * max(float(np.sqrt(np.mean(np.square(d)))), LR)), actual, desired)


CASES = [(api, s, n, a) for api in ADAPTERS for s in (0, 1, 2, 3) for n in (8, 2, 1) for a in (1, 4)]
# The default suite runs each stage once (both APIs, 2 and 8 devices, accumulation 1 and 4); slow: all.
DEFAULT = {("linen", 0, 2, 4), ("nnx", 1, 8, 4), ("nnx", 2, 2, 1), ("linen", 3, 8, 4)}
TRAINED = {"linen": (3, 8, 4), "nnx": (1, 8, 4)}  # default runs the evaluation test reuses


@pytest.mark.parametrize("api,stage,ndev,accum", [
    pytest.param(*c, marks=() if c in DEFAULT else pytest.mark.slow, id=f"{c[0]}-zero{c[1]}-{c[2]}dev-accum{c[3]}")
    for c in CASES])
def test_params_and_statistics_match_the_plain_flax_loop(api, stage, ndev, accum):
    ref_losses, ref_params, ref_stats, _ = reference(api, ndev, accum)
    losses, state = run(api, stage, ndev, accum)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(jax.device_get(state.params), ref_params)
    statistics = state.model_state["batch_stats"]["BatchNorm_0"] if api == "linen" else state.model_state["bn"]
    assert_close(jax.device_get(statistics), ref_stats["BatchNorm_0"] if api == "linen" else ref_stats["bn"])
    assert losses[-3:].mean() < losses[:3].mean()
    for x in jax.tree.leaves(state.model_state):  # replicated at every stage
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == ndev


@pytest.mark.parametrize("api", ADAPTERS)
def test_evaluation_reads_the_carried_statistics(api):
    """eval_step equals the plain Flax evaluation forward (running averages) with the trained
    params and statistics, and differs from it with the initial statistics (negative control)."""
    _, state = run(api, *TRAINED[api])
    params, stats, _, evaluate = REFERENCES[api]()
    if api == "nnx":  # the pure dicts jzero carries back into NNX's State
        nnx.replace_by_pure_dict(params, jax.device_get(state.params))
        nnx.replace_by_pure_dict(stats, jax.device_get(state.model_state))
        trained = (params, stats)
    else:
        trained = (jax.device_get(state.params), jax.device_get(state.model_state)["batch_stats"])
    batch = batches()[0]
    got = float(jzero.eval_step(state, batch))
    np.testing.assert_allclose(got, float(mse(evaluate(*trained, batch["inputs"]), batch)), rtol=1e-5)
    init_fn, _ = ADAPTERS[api]()
    fresh = state.replace(model_state=jax.tree.map(jnp.asarray, init_fn(jax.random.key(0)).state))
    assert abs(float(jzero.eval_step(fresh, batch)) - got) > 1e-3 * abs(got)


def test_checkpoint_resume_is_bitwise_and_restores_onto_other_devices(tmp_path):
    """10 steps straight, and 5 steps + save + restore + 5 steps: params and statistics equal
    bit for bit; the checkpoint restores onto 2 devices at stage 1 with the same statistics."""
    init_fn, loss_fn = ADAPTERS["linen"]()
    cfg = config(3, 4)
    _, straight = run("linen", 3, 8, 4)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    data = batches()
    for batch in data[:5]:
        state, _ = jzero.train_step(state, batch)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, force=True)
    target = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn)
    resumed = Checkpointer(tmp_path / "ckpt").restore(target)
    for batch in data[5:]:
        resumed, _ = jzero.train_step(resumed, batch)
    for a, b in zip(jax.tree.leaves((straight.params, straight.model_state)),
                    jax.tree.leaves((resumed.params, resumed.model_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = config(1, 1)
    moved = Checkpointer(tmp_path / "ckpt").restore(jzero.abstract_init(
        init_fn, other, loss_fn=loss_fn, mesh=jzero.make_mesh(other, devices=jax.devices()[:2])))
    for a, b in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(moved.model_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(jax.tree.leaves(moved.model_state)[0].sharding.device_set) == 2

    jzero.export(tmp_path / "ckpt", tmp_path / "w.safetensors")
    restarted = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=1, params=jzero.load_params(tmp_path / "w.safetensors"),
                           model_state=jzero.load_model_state(tmp_path / "w.safetensors"))
    for a, b in zip(jax.tree.leaves((state.params, state.model_state)),
                    jax.tree.leaves((restarted.params, restarted.model_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stateless_models_keep_the_two_argument_form():
    """A plain (params, batch, rng) loss and a bare-params init_fn train as before, and a
    model state given to a stateless model is one clear error."""
    def init_fn(rng):
        return {"w": jax.random.normal(rng, (FEATURES, 1))}

    def loss_fn(params, batch, rng):
        return jnp.mean((batch["inputs"] @ params["w"])[:, 0] ** 2)

    state = jzero.init(init_fn, config(2, 1), loss_fn=loss_fn, rng=0)
    state, metrics = jzero.train_step(state, batches()[0])
    assert state.model_state is None and np.isfinite(float(metrics["loss"]))
    with pytest.raises(ConfigError, match="model_state: given, but init_fn returned no model state"):
        jzero.init(init_fn, config(2, 1), loss_fn=loss_fn, rng=0, model_state={"x": np.zeros(1)})


@pytest.mark.parametrize("stage", [0, 3])
def test_integer_params_are_refused_at_init_and_train_as_model_state(stage):
    """An int32 permutation in params has no gradient and would be cast by ZeRO-3's gather: refused
    at init by name, in one line (36819f1 failed inside the step at stages 0-1 and silently cast
    it at 2-3). As model state it rides untouched, a batch that does not split over the devices is
    one line from eval_step as from train_step."""
    from jzero import Variables

    def params(rng):
        return {"w": jax.random.normal(rng, (FEATURES, 1)), "perm": jnp.arange(FEATURES)[::-1]}

    def loss_fn(p, batch, rng):
        return jnp.mean((batch["inputs"][:, p["perm"]] @ p["w"])[:, 0] ** 2)

    with pytest.raises(ConfigError, match=r"^params: 'perm' is int32\[8\]; only floating-point params") as err:
        jzero.init(params, config(stage, 1), loss_fn=loss_fn, rng=0)
    assert "\n" not in str(err.value)

    def init_fn(rng):
        p = params(rng)
        return Variables({"w": p["w"]}, {"perm": p["perm"]})

    def stateful_loss(p, batch, rng, state):
        return loss_fn({**p, **state}, batch, rng), state

    state = jzero.init(init_fn, config(stage, 1), loss_fn=stateful_loss, rng=0)
    state, metrics = jzero.train_step(state, batches()[0])
    assert state.model_state["perm"].dtype == jnp.int32 and np.isfinite(float(metrics["loss"]))
    np.testing.assert_array_equal(state.model_state["perm"], np.arange(FEATURES)[::-1])
    odd = jax.tree.map(lambda x: x[:12], batches()[0])
    with pytest.raises(ValueError, match=r"^batch\['inputs'\]: leading dimension must be a positive multiple "
                                         r"of the data-parallel size 8, got shape \(12, 8\)"):
        jzero.eval_step(state, odd)
    uneven = {"inputs": batches()[0]["inputs"][:8], "y": batches()[0]["y"][:16]}
    with pytest.raises(ValueError, match=r"^batch\['y'\]: 16 rows, but batch\['inputs'\] has 8"):
        jzero.eval_step(state, uneven)


def test_a_linen_model_without_a_mode_argument_is_one_clear_error():
    class Fixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(x)

    init_fn, loss_fn = jzero.from_linen(Fixed(), SAMPLE, mse)
    with pytest.raises(ValueError, match=r"from_linen: Fixed has state \['batch_stats'\] but its __call__ takes none"):
        jzero.init(init_fn, config(1, 1), loss_fn=loss_fn, rng=0)


def test_a_state_that_changes_shape_is_one_clear_error():
    """A loss that returns its state with another shape (a growing collection) is refused by
    name, not by a shard_map type error."""
    from jzero import Variables

    def init_fn(rng):
        return Variables({"w": jax.random.normal(rng, (FEATURES, 1))}, {"seen": jnp.zeros((2,))})

    def loss_fn(params, batch, rng, state):
        loss = jnp.mean((batch["inputs"] @ params["w"])[:, 0] ** 2)
        return loss, {"seen": jnp.concatenate([state["seen"], jnp.ones(1)])}

    state = jzero.init(init_fn, config(2, 1), loss_fn=loss_fn, rng=0)
    with pytest.raises(ValueError, match=r"model state: seen has shape \[3, 'float32'\] in the state it returned "
                                         r"but \[2, 'float32'\] in the state loss_fn was given"):
        jzero.train_step(state, batches()[0])


@pytest.mark.slow
def test_a_killed_run_resumes_bit_for_bit(tmp_path):
    """A process trains 5 steps, saves, trains on and is SIGKILLed; this process restores the
    save and trains 5 more: params and statistics equal 10 straight steps bit for bit."""
    script = (f"import os, signal, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "import jzero, test_model_state as t\n"
              "from jzero.runtime.checkpoint import Checkpointer\n"
              "init_fn, loss_fn = t.ADAPTERS['linen']()\n"
              "state = jzero.init(init_fn, t.config(3, 4), loss_fn=loss_fn, rng=0)\n"
              "data = t.batches()\n"
              "for batch in data[:5]:\n    state, _ = jzero.train_step(state, batch)\n"
              f"ckpt = Checkpointer({str(tmp_path / 'ckpt')!r})\nckpt.save(state, force=True)\nckpt.wait()\n"
              "for batch in data[5:7]:\n    state, _ = jzero.train_step(state, batch)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**cli_env(), "XLA_FLAGS": os.environ["XLA_FLAGS"]}  # this process's: bit for bit
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    init_fn, loss_fn = ADAPTERS["linen"]()
    resumed = Checkpointer(tmp_path / "ckpt").restore(jzero.abstract_init(init_fn, config(3, 4), loss_fn=loss_fn))
    assert int(resumed.step) == 5
    for batch in batches()[5:]:
        resumed, _ = jzero.train_step(resumed, batch)
    _, straight = run("linen", 3, 8, 4)
    for a, b in zip(jax.tree.leaves((straight.params, straight.model_state)),
                    jax.tree.leaves((resumed.params, resumed.model_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

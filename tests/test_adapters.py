"""Flax users write one line: Linen and NNX models (with scan_layers) train under ZeRO-3 on 8
devices and match the plain single-device optax loop."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jzero
from jzero.models.layers import scan_layers

LR, STEPS = 1e-2, 5


def mse(out, batch):
    return jnp.mean((out - batch["y"]) ** 2)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(x.shape[-1])(x))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = scan_layers(LinenBlock(), 3, remat_policy="dots", name="blocks")(x)
        return nn.Dense(2)(x)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(8, 16, rngs=rngs)
        self.blocks = scan_layers(NNXBlock, 3, remat_policy="full", rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(self.inp(x)))


def batches():
    rng = np.random.default_rng(0)
    return [{"inputs": rng.normal(size=(16, 8)).astype(np.float32),
             "y": rng.normal(size=(16, 2)).astype(np.float32)} for _ in range(STEPS)]


ADAPTERS = {
    "linen": lambda: jzero.from_linen(LinenModel(), jax.ShapeDtypeStruct((1, 8), jnp.float32), mse),
    "nnx": lambda: jzero.from_nnx(NNXModel, mse),
}


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_flax_model_trains_under_zero3_like_plain_loop(kind):
    init_fn, loss_fn = ADAPTERS[kind]()
    cfg = jzero.load_config({"train_batch_size": 16, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-6}},
        "gradient_clipping": 0.0}, dp_size=8)  # the plain loop does not clip
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    stacked = [x for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0] if "stacked" in str(p)]
    assert stacked and all(x.shape[0] == 3 for x in stacked)
    assert all(x.sharding.spec[0] is None for x in stacked)  # never shard the layer dimension

    params = jax.jit(init_fn)(jax.random.key(0))
    tx = optax.adamw(LR, eps=1e-6, weight_decay=0.0)
    opt_state = tx.init(params)
    for batch in batches():
        state, metrics = jzero.train_step(state, batch)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 jax.device_get(state.params), jax.device_get(params))


def test_scan_layers_rejects_bad_input():
    with pytest.raises(ValueError, match="length must be >= 1"):
        scan_layers(LinenBlock(), 0)
    with pytest.raises(KeyError, match="unknown remat policy 'everything'"):
        scan_layers(LinenBlock(), 2, remat_policy="everything")
    with pytest.raises(ValueError, match="needs rngs"):
        scan_layers(NNXBlock, 2)

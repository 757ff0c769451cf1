"""What several test modules share: the CLI runner, the equivalence models and their plain
optax reference loop, deterministic token batches, polling. No test module imports another."""
import csv
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero.models import gpt

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "gpt_tiny.json"
FAST = ["--steps", "4", "--set", "jzero.train.eval_interval=2", "--set", "jzero.train.eval_batches=1",
        "--set", "steps_per_print=1", "--set", "jzero.model.d_model=32", "--set", "jzero.model.d_ff=64",
        "--set", "jzero.model.seq_len=16", "--set", "jzero.data.max_bytes=200000"]


def cli_env(optimized=False):
    """The test environment for a jzero subprocess: its own device count, the cheap XLA pipeline
    (``optimized``: XLA's full pipeline, for runs long enough that step time dominates)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    if not optimized:  # compile time dominates these tiny runs
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
        env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"  # conftest's CHEAP_XLA_FLAGS
    return env


def jzero_cli(*args, timeout=300, optimized=False):
    return subprocess.run([sys.executable, "-m", "jzero.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(optimized), cwd=ROOT)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def token_batches(num_steps: int, batch: int, seq_len: int, vocab: int, seed: int = 0):
    """Deterministic learnable token batches {"inputs", "targets"}: each row counts up from a
    random start with a random stride in 1..3 (mod vocab), so the loss falls within a few steps."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_steps):
        start = rng.integers(0, vocab, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        tok = ((start + stride * np.arange(seq_len + 1)) % vocab).astype(np.int32)
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    return out


# eps 1e-6 (not torch's 1e-8): with 1e-8, a weight whose gradient is ~1e-10 at some step gets an
# Adam step of ~lr * g / |g| whose size is decided by reduction-order rounding (seen at lr 3e-3:
# one fc weight off by 1.4e-5 between 8 devices and 1). 1e-6 keeps the problem well conditioned
# without touching the tolerances.
STEPS, BATCH, LR, WD, EPS = 10, 32, 1e-3, 0.01, 1e-6
GPT_CFG = gpt.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, remat="full")


def mlp_fns():
    """A plain-function (no Flax, no scan) model: 2-layer MLP regression."""
    def init_fn(rng):
        k1, k2 = jax.random.split(rng)
        return {"w1": jax.random.normal(k1, (16, 64)) * 0.3, "b1": jnp.zeros(64),
                "w2": jax.random.normal(k2, (64, 8)) * 0.3, "b2": jnp.zeros(8)}

    def loss_fn(params, batch, rng):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)

    return init_fn, loss_fn


def mlp_batches():
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(BATCH, 16)).astype(np.float32),
             "y": rng.normal(size=(BATCH, 8)).astype(np.float32)} for _ in range(STEPS)]


MODELS = {
    "gpt": (lambda: gpt.make(GPT_CFG), lambda: token_batches(STEPS, BATCH, GPT_CFG.seq_len, GPT_CFG.vocab_size)),
    "mlp": (mlp_fns, mlp_batches),
}


def config(stage, accum, batch=BATCH, dp_size=None):
    return jzero.load_config({
        "train_batch_size": batch, "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
        "gradient_clipping": 0.0,  # the plain loop does not clip (DeepSpeed's default would: 1.0)
    }, dp_size=dp_size)


def init_on(init_fn, loss_fn, stage, ndev, accum, batch):
    """The jzero state of ``config(stage, accum, batch)`` on the first ``ndev`` devices."""
    cfg = config(stage, accum, batch, dp_size=ndev)
    return jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0),
                      mesh=jzero.make_mesh(cfg, devices=jax.devices()[:ndev]))


@functools.cache
def reference(model):
    """The plain loop: one device, whole batch, optax.adamw."""
    return optax_loop(model, optax.adamw(LR, eps=EPS, weight_decay=WD))


def optax_loop(model, tx):
    """The plain loop of ``model`` with the optax transformation ``tx``: one device, whole batch.
    Returns (losses, host params)."""
    make_fns, make_batches = MODELS[model]
    init_fn, loss_fn = make_fns()
    dev = jax.devices()[0]
    params = jax.device_put(jax.jit(init_fn)(jax.random.key(0)), dev)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in make_batches():
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, dev))
        losses.append(float(loss))
    return np.array(losses), jax.device_get(params)


def plain_loop(init_fn, loss_fn, batches, split):
    """The plain loop over ``batches``: one device, optax.adamw, the mean of the loss over the
    blocks of rows ``split(batch)`` stacks (the groups the step's devices and micro-batches see;
    a loss returning (loss, aux) counts its loss). Returns (losses, host params)."""
    params = jax.jit(init_fn)(jax.random.key(0))
    tx = optax.adamw(LR, eps=EPS, weight_decay=WD)
    opt_state = tx.init(params)

    def loss_of(p, b):
        out = loss_fn(p, b, jax.random.key(0))
        return out[0] if isinstance(out, tuple) else out

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(lambda p: jax.vmap(lambda b: loss_of(p, b))(split(batch)).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for batch in batches:
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return np.array(losses), jax.device_get(params)


def row_blocks(n):
    """``split`` for `plain_loop`: the batch as ``n`` contiguous blocks of rows."""
    return lambda batch: jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)


def assert_params_close(actual, desired):
    """rtol 1e-4, with the absolute floor at 1e-4 of the leaf's RMS: elements that cross zero
    during training (about 0.3% of them) carry the reduction-order noise of Adam's
    m / sqrt(v) (~3e-7 absolute after 10 steps at lr 3e-3), which no relative bound can hold."""
    scale = float(np.sqrt(np.mean(np.square(desired)))) or 1.0
    np.testing.assert_allclose(actual, desired, rtol=1e-4, atol=1e-4 * scale)


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.005)
    pytest.fail(f"timed out after {timeout} s")

"""The Pallas fused AdamW step (interpret mode on CPU): bitwise optax.adamw moments, params to
rounding, in place, the same training losses as the XLA path under shard_map at stages 1-3,
and GPU/TPU lowerings that still export."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jzero
from jzero.zero import fused, optim
from pallas_kernels import adamw as kernel

from helpers import MODELS

SHAPE = (24, 3 * 128)  # 72 rows of 128: blocks of 16 leave a partial last block


def assert_params_close(got, want):
    """Within 1e-6 of the leaf's scale. Not elementwise-relative: a param that crosses zero has
    an arbitrarily large relative error from one rounding of its update. The rounding differs
    because XLA rewrites optax's jitted ``mu / (1 - b1**t)`` into a multiply by a reciprocal."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(w))))


def _inputs(grad_dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    p = jax.random.normal(k[0], SHAPE)
    g = (jax.random.normal(k[1], SHAPE) * 300).astype(grad_dtype)  # a loss-scaled gradient
    return p, g, jax.random.normal(k[2], SHAPE) * 0.1, jax.random.uniform(k[3], SHAPE) * 0.01


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32grad", "bf16grad"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["nodecay", "decay"])
def test_kernel_matches_optax_adamw(grad_dtype, weight_decay):
    """Three steps with loss scale x clip factor as the divisor: m, v bitwise, params within
    1e-6 relative. optax gets the unscaled gradient in fp32 (what the kernel computes first)."""
    p, g, m, v = _inputs(grad_dtype)
    lr, b1, b2, eps = 1e-3, 0.9, 0.95, 1e-8
    tx = optax.adamw(lr, b1, b2, eps, weight_decay=weight_decay)
    state = (tx.init(p)[0]._replace(mu=m, nu=v), *tx.init(p)[1:])  # moments from earlier steps
    step = jax.jit(functools.partial(kernel.adamw, backend="interpret", block_rows=16))
    for t in range(1, 4):
        divisor = jnp.float32(1024.0 * 1.7)  # loss scale 1024, clip factor 1.7
        grad = g * t
        updates, new_state = tx.update(grad.astype(jnp.float32) / divisor, state, p)
        want_p = optax.apply_updates(p, updates)
        hyper = kernel.hyper_vector(lr=lr, b1=b1, b2=b2, eps=eps, eps_root=0.0, weight_decay=weight_decay,
                                    count=state[0].count + 1, divisor=divisor)
        got_p, got_m, got_v = step(hyper, grad, p, state[0].mu, state[0].nu)
        np.testing.assert_array_equal(got_m, new_state[0].mu)
        np.testing.assert_array_equal(got_v, new_state[0].nu)
        assert_params_close(got_p, want_p)
        p, state = want_p, new_state


def test_kernel_skip_keeps_everything_and_bf16_copy_is_the_new_param():
    p, g, m, v = _inputs(jnp.float32)
    g = g.at[3, 5].set(jnp.inf)  # an fp16 overflow
    args = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1, count=7)
    skipped = kernel.adamw(kernel.hyper_vector(**args, skip=True), g, p, m, v, backend="interpret")
    for got, want in zip(skipped, (p, m, v), strict=True):
        np.testing.assert_array_equal(got, want)
    g = g.at[3, 5].set(1.0)
    new_p, *_, copy = kernel.adamw(kernel.hyper_vector(**args), g, p, m, v, backend="interpret", emit_bf16=True)
    assert copy.dtype == jnp.bfloat16
    np.testing.assert_array_equal(copy, new_p.astype(jnp.bfloat16))


def test_kernel_writes_in_place():
    """With the inputs donated, param, m and v come back in the very same buffers."""
    p, g, m, v = _inputs(jnp.float32)
    hyper = kernel.hyper_vector(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, count=1)
    step = jax.jit(functools.partial(kernel.adamw, backend="interpret"), donate_argnums=(2, 3, 4))
    compiled = step.lower(hyper, g, p, m, v).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == 3 * p.nbytes
    p, m, v = (jax.device_put(x, jax.devices()[0]) for x in (p, m, v))
    before = [x.unsafe_buffer_pointer() for x in (p, m, v)]
    out = compiled(hyper, g, p, m, v)
    assert [x.unsafe_buffer_pointer() for x in out] == before
    assert all(x.is_deleted() for x in (p, m, v))


def test_transformation_is_optax_adamw_on_an_odd_pytree():
    """As a plain optax transformation: same state type as optax.adamw (checkpoints move between
    fused and XLA runs), and updates equal to it on leaves that fit the kernel and leaves that
    do not (those take the same arithmetic under XLA)."""
    k = jax.random.split(jax.random.key(1), 6)
    params = {"fits": jax.random.normal(k[0], (8, 256)), "odd": jax.random.normal(k[1], (7, 13)),
              "scalar": jnp.float32(0.5)}
    grads = {"fits": jax.random.normal(k[2], (8, 256)), "odd": jax.random.normal(k[3], (7, 13)),
             "scalar": jnp.float32(-0.25)}
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)
    tx = optax.inject_hyperparams(fused.fused_adamw, static_args=("backend",))(
        learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, backend="interpret")
    s_ref, s_tx = ref.init(params), tx.init(params)
    assert jax.tree.structure(s_ref) == jax.tree.structure(s_tx)
    p_ref = p_tx = params
    for _ in range(3):
        u, s_ref = ref.update(grads, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
        p_tx, s_tx = fused.apply(tx, grads, s_tx, p_tx, grad_divisor=jnp.float32(1.0), skip=jnp.bool_(False),
                                 layout=None)
    jax.tree.map(np.testing.assert_array_equal, s_tx.inner_state[0].mu, s_ref.inner_state[0].mu)
    jax.tree.map(np.testing.assert_array_equal, s_tx.inner_state[0].nu, s_ref.inner_state[0].nu)
    assert_params_close(p_tx, p_ref)


def _config(stage, fused_setting, **extra):
    return jzero.load_config({
        "train_batch_size": 32, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-6,
                                                  "fused": fused_setting}}, **extra})


def _losses(stage, fused_setting, steps=3):
    init_fn, loss_fn = MODELS["gpt"][0]()
    cfg = _config(stage, fused_setting)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    batches = MODELS["gpt"][1]()[:steps]
    text = str(jax.make_jaxpr(jzero.train_step)(state, batches[0]))
    losses = []
    for batch in batches:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), text, state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_with_the_fused_step_matches_the_xla_step(stage):
    """8 devices, clipping active: the fused kernel runs per device under shard_map and the
    losses equal the XLA optimizer step's; the optimizer state keeps the Plan's sharding."""
    want, text, _ = _losses(stage, False)
    got, fused_text, state = _losses(stage, True)
    assert fused_text.count("name=jzero_fused_adamw") > 3 and "pallas_call" not in text
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for leaf, sharding in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(state.plan.opt_state), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_fused_setting_picks_the_backend():
    assert optim.fused_backend(_config(1, "auto")) is None  # auto: off on CPU
    assert optim.fused_backend(_config(1, False)) is None
    assert optim.fused_backend(_config(1, True)) == "interpret"
    l2 = jzero.load_config({"train_batch_size": 32, "optimizer": {
        "type": "Adam", "params": {"adam_w_mode": False, "fused": True}}})
    with pytest.warns(jzero.ConfigWarning, match=r"optimizer.params.fused: True but the fused step is AdamW's"):
        optim.build(l2)
    with pytest.raises(jzero.ConfigError, match="optimizer.params.fused: 'yes' is not one of 'auto', true, false"):
        _config(1, "yes")


def test_a_kernel_that_does_not_compile_falls_back_with_a_notice(monkeypatch):
    """As on a GPU whose jax lacks the lowering: here the Triton kernel cannot compile for CPU."""
    monkeypatch.setattr(optim, "pallas_backend", lambda platform: "triton")
    with pytest.warns(jzero.ConfigWarning, match=r"its triton kernel does not compile here .*using the XLA"):
        opt = optim.build(_config(1, True))
    assert optim.fused_backend(_config(1, True)) is None
    params = {"w": jnp.ones((4, 128))}
    updates, _ = opt.tx.update(params, opt.tx.init(params), params)  # the plain optax.adamw path
    assert updates["w"].shape == (4, 128)


@pytest.mark.parametrize("backend,platform", [("mosaic_gpu", "cuda"), ("triton", "cuda"), ("tpu", "tpu")])
def test_gpu_and_tpu_lowerings_export(backend, platform):
    """The CI check that the accelerator kernels still lower: the fused transformation's update
    (a kernel leaf and an XLA leaf) exported for the platform from this CPU-only machine."""
    params = {"w": jnp.ones((64, 256)), "b": jnp.ones((10,))}
    tx = fused.fused_adamw(1e-3, weight_decay=0.1, backend=backend)
    state = tx.init(params)

    def step(grads, state, params):
        return tx.update(grads, state, params, grad_divisor=jnp.float32(2.0), skip=jnp.bool_(False),
                         new_params=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Triton is deprecated from jax 0.11
        exported = jax.export.export(jax.jit(step), platforms=(platform,), disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(params, state, params)
    assert exported.platforms == (platform,)
    assert "jzero_fused_adamw" in exported.mlir_module() or backend == "triton"

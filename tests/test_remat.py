"""Named remat policies: memory ordered none > dots >= names > full on a small GPT (2 layers of
width 256, 64 tokens, 8 devices), and every policy computes the same loss and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jzero
from jzero.analysis import profile
from jzero.models import gpt
from jzero.models.layers import run_stack
from jzero.zero import dots, remat


@functools.cache
def measured(policy, accum=1):
    model = dict(gpt.SIZES["small"].__dict__, n_layers=2, seq_len=64, remat=policy)
    init_fn, loss_fn = gpt.make(gpt.GPTConfig(**model))
    cfg = jzero.load_config({"train_batch_size": 16, "gradient_accumulation_steps": accum,
                             "zero_optimization": {"stage": 0}}, dp_size=8)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    tok = np.random.default_rng(0).integers(0, 256, (16, model["seq_len"] + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    compiled = jzero.train_step.lower(state, batch).compile()
    temp = profile.memory(compiled).temp
    state, metrics = compiled(state, batch)
    return temp, float(metrics["loss"]), float(metrics["grad_norm"])


def test_memory_order_and_same_numerics():
    temps = {p: measured(p)[0] for p in ("none", "dots", "names", "full")}
    assert temps["none"] > temps["dots"] >= temps["names"] > temps["full"], temps
    for policy in ("dots", "names", "full"):
        assert measured(policy)[1:] == pytest.approx(measured("none")[1:], rel=1e-5)


def test_accumulation_paths_agree():
    """Stages 0-1 under accumulation: the "full" policy adds each layer's gradient into the
    accumulator inside the stack's backward (`hooks.accumulate_stack`), other policies after the
    scan; both give the unaccumulated loss and gradient norm, and the in-place path is smaller."""
    full, dots = measured("full", 2), measured("dots", 2)
    for run in (full, dots):
        assert run[1:] == pytest.approx(measured("none")[1:], rel=1e-5)
    assert full[0] < dots[0]


def test_policies_are_named_in_one_table():
    assert set(remat.POLICIES) == {"none", "full", "dots", "dots_no_batch", "names", "offload"}
    with pytest.raises(KeyError, match="valid: none, full"):
        remat.policy("everything")


def _layer(w, h, _):
    """A bf16 layer that upcasts its input first, as the GPT block's LayerNorm does."""
    return jnp.tanh(h.astype(jnp.float32) @ w).astype(h.dtype)


def _checkpointed_stack(ws, x):
    body = jax.checkpoint(lambda h, w: (_layer(w, h, None), None), policy=remat.FULL, prevent_cse=False)
    return jax.lax.scan(body, x, ws)[0]


def _full_stack(ws, x):
    body = remat.full(lambda h, w: (_layer(w, h, None), None))
    return jax.lax.scan(body, x, ws)[0]


def test_full_remat_saves_16_bit_inputs_narrow_with_the_same_gradients():
    """The "full" policy (`remat.full`) gives ``jax.checkpoint``'s gradients, and its compiled
    backward holds no fp32 copy of the 6 stacked bf16 layer inputs; negative control: under
    ``jax.checkpoint`` XLA:CPU makes that copy (it widens the bf16 slice's whole operand)."""
    ws = jax.random.normal(jax.random.key(0), (6, 32, 32)) / 6
    x = jax.random.normal(jax.random.key(1), (8, 64, 32)).astype(jnp.bfloat16)
    grads, texts = {}, {}
    for name, stack in (("checkpoint", _checkpointed_stack), ("full", _full_stack)):
        fn = jax.jit(jax.grad(lambda ws, x, stack=stack: jnp.sum(stack(ws, x).astype(jnp.float32) ** 2),
                              argnums=(0, 1)))
        grads[name] = fn(ws, x)
        texts[name] = fn.lower(ws, x).compile().as_text()
    for a, b in zip(jax.tree.leaves(grads["full"]), jax.tree.leaves(grads["checkpoint"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert "f32[6,8,64,32]" in texts["checkpoint"]
    assert "f32[6,8,64,32]" not in texts["full"]


def _dense_layer(w, h, _):
    return jnp.tanh(h @ w)


def test_weight_gradient_dots_stay_unfolded_on_cpu_from_min_rows():
    """Stages 0-1 have no hooks, so `run_stack` itself passes each layer's 2-D weight gradients
    through `dots.unfold` where the dots contract `dots.MIN_ROWS` rows or more: the compiled
    weight-gradient dot keeps JAX's ``ct x input`` form (``[out, in]``, then a transpose) instead
    of XLA:CPU's folded ``input x ct`` (which runs on Eigen instead of YNNPACK); the same
    gradients. Negative controls: the plain scan's is folded, and so is run_stack's below
    `dots.MIN_ROWS` rows (where the unfold's transpose copy costs more than it saves)."""
    ws = jax.random.normal(jax.random.key(0), (3, 64, 64)) / 8

    def plain(ws, x):
        return jax.lax.scan(lambda h, w: (_dense_layer(w, h, None), None), x, ws)[0]

    def stacked(ws, x):
        return run_stack(_dense_layer, x, ws, jnp.zeros(3), "none")

    input_first = {}
    for rows in (dots.MIN_ROWS, dots.MIN_ROWS // 4):
        x = jax.random.normal(jax.random.key(1), (rows, 64))
        grads = {}
        for name, stack in (("plain", plain), ("run_stack", stacked)):
            fn = jax.jit(jax.grad(lambda ws, x, stack=stack: jnp.sum(stack(ws, x) ** 2)))
            grads[name] = fn(ws, x)
            text = fn.lower(ws, x).compile().as_text()
            (dot,) = [ln for ln in text.splitlines() if "= f32[64,64]" in ln and " dot(" in ln]
            input_first[name, rows] = dot.split(" dot(")[1].startswith("%dynamic-slice")  # the layer's input
        np.testing.assert_allclose(np.asarray(grads["run_stack"]), np.asarray(grads["plain"]), rtol=1e-6)
    assert input_first == {("plain", 1024): True, ("run_stack", 1024): False,
                           ("plain", 256): True, ("run_stack", 256): True}, input_first

"""Named remat policies: memory ordered none > dots >= names > full on the small GPT (8 devices),
and every policy computes the same loss and gradients."""
import functools

import numpy as np
import pytest

import jzero
from jzero.analysis import profile
from jzero.models import gpt
from jzero.zero import remat


@functools.cache
def measured(policy, accum=1):
    model = dict(gpt.SIZES["small"].__dict__, remat=policy)
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

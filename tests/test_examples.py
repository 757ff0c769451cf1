"""The user path, as a user writes it: examples/resnet_digits.py (a ResNet-style CNN with
BatchNorm, user code) trains by `jzero.train_step` at ZeRO-2 on 2 devices. The full run
(300 steps) reaches >= 95% held-out accuracy; here a shorter one checks the path end to end."""
import importlib.util
import sys

import jax
import numpy as np

from helpers import ROOT


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses (Flax modules) look their module up there
    spec.loader.exec_module(module)
    return module


def test_resnet_with_batchnorm_learns_the_digits_at_zero2_on_2_devices():
    result = load_example("resnet_digits").train(steps=150)
    assert result["heldout_accuracy"] >= 0.9, result
    state = result["state"]
    assert state.plan.stage == 2 and state.plan.mesh.size == 2
    stats = jax.tree.leaves(state.model_state)
    assert stats and all(x.sharding.is_fully_replicated for x in stats)
    means = state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    assert float(np.abs(np.asarray(means)).max()) > 1e-3  # the running statistics moved off their init

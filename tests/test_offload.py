"""ZeRO-Offload and ZeRO-Infinity on memory kinds (docs/design.md, "Offload"): where every leaf
lives, that offloading changes no number, the device and host bytes it leaves, the per-layer
transfer of offloaded params in the GPU program, config errors and checkpoints."""
import functools
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import jzero
from jzero.analysis import profile
from jzero.config import ConfigError, ConfigWarning
from jzero.models import gpt
from jzero.runtime.checkpoint import Checkpointer

from helpers import GPT_CFG, ROOT, cli_env, jzero_cli, read_csv, token_batches

N = 8
STEPS = 20
BATCHES = token_batches(STEPS, 32, GPT_CFG.seq_len, GPT_CFG.vocab_size)
CPU = {"device": "cpu", "pin_memory": True}


def config(stage, *, offload=False, params=False, accum=1, precision="fp32", pin=True, **extra):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {**CPU, "pin_memory": pin}
    if params:
        zero["offload_param"] = {**CPU, "pin_memory": pin}
    mixed = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
             "fp32": {}}[precision]
    return jzero.load_config({"train_batch_size": 32, "gradient_accumulation_steps": accum,
                              "zero_optimization": zero, **mixed, **extra})


def start(cfg):
    init_fn, loss_fn = gpt.make(GPT_CFG)
    return jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)


@functools.cache
def losses(stage, offload, params, accum, precision):
    state = start(config(stage, offload=offload, params=params, accum=accum, precision=precision))
    out = []
    for batch in BATCHES:
        state, metrics = jzero.train_step(state, batch)
        out.append(float(metrics["loss"]))
    return np.array(out)


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize("stage,params", [(1, False), (2, False), (3, False), (3, True)])
def test_state_lives_in_host_memory_after_init_and_steps(stage, params):
    state = start(config(stage, offload=True, params=params))
    assert kinds((state.params, state.opt_state)) == {"pinned_host"}
    compiled = jzero.train_step.lower(state, BATCHES[0]).compile()
    out = compiled.output_shardings[0]
    assert kinds_of_shardings((out.params, out.opt_state)) == {"pinned_host"}
    runtime = compiled.runtime_executable().get_output_memory_kinds()[0]  # what the executable returns
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(compiled.output_shardings)[0]]
    assert len(paths) == len(runtime)
    state_kinds = {kind for path, kind in zip(paths, runtime, strict=True) if ".params" in path or ".opt_state" in path}
    assert state_kinds == {"pinned_host"}
    for batch in BATCHES[:3]:
        state, _ = jzero.train_step(state, batch)
    assert kinds((state.params, state.opt_state)) == {"pinned_host"}
    assert kinds((state.step, state.rng)) == {"device"}


def kinds_of_shardings(tree):
    return {s.memory_kind for s in jax.tree.leaves(tree)}


def test_pin_memory_false_says_the_step_needs_pinned_memory():
    """A jitted program can place arrays in pinned host memory only; pin_memory: false is said
    and pinned memory used (not silently)."""
    with pytest.warns(ConfigWarning, match="pin_memory: false, but the compiled step can only write"):
        cfg = config(2, offload=True, pin=False)
    state, _ = jzero.train_step(start(cfg), BATCHES[0])
    assert kinds((state.params, state.opt_state)) == {"pinned_host"}


# Every stage, both precisions and fp16, accumulation 1 and 4; the last three in the slow suite
# (the default suite's budget: each case compiles an offloaded and a device run).
CASES = [(1, False, 4, "fp32"), (2, False, 1, "bf16"), (3, True, 1, "bf16"), (2, False, 1, "fp16"),
         (2, False, 4, "fp32"), (3, False, 1, "fp32"), (3, True, 4, "fp32")]
SLOW = CASES[3:]  # fp16 and the rest: the slow suite (the default suite's budget)


@pytest.mark.parametrize("stage,params,accum,precision", [
    pytest.param(*c, id=f"zero{c[0]}{'-params' * c[1]}-accum{c[2]}-{c[3]}", marks=pytest.mark.slow if c in SLOW else ())
    for c in CASES])
def test_losses_equal_the_device_run(stage, params, accum, precision):
    runs = losses_in_product_xla if precision == "fp16" else losses
    offloaded = runs(stage, True, params, accum, precision)
    np.testing.assert_allclose(offloaded, runs(stage, False, False, accum, precision), rtol=1e-6)
    assert offloaded[-1] < offloaded[0]


def losses_in_product_xla(*args):
    """`losses` in a fresh process with XLA:CPU's fusion emitters on, as jzero compiles outside the
    tests: fp16 turns an fp32 ulp into a visible loss change, and with the suite's emitters off
    the offloaded step's host-side update rounds one ulp apart from the device step's."""
    script = ("import os, sys, json\n"
              "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
              "sys.path.insert(0, 'tests')\n"
              f"import test_offload\nprint(json.dumps(test_offload.losses(*{args!r}).tolist()))\n")
    env = {**cli_env(), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return np.array(json.loads(proc.stdout.splitlines()[-1]))


def test_skipped_fp16_step_leaves_host_state_bit_identical():
    cfg = config(2, offload=True, precision="fp16")
    cfg = jzero.load_config({**cfg.source, "fp16": {"enabled": True, "initial_scale_power": 60}})
    state = start(cfg)
    before = jax.device_get((state.params, state.opt_state))
    state, metrics = jzero.train_step(state, BATCHES[0])
    assert bool(metrics["skipped"])
    after = jax.device_get((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    assert kinds((state.params, state.opt_state)) == {"pinned_host"}


@pytest.mark.parametrize("stage,params", [(2, False), (3, False), (3, True)])
def test_bytes_per_param_on_device_and_host(stage, params):
    """Between steps the device holds no model state: master params and Adam's moments are on
    the host, sharded (12/N bytes/param); the compute-dtype copy is made each step."""
    state = start(config(stage, offload=True, params=params, precision="bf16"))
    mem = profile.memory(jzero.train_step.lower(state, BATCHES[0]).compile())
    assert mem.per_param(mem.host) == pytest.approx(12 / N, rel=0.02)
    assert mem.per_param(mem.device_persistent) < 0.01


def test_offloaded_params_reach_the_gpu_one_layer_at_a_time():
    """The GPU program (lowered here for CUDA) moves offloaded params to the device one layer's
    shard at a time, inside the layer loop: never a whole stacked leaf."""
    init_fn, loss_fn = gpt.make(GPT_CFG)
    state = jzero.abstract_init(init_fn, config(3, offload=True, params=True, precision="bf16"), loss_fn=loss_fn)
    text = jzero.train_step.trace(state, BATCHES[0]).lower(lowering_platforms=("cuda",)).as_text()
    moved = {tuple(int(d) for d in shape.split("x"))
             for shape in re.findall(r'_xla_buffer_placement = "device"\}\} : \(tensor<([0-9x]+)x\w+>\)', text)}
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    shards = [s.shard_shape(x.shape) for (path, x), s in zip(leaves, jax.tree.leaves(state.plan.compute), strict=True)
              if "stacked" in jax.tree_util.keystr(path)]
    assert shards and {shard[1:] for shard in shards} <= moved  # each layer's shard is moved ...
    assert not {tuple(shard) for shard in shards} & moved  # ... and no whole stack
    assert '_xla_compute_type = "host"' in text  # the optimizer update runs on the host


@pytest.mark.parametrize("zero,message", [
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "NVMe offload is not supported; use 'cpu'"),
    ({"stage": 0, "offload_optimizer": CPU}, "offload_optimizer: needs ZeRO stage 1, 2 or 3"),
    ({"stage": 2, "offload_optimizer": CPU, "offload_param": CPU},
     "offload_param: parameter offload needs ZeRO stage 3"),
    ({"stage": 3, "offload_param": CPU}, "offload_param: needs offload_optimizer.device 'cpu'"),
    ({"stage": 2, "offload_optimizer": {**CPU, "ratio": 0.5}}, "ratio: partial offload is not supported"),
    ({"stage": 2, "offload_optimizer": {**CPU, "nvme_path": "/nvme"}}, "nvme_path: only meaningful"),
])
def test_bad_offload_configs_name_the_key(zero, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        jzero.load_config({"train_batch_size": 32, "zero_optimization": zero})


def test_fused_with_offload_says_which_step_runs():
    cfg = config(2, offload=True, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "fused": True}})
    with pytest.warns(ConfigWarning, match="offload_optimizer runs the update on the host"):
        state = start(cfg)
    assert state.opt_state is not None


@pytest.mark.parametrize("save_offloaded", [True, False])
def test_checkpoint_round_trip_between_offloaded_and_device_state(tmp_path, save_offloaded):
    a, b = config(3, offload=save_offloaded, params=save_offloaded), config(3, offload=not save_offloaded)
    state = start(a)
    for batch in BATCHES[:2]:
        state, _ = jzero.train_step(state, batch)
    with Checkpointer(tmp_path, a) as ckpt:
        assert ckpt.save(state, force=True)
    init_fn, loss_fn = gpt.make(GPT_CFG)
    restored = Checkpointer(tmp_path).restore(jzero.abstract_init(init_fn, b, loss_fn=loss_fn))
    assert kinds((restored.params, restored.opt_state)) == ({"device"} if save_offloaded else {"pinned_host"})
    for x, y in zip(jax.tree.leaves(jax.device_get((state.params, state.opt_state))),
                    jax.tree.leaves(jax.device_get((restored.params, restored.opt_state))), strict=True):
        np.testing.assert_array_equal(x, y)
    state, m1 = jzero.train_step(state, BATCHES[2])
    restored, m2 = jzero.train_step(restored, BATCHES[2])
    assert float(m1["loss"]) == float(m2["loss"])


@pytest.mark.slow  # three short `jzero train` runs: about two minutes on 2 cores
def test_offload_configs_train_from_the_cli(tmp_path):
    """configs/gpt_small_offload.json gives the held-out losses of the same config on the device
    (numbers unchanged by offloading), falling; Hugging Face's zero3-offload template trains."""
    short = ["--steps", "8", "--set", "jzero.train.eval_interval=4", "--set", "jzero.train.eval_batches=1",
             "--set", "jzero.data.max_bytes=200000"]
    small = ["--set", "train_batch_size=32"]  # accum 1: offload with accumulation has its own test
    device = ["--set", "zero_optimization.offload_optimizer.device=none",
              "--set", "zero_optimization.offload_param.device=none"]
    evals = {}
    for name, extra in (("offload", []), ("device", device)):
        proc = jzero_cli("train", "configs/gpt_small_offload.json", "--out", str(tmp_path / name), *short, *small,
                         *extra, timeout=600, optimized=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        evals[name] = [float(r["eval_loss"]) for r in read_csv(tmp_path / name / "metrics.csv") if r["eval_loss"]]
    np.testing.assert_allclose(evals["offload"], evals["device"], rtol=1e-6)
    assert evals["offload"][-1] < evals["offload"][0]
    hf = jzero_cli("train", "configs/hf_zero3_offload.json", "--out", str(tmp_path / "hf"), *short,
                   "--set", "optimizer.params.lr=5e-4", timeout=600, optimized=True)  # HF's default 5e-5 is slow
    assert hf.returncode == 0, hf.stderr[-2000:]
    assert "per-device state in host memory (offloaded)" in hf.stdout
    filled = [line for line in hf.stderr.splitlines() if "'auto' filled with HF Trainer defaults" in line]
    assert len(filled) == 1 and "gradient_clipping=1.0" in filled[0] and "optimizer.params.lr" not in filled[0]
    hf_evals = [float(r["eval_loss"]) for r in read_csv(tmp_path / "hf" / "metrics.csv") if r["eval_loss"]]
    assert hf_evals[-1] < hf_evals[0]

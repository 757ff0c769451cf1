"""Checkpoints (docs/design.md, "Checkpoints"): restore onto any mesh and stage, exact resume of `jzero train` after
SIGKILL, SIGTERM saves, a save killed halfway is ignored, damaged files fall back to the previous
step, and exported safetensors weights give the trained model's logits."""
import asyncio
import dataclasses
import functools
import pickle
import shutil
import signal
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path

import ckpt_writer
import jax
import numpy as np
import pytest
from safetensors import safe_open

import jzero
from jzero.models import gpt
from jzero.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    checksum,
    host_checksum,
)
from jzero.runtime.loops import draining
from jzero.runtime.weights import read_params

from helpers import (
    FAST,
    GPT_CFG,
    MODELS,
    ROOT,
    TINY,
    assert_params_close,
    cli_env,
    config,
    jzero_cli,
    read_csv,
    reference,
    wait_for,
)

SAVE_AT = 5  # of the 10 reference steps


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.cache
def saved_run(directory):
    """Train the equivalence GPT at 8 devices / ZeRO-3 for SAVE_AT steps and save there.
    Returns (host params, host opt_state, losses)."""
    init_fn, loss_fn = MODELS["gpt"][0]()
    cfg = config(3, 1)
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), mesh=jzero.make_mesh(cfg))
    losses = []
    for batch in MODELS["gpt"][1]()[:SAVE_AT]:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    with Checkpointer(directory, cfg) as ckpt:
        assert ckpt.save(state, force=True)
    return host(state.params), host(state.opt_state), losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero3_8dev")
    return (directory, *saved_run(directory))


RESHARD = [(2, 1, None), (1, 0, None), (8, 2, 4)]  # devices, stage, fsdp group (8 = replica 2 x fsdp 4)


@pytest.mark.parametrize("ndev,stage,fsdp", RESHARD, ids=["2dev-zero1", "1dev-zero0", "8dev-zero2-2x4"])
def test_restore_onto_other_mesh_and_stage_continues_exactly(saved, ndev, stage, fsdp):
    directory, params, opt_state, losses = saved
    init_fn, loss_fn = MODELS["gpt"][0]()
    cfg = config(stage, 1)
    if fsdp:
        cfg = jzero.load_config({**cfg.source, "jzero": {"mesh": {"fsdp": fsdp}}})
    mesh = jzero.make_mesh(cfg, devices=jax.devices()[:ndev])
    assert dict(mesh.shape) == {"stage": 1, "replica": ndev // (fsdp or ndev), "fsdp": fsdp or ndev, "expert": 1,
                               "sequence": 1, "tensor": 1}
    target = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, mesh=mesh)
    state = Checkpointer(directory).restore(target)
    assert int(state.step) == SAVE_AT
    assert_equal_trees(host(state.params), params)
    assert_equal_trees(host(state.opt_state), opt_state)
    want = jax.tree.map(lambda s: s.spec, (state.plan.params, state.plan.opt_state))
    assert jax.tree.map(lambda x: x.sharding.spec, (state.params, state.opt_state)) == want
    for batch in MODELS["gpt"][1]()[SAVE_AT:]:
        state, metrics = jzero.train_step(state, batch)
        losses = [*losses, float(metrics["loss"])]
    ref_losses, ref_params = reference("gpt")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(assert_params_close, host(state.params), ref_params)


def test_inference_reads_params_from_a_zero3_checkpoint(saved):
    """`jzero generate` / `serve` read a ZeRO-3, 8-device checkpoint whole, from its directory
    or one step directory, equal to the trained params."""
    directory, params, _, _ = saved
    assert_equal_trees(read_params(directory), params)
    assert_equal_trees(read_params(Path(directory) / str(SAVE_AT)), params)


def test_mismatched_model_names_the_first_differing_leaf(saved):
    init_fn, loss_fn = gpt.make(dataclasses.replace(GPT_CFG, d_ff=128))
    target = jzero.abstract_init(init_fn, config(3, 1), loss_fn=loss_fn)
    with pytest.raises(CheckpointMismatchError, match=r"step 5 does not fit the target state: "
                       r"params/blocks/stacked/fc/bias has shape \[2, 64\] in the checkpoint but \[2, 128\]"):
        Checkpointer(saved[0]).restore(target)


def test_checkpoint_with_a_retired_hyperparameter_restores(tmp_path, monkeypatch):
    """A checkpoint from before eps_root became a compiled-in constant (its optimizer state holds
    ``hyperparams/eps_root``) restores into today's state, every other leaf equal."""
    from jzero.zero import optim

    init_fn, loss_fn = MODELS["gpt"][0]()
    cfg = config(1, 1)
    with monkeypatch.context() as m:
        m.setattr(optim, "CONSTANT_HYPER", ())
        old = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(old.opt_state)[0]]
    assert any("eps_root" in n for n in names)
    with Checkpointer(tmp_path, cfg) as ckpt:
        assert ckpt.save(old, force=True)
    target = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn)
    state = Checkpointer(tmp_path).restore(target)
    assert_equal_trees(host(state.params), host(old.params))
    assert not any("eps_root" in jax.tree_util.keystr(p)
                   for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0])


def test_export_gives_the_trained_logits_and_loads_as_init_params(saved, tmp_path, monkeypatch):
    directory, params, _, _ = saved
    for name in ("load", "loads"):  # no load path may unpickle
        monkeypatch.setattr(pickle, name, lambda *a, **k: pytest.fail("pickle used on a load path"))
    out = tmp_path / "gpt.safetensors"
    written = jzero.export(directory, out)
    assert written["step"] == SAVE_AT and written["tensors"] == len(jax.tree.leaves(params))
    loaded = jzero.load_params(out)
    assert_equal_trees(loaded, params)
    tokens = MODELS["gpt"][1]()[0]["inputs"]
    model = gpt.GPT(GPT_CFG)
    np.testing.assert_array_equal(model.apply({"params": loaded}, tokens), model.apply({"params": params}, tokens))
    with safe_open(str(out), framework="numpy") as f:  # the reference reader agrees on names and metadata
        assert "blocks.stacked.fc.kernel" in f.keys() and f.metadata()["step"] == str(SAVE_AT)
    init_fn, loss_fn = MODELS["gpt"][0]()
    state = jzero.init(init_fn, config(2, 1), loss_fn=loss_fn, rng=1, params=loaded,
                       mesh=jzero.make_mesh(config(2, 1), jax.devices()[:4]))
    assert_equal_trees(host(state.params), params)
    half = jzero.load_params(jzero.export(Path(directory) / str(SAVE_AT), tmp_path / "bf16.safetensors",
                                          dtype="bf16")["path"])
    assert jax.tree.leaves(half)[0].dtype == jax.numpy.bfloat16
    assert_equal_trees(half, jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params))
    with pytest.raises(jzero.ConfigError, match=r"params: the given params do not fit the model: "
                       r"blocks/stacked/fc/bias \(shape \[2, 64\]\) is in the model but not in the given params"):
        jzero.init(init_fn, config(2, 1), loss_fn=loss_fn, rng=1, params={"wte": loaded["wte"]})


def test_export_holds_one_leaf_at_a_time(tmp_path):
    """Peak host memory of an export is about the largest leaf, not the model."""
    init_fn, loss_fn, cfg = ckpt_writer.make()
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0, mesh=jzero.make_mesh(cfg, jax.devices()[:1]))
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state)
    leaf = max(x.nbytes for x in jax.tree.leaves(state.params))
    total = sum(x.nbytes for x in jax.tree.leaves(state.params))
    tracemalloc.start()
    jzero.export(tmp_path / "ckpt", tmp_path / "out.safetensors")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.5 * leaf < total, (peak, leaf, total)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint32", "bool", "uint8"])
def test_checksum_is_layout_free_and_agrees_on_host(dtype):
    x = (np.random.default_rng(0).normal(size=(8, 300, 3)) * 100).astype(jax.numpy.dtype(dtype))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(jzero.make_mesh(config(3, 1)),
                                                           jax.sharding.PartitionSpec("fsdp")))
    value = int(checksum(jax.numpy.asarray(x)))
    assert int(jax.jit(checksum)(sharded)) == value == host_checksum(x) == host_checksum(x, chunk=7)
    if dtype != "bool":
        y = x.copy()
        y[3, 7, 1] += 1  # one element changed
        z = x.copy()
        z[[0, 1]] = z[[1, 0]]  # two rows swapped
        assert host_checksum(y) != value and (np.array_equal(z, x) or host_checksum(z) != value)


# ------------------------------------------------------------------------------------------
# Crash safety
# ------------------------------------------------------------------------------------------
def test_save_killed_halfway_is_ignored(tmp_path):
    init_fn, loss_fn, cfg = ckpt_writer.make()
    directory = tmp_path / "ckpt"
    for _attempt in range(3):
        shutil.rmtree(directory, ignore_errors=True)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "ckpt_writer.py"), str(directory)],
                                stdout=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)
        try:
            while proc.stdout.readline().strip() != "saved 3":
                assert proc.poll() is None, "the writer died"
            partial = wait_for(lambda: list(directory.glob("*.orbax-checkpoint-tmp*")), timeout=60)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.stdout.close()
        if list(directory.glob("*.orbax-checkpoint-tmp*")):  # killed while that save was in flight
            break
    else:
        pytest.fail("could not kill the writer during a save in 3 attempts")
    ckpt = Checkpointer(directory)
    steps = ckpt.all_steps()
    partial_step = int(partial[0].name.split(".")[0])
    assert partial_step not in steps and steps[-1] == partial_step - 1
    target = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, mesh=jzero.make_mesh(cfg, jax.devices()[:2]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        state = ckpt.restore(target)
    assert int(state.step) == steps[-1]
    want = host(init_fn(jax.random.key(0)))
    for _ in range(steps[-1]):  # the writer added 1 per save
        want = jax.tree.map(lambda x: x + np.float32(1), want)
    assert_equal_trees(host(state.params), want)


@pytest.fixture()
def two_steps(tmp_path):
    """A checkpoint directory holding steps 1 and 2 of the writer's state."""
    init_fn, loss_fn, cfg = ckpt_writer.make()
    mesh = jzero.make_mesh(cfg, jax.devices()[:1])
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0, mesh=mesh)
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(state.replace(step=jax.numpy.int32(step)))
    return directory, jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, mesh=mesh)


def _largest_file(step_dir: Path) -> Path:
    return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _edit_record(path: Path) -> None:
    path.write_text(path.read_text().replace('"checksum": ', '"checksum": 1', 1))


DAMAGE = {"truncated": (_largest_file, _truncate), "edited": (_largest_file, _flip_middle_byte),
          "record-edited": (lambda d: d / "record" / "metadata", _edit_record)}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_checkpoint_errors_clearly_and_falls_back(two_steps, damage):
    directory, target = two_steps
    where, how = DAMAGE[damage]
    how(where(directory / "2"))
    ckpt = Checkpointer(directory)
    with pytest.raises(CheckpointError, match=r"step 2: (its arrays are unreadable|.* does not match its checksum"
                                              r"|its record)"):
        ckpt.restore(target, step=2)
    with pytest.warns(CheckpointWarning, match=r"restored step 1 because newer checkpoints are unreadable"):
        state = ckpt.restore(target)
    assert int(state.step) == 1


def _gather_with_a_failure(finished: list) -> None:
    """Orbax's shape of a restore: a fresh loop, one gather over reads, closed after the first
    failure (`run_until_complete` then `close`)."""
    async def read(fail):
        try:
            await asyncio.sleep(0 if fail else 3600)
            raise OSError("truncated")
        finally:
            finished.append(fail)

    async def restore():
        await asyncio.gather(read(True), read(False))

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(OSError):
            loop.run_until_complete(restore())
    finally:
        loop.close()


def test_a_failed_read_leaves_no_pending_task_behind():
    """Inside `draining`, the sibling read of a failed gather is cancelled and awaited before
    the loop closes; outside (the negative control) it is left pending in the closed loop, to
    be finalised by the garbage collector ("Exception ignored in ..." on stderr)."""
    policy, finished = asyncio.get_event_loop_policy(), []
    with draining():
        _gather_with_a_failure(finished)
    assert finished == [True, False] and asyncio.get_event_loop_policy() is policy
    abandoned = []
    _gather_with_a_failure(abandoned)
    assert abandoned == [True]


def test_a_late_read_finds_a_closed_loop_without_raising():
    """A TensorStore read completing after its task was cancelled calls back into the closed
    loop: dropped inside `draining`, "Event loop is closed" outside (the negative control)."""
    with draining():
        loop = asyncio.new_event_loop()
    loop.close()
    assert loop.call_soon_threadsafe(print) is None
    plain = asyncio.new_event_loop()
    plain.close()
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        plain.call_soon_threadsafe(print)


# ------------------------------------------------------------------------------------------
# jzero train: exact resume after SIGKILL, save on SIGTERM
# ------------------------------------------------------------------------------------------
RESUME = [*FAST, "--devices", "4", "--steps", "12", "--set", "jzero.checkpoint.interval=6"]
SLOW_EVAL = ["--set", "jzero.train.eval_interval=7", "--set", "jzero.train.eval_batches=400"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_train_resumes_exactly_after_sigkill(tmp_path, stage):
    zero = ["--set", f"zero_optimization.stage={stage}"]
    straight = jzero_cli("train", str(TINY), "--out", str(tmp_path / "straight"), *RESUME, *zero)
    assert straight.returncode == 0, straight.stderr[-2000:]
    # The killed run evaluates 400 batches at step 7, so it is surely busy when step 6 lands.
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", "train", str(TINY), "--out", str(killed), *RESUME,
                             *zero, *SLOW_EVAL], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env(),
                            cwd=ROOT)
    try:
        wait_for(lambda: (killed / "checkpoints" / "6").is_dir() or proc.poll() is not None, timeout=240)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stderr.close()
    assert Checkpointer(killed / "checkpoints").all_steps() == [6]
    resumed = jzero_cli("train", str(TINY), "--out", str(killed), *RESUME, *zero)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step 6" in resumed.stdout
    want, got = read_csv(tmp_path / "straight" / "metrics.csv"), read_csv(killed / "metrics.csv")
    assert [r["step"] for r in got] == [str(s) for s in range(1, 13)]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    records = [Checkpointer(d / "checkpoints").record(12)["leaves"] for d in (tmp_path / "straight", killed)]
    assert records[0] == records[1]  # every leaf (params, opt state, rng, step): same shape, dtype, checksum
    params = [jzero.load_params(jzero.export(d / "checkpoints", d / "w.safetensors")["path"])
              for d in (tmp_path / "straight", killed)]
    assert_equal_trees(*params)  # bitwise


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_and_exits_with_one_line(tmp_path, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "jzero.cli", "train", str(TINY), "--out", str(out), *FAST,
                             "--devices", "2", "--steps", "100000", "--set", "steps_per_print=1000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT)
    try:
        wait_for(lambda: len(read_csv(out / "metrics.csv")) >= 1 if (out / "metrics.csv").exists() else
                  proc.poll() is not None, timeout=240)
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()
    assert rc == 128 + sig, stderr[-2000:]
    saved = Checkpointer(out / "checkpoints").all_steps()
    assert len(saved) == 1
    assert stderr.strip().splitlines() == [f"jzero: {sig.name} received: saved step {saved[0]} in "
                                           f"{out / 'checkpoints'}; run the same command to resume"]
    assert int(read_csv(out / "metrics.csv")[-1]["step"]) == saved[0]

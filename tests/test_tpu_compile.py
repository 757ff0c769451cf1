"""TPU programs compiled on this CPU-only machine (`jzero.analysis.target`: libtpu builds the real
TPU executable for abstract devices): the ZeRO table read from the TPU executable's memory, the
step's collectives against the formulas, the schedule's overlap, the bytes the step moves against
a hand-written step, and the Pallas AdamW kernel built by Mosaic. Nothing runs on a TPU.

The model is plain JAX with 2-D weights only, each shard a whole number of the TPU's (8, 128)
tiles, so the executable's bytes are the arrays' bytes (a 1-D or ragged array is padded to tiles).
"""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jzero
from jzero.analysis import overlap, profile, target
from jzero.analysis.estimate import _zero_comm

pytestmark = pytest.mark.skipif(not target.TPU_COMPILER, reason="libtpu (jzero[tpu-aot]) is not installed")

TOPOLOGY = "tpu:v5e:2x2"  # 4 chips
WIDTH, LAYERS, BATCH = 512, 3, 32


def init_fn(rng):
    keys = jax.random.split(rng, LAYERS)
    return {f"w{i}": jax.random.normal(k, (WIDTH, WIDTH)) * 0.03 for i, k in enumerate(keys)}


def loss_fn(params, batch, rng):
    h = batch["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def batch_spec(sharding):
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=sharding)
    return {"x": x, "y": x}


def _compile_jzero(devices, stage, clip=0.0):
    cfg = jzero.load_config({
        "train_batch_size": BATCH, "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}, dp_size=len(devices))
    state = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, mesh=jzero.make_mesh(cfg, devices=devices))
    return jzero.train_step.lower(state, batch_spec(state.plan.batch)).compile(), state


@pytest.fixture(scope="module")
def tpu():
    """The topology's devices, compiled for with XLA's full pipeline (the suite's cheap one,
    conftest.py, is for XLA:CPU's compile time; the TPU's schedule and bytes are the subject here)."""
    cheap = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield target.devices(TOPOLOGY)
    jax.config.update("jax_disable_most_optimizations", cheap)


@pytest.fixture(scope="module")
def steps(tpu):
    return {stage: _compile_jzero(tpu, stage) for stage in range(4)}


@pytest.fixture(scope="module")
def hand_written(tpu):
    """The step a user writes (replicated params, the batch split over the chips), clipping off and
    the global norm returned, as jzero's step computes it."""
    mesh = Mesh(np.array(tpu), ("data",))
    tx = optax.adamw(1e-3, weight_decay=0.01)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch, None))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, optax.tree.norm(grads))

    params = jax.eval_shape(init_fn, jax.random.key(0))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
                         (params, jax.eval_shape(tx.init, params)))
    return jax.jit(step, donate_argnums=(0,)).lower(state, batch_spec(NamedSharding(mesh, P("data")))).compile()


@pytest.mark.parametrize("stage,per_param", [(0, 12.0), (1, 4 + 8 / 4), (2, 4 + 8 / 4), (3, 12 / 4)])
def test_zero_table_from_the_tpu_executable(steps, stage, per_param):
    """The ZeRO table's persistent bytes per param (fp32 master + Adam's two moments over 4 chips)
    from the TPU executable's own argument bytes; a few scalars (step, rng) are the rest."""
    mem = profile.memory(steps[stage][0])
    assert mem.per_param(mem.persistent) == pytest.approx(per_param, rel=0.01)


@pytest.mark.parametrize("stage", range(4))
def test_collective_volume_matches_the_formula(steps, stage):
    """At 4 chips the TPU compiler keeps jzero's all-gathers and reduce-scatters: the elements on
    the wire per param are 2 at every stage (one micro-batch): DeepSpeed's 2, 2, 2 at stages 0-2,
    and at stage 3, for a model without `jzero.scan_layers`, (k + 1) = 2 rather than 3k: its
    gathered params are loop-invariant and kept for backward (docs/design.md). The scalars (loss,
    norm) add a few elements."""
    compiled, state = steps[stage]
    n = profile.memory(compiled).num_params
    zero = _zero_comm(profile.comm(compiled), state.plan.mesh)
    assert zero.total_elements() / n == pytest.approx(2.0, abs=0.01)


@pytest.mark.parametrize("stage", range(4))
def test_bytes_accessed_within_three_percent_of_hand_written(steps, hand_written, stage):
    """The step moves no more memory than the hand-written one (XLA's cost analysis of both TPU
    programs), nor more FLOPs than 1% over it (stages 1-3 update a quarter of the params a chip)."""
    compiled = steps[stage][0]
    assert profile.bytes_accessed(compiled) <= 1.03 * profile.bytes_accessed(hand_written)
    assert profile.xla_flops(compiled) <= 1.01 * profile.xla_flops(hand_written)


def test_tpu_collectives_are_counted_once(steps):
    """The TPU runs an asynchronous collective as a start fusion holding it and a done fusion
    holding a copy (same channel and shape): `profile.comm` counts the start's only."""
    text = steps[3][0].as_text()
    assert "AsyncCollectiveDone" in text or "all-gather-done" in text
    names = [c.name for c in profile.comm(text).collectives]
    assert len(names) == len(set(names))
    assert not set(names) & profile.hlo.parse(text).echoes()


def test_overlap_reads_the_schedule():
    """`overlap.overlapped` on a hand-made scheduled module: the all-gather with a fusion between
    its start and done is overlapped, the all-reduce run synchronously is not (negative control)."""
    text = """HloModule m, is_scheduled=true

%f (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%p)
}

ENTRY %main (a: f32[4], b: f32[16], c: f32[8]) -> (f32[16], f32[16], f32[8]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %c = f32[8]{0} parameter(2)
  %ag = (f32[4]{0}, f32[16]{0}) all-gather-start(%a), replica_groups={{0,1,2,3}}, dimensions={0}
  %fusion = f32[8]{0} fusion(%c), kind=kLoop, calls=%f
  %agd = f32[16]{0} all-gather-done(%ag)
  %ar = f32[16]{0} all-reduce(%b), replica_groups={{0,1,2,3}}, to_apply=%f
  ROOT %t = (f32[16]{0}, f32[16]{0}, f32[8]{0}) tuple(%agd, %ar, %fusion)
}
"""
    found = overlap.overlapped(text)
    assert found.windows == {"ag": 1}
    # the all-gather's 16 elements against the all-reduce's 2 x 16, in 4-byte floats
    assert found.fraction == pytest.approx(16 / (16 + 32))


def test_fused_adamw_builds_for_tpu(tpu):
    """The Pallas AdamW kernel lowers through Mosaic for a TPU chip, and its program reads the
    gradient, param and both moments once and writes param and moments once (28 bytes a param)."""
    from pallas_kernels import adamw as kernel

    one = NamedSharding(Mesh(np.array(tpu[:1]), ("x",)), P())
    rows = 1024
    f32 = jax.ShapeDtypeStruct((rows, 128), jnp.float32, sharding=one)
    hyper = jax.ShapeDtypeStruct((kernel.HYPER_SIZE,), jnp.float32, sharding=one)
    compiled = jax.jit(lambda *a: kernel.adamw(*a, backend="tpu"), donate_argnums=(2, 3, 4)).lower(
        hyper, f32, f32, f32, f32).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert profile.bytes_accessed(compiled) == pytest.approx(7 * 4 * rows * 128, rel=0.01)


def test_estimate_target_cli(tmp_path):
    """`jzero estimate --target` prints the TPU program's memory, collectives by kind beside the
    formula, and the overlapped fraction; a bad target is one line (no traceback)."""
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3},
                                  "jzero": {"model": {"size": "tiny"}}}))
    run = subprocess.run([sys.executable, "-m", "jzero.cli", "estimate", str(config), "--target", TOPOLOGY, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    row = out["stages"][0]
    assert out["target"] == TOPOLOGY and out["devices"] == 4
    assert {"peak_gib", "formula_wire_gib", "overlapped_comm_fraction"} <= set(row)
    assert 0.0 <= row["overlapped_comm_fraction"] <= 1.0
    assert "Warning" not in run.stderr and "WARNING" not in run.stderr
    bad = subprocess.run([sys.executable, "-m", "jzero.cli", "estimate", str(config), "--target", "tpu:v5e"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "tpu:GENERATION:TOPOLOGY" in bad.stderr

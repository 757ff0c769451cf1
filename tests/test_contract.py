"""The memory and communication contract (docs/design.md, "Memory and communication contract"),
read from the compiled step on 8 simulated devices: persistent bytes/param, transient gradient
memory, collectives and their dtypes, and the ZeRO paper's communication volume. fp32 master
params + AdamW throughout."""
import functools

import jax
import pytest

import jzero
from jzero.analysis import profile
from jzero.models import gpt

from helpers import MODELS, token_batches

N = 8
BASE = dict(vocab_size=64, seq_len=16, d_model=64, n_heads=4, d_ff=256, remat="full")


@functools.cache
def compiled(stage, layers=4, accum=1, bf16=False, comm=None):
    """(compiled step, params in the stack per layer) for the contract GPT."""
    cfg_model = gpt.GPTConfig(n_layers=layers, **BASE)
    init_fn, loss_fn = gpt.make(cfg_model)
    cfg = jzero.load_config({"train_batch_size": 16 * accum, "gradient_accumulation_steps": accum,
                             "bf16": {"enabled": bf16}, "communication_data_type": comm,
                             "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    batch = token_batches(1, 16 * accum, cfg_model.seq_len, cfg_model.vocab_size)[0]
    layer = sum(x.size for x in jax.tree.leaves(state.params["blocks"]["stacked"])) // layers
    return jzero.train_step.lower(state, batch).compile(), layer


@pytest.mark.parametrize("stage,want", [(0, 12), (1, 4 + 8 / N), (2, 4 + 8 / N), (3, 12 / N)])
def test_persistent_bytes_per_param(stage, want):
    mem = profile.memory(compiled(stage)[0])
    assert mem.per_param(mem.persistent) == pytest.approx(want, rel=0.02)
    assert mem.per_param(mem.params) == pytest.approx(4 / N if stage == 3 else 4, rel=0.02)


def temp_per_layer(stage, **kw):
    """Extra temporary bytes per added layer (4 -> 8 layers), per param of a layer."""
    (c4, layer), (c8, _) = compiled(stage, 4, **kw), compiled(stage, 8, **kw)
    return (profile.memory(c8).temp - profile.memory(c4).temp) / (4 * layer)


# Per added layer, full remat saves only the layer input: (batch/N) x seq x d_model fp32.
ACTIVATION_PER_LAYER = (16 // N) * 16 * 64 * 4


# Stage 2 also carries each layer's fp32 param shard as the sink hook's gradient input
# (4/N bytes/param, a known overhead: docs/design.md "Per-layer hooks").
SINK_VIEW = {2: 4 / N, 3: 0.0}


@pytest.mark.parametrize("stage,bf16", [(2, False), (3, True)])
def test_full_gradient_never_exists(stage, bf16):
    """The transient memory grows by at most the layer's gradient shard (4/N bytes/param) and its
    saved input per layer: no full gradient, no gathered layer kept across layers."""
    _, layer = compiled(stage)
    bound = 4 / N + SINK_VIEW[stage] + ACTIVATION_PER_LAYER / layer
    assert temp_per_layer(stage, bf16=bf16) <= bound * 1.05


@pytest.mark.parametrize("accum", [1, 4])
def test_stage1_holds_one_full_gradient_and_its_shard(accum):
    """Stage 1 reduces once per step (DeepSpeed's ZeRO-1): each device keeps one full fp32
    gradient (4 bytes/param) until the reduce-scatter, then only the shard. Under accumulation
    that one buffer is the accumulator: each layer's gradient is added into it in place
    (`hooks.accumulate_stack`); a micro-batch gradient beside it would make 8 bytes/param."""
    _, layer = compiled(1)
    assert 4.0 <= temp_per_layer(1, accum=accum) <= (4.0 + 4 / N + ACTIVATION_PER_LAYER / layer) * 1.05


def test_stage0_keeps_full_gradient():
    """The same measurement sees the full fp32 gradient when nothing shards it (the test can fail)."""
    assert temp_per_layer(0) >= 4.0


@pytest.mark.parametrize("stage", [2, 3])
def test_a_layer_reduces_its_gradients_in_one_bucket(stage):
    """Per step, one reduce-scatter per layer and one for the leaves outside the stack
    (jzero/zero/buckets.py), not one per leaf (11 per layer here); same elements either way."""
    c, _ = compiled(stage)
    scatters = [x for x in profile.comm(c).collectives if x.kind == "reduce-scatter" and x.group_size > 1]
    assert sum(x.count for x in scatters) == 4 + 1


@pytest.mark.parametrize("stage,volume", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_comm_volume_matches_zero_paper(stage, volume):
    c, _ = compiled(stage)
    report = profile.comm(c)
    psi = profile.memory(c).num_params
    assert report.total_elements() / psi == pytest.approx(volume, rel=0.05)


# Psi per step with k micro-batches: the ZeRO table's last column (jzero/zero/sharding.py).
PER_STEP = {0: lambda k: 2, 1: lambda k: 2, 2: lambda k: k + 1, 3: lambda k: 3 * k}


@pytest.mark.parametrize("stage,accum", [(0, 1), (0, 4), (0, 8), (1, 4), (1, 8), (2, 4), (2, 8), (3, 4), (3, 8)])
def test_comm_per_step_under_accumulation(stage, accum):
    """Per step with k micro-batches (DeepSpeed's rule): stages 0 and 1 reduce once, 2 Psi for any
    k; stage 2 reduce-scatters every micro-batch and all-gathers the new params once, (k + 1) Psi;
    stage 3 gathers, re-gathers and reduce-scatters every micro-batch, 3k Psi."""
    c, _ = compiled(stage, accum=accum)
    want = PER_STEP[stage](accum)
    assert profile.comm(c).total_elements() / profile.memory(c).num_params == pytest.approx(want, rel=0.03)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plain_function_model_comm_per_step(stage):
    """A model without scan_layers at k = 4: stages 0-1 reduce once (2 Psi); stage 2 (k + 1) Psi,
    every gradient reduce-scattered explicitly (no GSPMD all-reduce); stage 3 also (k + 1) Psi:
    without layers there is nothing to gather layer by layer, and XLA hoists the loop-invariant
    all-gather out of the micro-batch loop (the whole model is gathered at once either way)."""
    init_fn, loss_fn = MODELS["mlp"][0]()
    cfg = jzero.load_config({"train_batch_size": 32, "gradient_accumulation_steps": 4,
                             "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=0)
    c = jzero.train_step.lower(state, MODELS["mlp"][1]()[0]).compile()
    want = 2 if stage < 2 else 4 + 1
    assert profile.comm(c).total_elements() / profile.memory(c).num_params == pytest.approx(want, rel=0.03)


def test_stage3_gathers_weights_in_compute_dtype():
    c, layer = compiled(3, bf16=True)
    report = profile.comm(c).by_kind_dtype()
    stack = 4 * layer
    rest = profile.memory(c).num_params - stack  # embeddings, final norm: gathered once, by their hook
    # 16-bit patterns: forward + re-gather in backward (XLA skips re-gathering the few leaves the
    # backward does not read, e.g. the last bias)
    assert 1.99 * stack + rest <= report[("all-gather", "u16")] <= 2 * stack + rest
    assert report[("reduce-scatter", "f32")] == stack + rest  # gradients reduced in fp32
    assert ("all-gather", "f32") not in report or report[("all-gather", "f32")] < 0.05 * stack


def test_accumulation_adds_only_a_sharded_accumulator():
    for stage in (0, 2):
        one, four = profile.memory(compiled(stage)[0]), profile.memory(compiled(stage, accum=4)[0])
        assert four.persistent - four.other == one.persistent - one.other  # no new persistent state
        if stage >= 2:
            assert four.temp - one.temp <= 1.05 * 4 / N * one.num_params + 64 * 1024


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_communication_halves_the_gradient_reduce_scatter_bytes(stage):
    """communication_data_type: bf16 (with bf16 compute): the layer stack's gradient
    reduce-scatters move half the bytes, element counts unchanged. XLA's CPU backend widens
    16-bit reductions to f32 when it runs them; the report keeps what the program asks for (what
    GPU/TPU put on the wire) and records the widening."""
    def scatters(comm):
        c, _ = compiled(stage, bf16=True, comm=comm)
        return [x for x in profile.comm(c).collectives if x.kind == "reduce-scatter" and x.group_size > 1]

    fp32, bf16 = scatters("fp32"), scatters("bf16")
    assert {c.dtype for c in fp32} == {"f32"} and {c.dtype for c in bf16} == {"bf16"}
    assert {c.widened_to for c in bf16} <= {"f32", None}
    elements = [sum(c.elements * c.count for c in cs) for cs in (fp32, bf16)]
    assert elements[0] == elements[1] > 0
    nbytes = [sum(c.elements * c.count * profile.DTYPE_BYTES[c.dtype] for c in cs) for cs in (fp32, bf16)]
    assert nbytes[1] * 2 == nbytes[0]

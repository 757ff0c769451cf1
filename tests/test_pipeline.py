"""Pipeline parallelism (DeepSpeed's PipelineModule + 1F1B TrainSchedule on a "stage" mesh axis),
composed with tensor parallelism and ZeRO (docs/design.md, "Pipeline parallelism"): the plain
single-device loop's numbers, the schedule the step runs read back from its compiled HLO,
per-device memory from the compiled step, checkpoints across layouts, one-line errors."""
import dataclasses
import functools
import json
import re

import jax
import numpy as np
import pytest

import jzero
from jzero.analysis import hlo
from jzero.models import gpt
from jzero.train import pipestep
from jzero.zero import pipeline

from helpers import (
    BATCH,
    EPS,
    FAST,
    GPT_CFG,
    LR,
    TINY,
    WD,
    assert_params_close,
    jzero_cli,
    plain_loop,
    read_csv,
    token_batches,
)

GPT4L = dataclasses.replace(GPT_CFG, n_heads=4, n_layers=4)  # 4 blocks: 2 or 1 per stage at p 2 or 4
STEPS = 3


def pp_config(p, m, stage, tp=1, batch=BATCH, devices=8, repeats=1, **extra):
    return jzero.load_config({
        "train_batch_size": batch, "gradient_accumulation_steps": m,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
        "gradient_clipping": 0.0, "tensor_parallel": {"autotp_size": tp},
        "pipeline": {"stages": p, "repeats": repeats}, "jzero": {"mesh": {"devices": devices}}, **extra})


def batches():
    return token_batches(STEPS, BATCH, GPT4L.seq_len, GPT4L.vocab_size)


@functools.cache
def reference(tied=True, n_layers=4):
    init_fn, loss_fn = gpt.make(dataclasses.replace(GPT4L, tie_embeddings=tied, n_layers=n_layers))
    return plain_loop(init_fn, loss_fn, batches(), lambda b: jax.tree.map(lambda x: x[None], b))


def train(cfg, model_cfg=GPT4L, state=None, steps=None):
    init_fn, loss_fn = gpt.make(model_cfg)
    if state is None:
        state = jzero.init(init_fn, cfg, loss_fn=loss_fn, rng=jax.random.key(0), stages=gpt.stages(model_cfg))
    losses = []
    for batch in batches()[steps or slice(None)]:
        state, metrics = jzero.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


CASES = [(2, 2, 1, 1, True, 1), (2, 4, 3, 1, True, 1), (4, 4, 3, 1, True, 1), (4, 8, 1, 1, True, 1),
         (2, 4, 1, 2, True, 1), (2, 2, 0, 1, False, 1), (4, 4, 2, 1, True, 1), (4, 4, 1, 1, True, 2),
         (2, 4, 3, 2, True, 2)]
DEFAULT = {(2, 2, 1, 1, True, 1), (4, 8, 1, 1, True, 1), (4, 4, 1, 1, True, 2)}  # the rest: slow (the default's budget)


@pytest.mark.parametrize("p,m,stage,tp,tied,v", [
    pytest.param(*c, marks=() if c in DEFAULT else pytest.mark.slow) for c in CASES],
    ids=[f"p{p}-m{m}-zero{s}-tp{tp}-{'tied' if t else 'untied'}{f'-circular{v}' if v > 1 else ''}"
         for p, m, s, tp, t, v in CASES])
def test_matches_plain_optax_loop(p, m, stage, tp, tied, v):
    """p in {2, 4} with m in {p, 2p}, ZeRO 0-3 inside each stage's data-parallel group, tp 2 at
    p 2, tied and untied embeddings, circular stages (2 repeats: a block a chunk, 8 blocks at p 4):
    the plain loop's losses (rtol 1e-5) and params."""
    n_layers = max(4, p * v)
    ref_losses, ref_params = reference(tied, n_layers)
    model_cfg = dataclasses.replace(GPT4L, tie_embeddings=tied, n_layers=n_layers)
    losses, state = train(pp_config(p, m, stage, tp, repeats=v), model_cfg)
    assert dict(state.plan.mesh.shape)["stage"] == p and dict(state.plan.mesh.shape)["tensor"] == tp
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(assert_params_close, jax.device_get(state.params), ref_params)


@pytest.mark.parametrize("remat", ["none", "names", "offload"])
def test_every_remat_policy_keeps_its_own_residuals(remat):
    """A stage stores what its forward's vjp saves under the model's remat policy: every policy
    gives the plain loop's numbers. "offload" saves to host memory, so the ring lives there (it
    failed to trace with device zeros before: a user trial of e1851e5)."""
    ref_losses, ref_params = reference()
    losses, state = train(pp_config(2, 2, 1), dataclasses.replace(GPT4L, remat=remat))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(assert_params_close, jax.device_get(state.params), ref_params)


@pytest.mark.parametrize("p,m,v", [(1, 4, 1), (2, 1, 1), (2, 2, 1), (2, 8, 1), (4, 4, 1), (4, 16, 1), (8, 3, 1),
                                   (2, 2, 2), (2, 3, 3), (4, 4, 2), (4, 2, 3), (8, 8, 2)])
def test_schedule_is_deepspeeds_1f1b_and_circular_goes_round_the_ring(p, m, v):
    """Each stage runs every (micro-batch, repeat)'s forward, then its backward; a forward follows
    the previous virtual stage's (r·p + s - 1, round the ring from the last stage to the first) by
    one tick, a backward the next one's; 2mv + (v + 1)p - 2 ticks (DeepSpeed's 2(m + p - 1) at v = 1),
    idle ((v + 1)p - 2) / (2mv + (v + 1)p - 2) of them ((p - 1) / (m + p - 1) at v = 1); at v = 1 stage s
    never holds more than min(p - s, m) inputs; each tick's ppermute carries what the next tick reads."""
    rows = pipeline.table(p, m, v)
    assert len(rows) == pipeline.ticks(p, m, v) == 2 * m * v + (v + 1) * p - 2
    when = {(op, r * p + s, i): t for t, row in enumerate(rows) for s, (op, i, r) in enumerate(row)
            if op != pipeline.IDLE}
    assert len(when) == 2 * p * v * m
    for k in range(p * v):
        for i in range(m):
            assert when[(pipeline.BACKWARD, k, i)] > when[(pipeline.FORWARD, k, i)]
            if k:
                assert when[(pipeline.FORWARD, k, i)] == when[(pipeline.FORWARD, k - 1, i)] + 1
                assert when[(pipeline.BACKWARD, k - 1, i)] == when[(pipeline.BACKWARD, k, i)] + 1
    assert pipeline.idle_fraction(p, m, v) == pytest.approx(pipeline.bubble_formula(p, m, v))
    assert pipeline.bubble_formula(p, m, v) == pytest.approx(((v + 1) * p - 2) / (2 * m * v + (v + 1) * p - 2))
    assert pipeline.bubble_formula(p, m) == pytest.approx((p - 1) / (m + p - 1))
    if v == 1:
        assert pipeline.in_flight(p, m) == [min(p - s, m) for s in range(p)] and pipeline.stash_size(p, m) == min(p, m)
    perms = pipestep.perms(p, circular=v > 1)
    for t, row in enumerate(rows[:-1]):
        pairs = dict(perms[t % 2])
        for s, (op, _, r) in enumerate(rows[t + 1]):
            if op == pipeline.FORWARD and r * p + s > 0:
                assert pairs[(s - 1) % p] == s and row[(s - 1) % p][0] == pipeline.FORWARD
            if op == pipeline.BACKWARD and r * p + s < p * v - 1:
                assert pairs[(s + 1) % p] == s and row[(s + 1) % p][0] == pipeline.BACKWARD


def test_partition_methods_follow_deepspeed():
    """DeepSpeed's partition_uniform and partition_balanced boundaries; "type:REGEX" weighs the
    blocks its regex finds; an uneven split is refused, naming the key."""
    assert pipeline.partition_uniform(6, 4) == [0, 2, 4, 5, 6]
    assert pipeline.partition_uniform(3, 4) == [0, 1, 2, 3, 3]
    assert pipeline.partition_balanced([1, 1, 1, 1, 1, 1, 1, 1], 4) == [0, 2, 4, 6, 8]
    assert pipeline.partition_balanced([4, 1, 1, 1, 1], 2) == [0, 1, 5]
    assert pipeline.partition("type:^block$", ["Embed", "Block", "Block", "Block", "Block", "Head"], [9] * 6, 2)[1] == 3
    assert pipeline.layers_per_stage("parameters", ["Block"] * 8, [5] * 8, 4) == 2
    with pytest.raises(jzero.ConfigError, match=r"pipeline.partition: 'uniform' splits the 6 blocks .* \[2, 2, 1, 1\]"):
        pipeline.layers_per_stage("uniform", ["Block"] * 6, [5] * 6, 4)
    with pytest.raises(jzero.ConfigError, match=r"pipeline.partition: 'type:Attn' finds none .* \(Block\)"):
        pipeline.layers_per_stage("type:Attn", ["Block"] * 4, [5] * 4, 2)


@functools.cache
def compiled(p, m, stage=1, micro_rows=2, seq_len=16, devices=8, n_layers=4, repeats=1):
    model_cfg = dataclasses.replace(GPT4L, seq_len=seq_len, n_layers=n_layers)
    init_fn, loss_fn = gpt.make(model_cfg)
    cfg = pp_config(p, m, stage, batch=micro_rows * m * devices // p, devices=devices, repeats=repeats)
    state = jzero.abstract_init(init_fn, cfg, loss_fn=loss_fn, stages=gpt.stages(model_cfg) if p > 1 else None)
    batch = {k: jax.ShapeDtypeStruct((cfg.train_batch_size, seq_len), np.int32, sharding=state.plan.batch)
             for k in ("inputs", "targets")}
    return jzero.train_step.lower(state, batch).compile(), state


@pytest.mark.parametrize("p,m,v", [(2, 4, 1), (4, 4, 2), pytest.param(4, 4, 1, marks=pytest.mark.slow)])
def test_compiled_step_runs_the_schedule_and_moves_only_activations(p, m, v):
    """One loop of ticks / 2 iterations (m + p - 1 at v = 1); in it two collective-permutes (one a
    tick, round the ring when circular), each of one micro-batch's activations; nothing is gathered
    across stages: the only collectives whose groups span stages are all-reduces of scalars and
    of the ends' gradients (DeepSpeed's tied-weight sum), and, circular, the once-a-step exchange
    of the stack's blocks and of their gradients back (XLA reshards each device's share with an
    all-to-all and a collective-permute)."""
    exe, state = compiled(p, m, n_layers=4 * v, repeats=v)
    text = exe.as_text()
    iterations = pipeline.ticks(p, m, v) // 2
    trips = [int(t) for t in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)]
    assert iterations in trips and iterations == (m + p - 1 if v == 1 else m * v + (v + 1) * p // 2 - 1)
    module = hlo.parse(text)
    permutes = [i for i in module.instructions() if i.op in ("collective-permute", "collective-permute-start")]
    ticking = [i for i in permutes if i.count == iterations]
    micro_batch = [2, GPT4L.seq_len, GPT4L.d_model]  # compiled(): 2 rows a micro-batch
    assert len(ticking) == 2 and all(hlo.shapes(i.result)[0][1] == micro_batch for i in ticking)
    ring = {(s, (s + 1) % p) for s in range(p)} | {(s, (s - 1) % p) for s in range(p)}
    stage_of = {d.id: s for s in range(p) for d in state.plan.mesh.devices[s].flat}
    pairs = {(stage_of[a], stage_of[b]) for i in ticking for a, b in hlo.source_target_pairs(i.line)}
    assert pairs == (ring if v > 1 else {(s, t) for s, t in ring if abs(s - t) == 1})
    ends = sum(x.size for k, v in state.params.items() if k != "blocks" for x in jax.tree.leaves(v))
    stack = sum(np.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(state.params["blocks"]))
    grads = jax.tree.leaves(state.plan.grads["blocks"])
    stack += sum(np.prod(s.shard_shape(x.shape)) for x, s in zip(jax.tree.leaves(state.params["blocks"]), grads,
                                                                 strict=True))
    exchanged = {"all-to-all": 0, "collective-permute": 0}
    for inst in module.instructions():
        groups = hlo.replica_groups(inst.line) if inst.op in hlo.COLLECTIVES else None
        size = sum(np.prod(dims) for _, dims in hlo.shapes(inst.result))
        if inst.op == "collective-permute" and inst.count == 1:
            exchanged[inst.op] += size
        elif groups and any(len({stage_of[d] for d in g}) > 1 for g in groups):
            # only the loss, the gradient norm and the ends' gradients (tied embeddings) sum across
            if inst.op == "all-to-all" and inst.count == 1 and v > 1:
                exchanged[inst.op] += size
                continue
            assert inst.op == "all-reduce", inst.line[:160]
            assert size <= ends, inst.line[:160]
    assert exchanged == ({"all-to-all": stack, "collective-permute": stack} if v > 1 else
                         {"all-to-all": 0, "collective-permute": 0})


@pytest.mark.slow
def test_memory_is_1f1b_bound_and_params_fall_by_stages():
    """Per device, from the compiled step: the stack's params and optimizer state fall by p (x
    ZeRO's share); temporaries do not grow with the micro-batches (GPipe's would: it keeps every
    one's activations), and stay within 10% of the 1F1B bound: one micro-batch's own step on a
    stage's blocks plus, for each of the p + 1 ring slots (`stash_size` and the slot idle ticks
    write), a stage input and what full remat saves of a micro-batch (each block's input:
    Megatron's full recompute), and two of those in flight (the one a forward writes, the one a
    backward reads). Each block a stage holds adds its inputs to every slot."""
    p, rows, seq = 2, 4, 256
    x_bytes = rows * seq * GPT4L.d_model * 4
    per_block = {}
    for n_layers in (4, 8):
        blocks = n_layers // p
        plain, _ = compiled(1, p, micro_rows=rows, seq_len=seq, devices=8 // p, n_layers=blocks)
        temps = [compiled(p, m, micro_rows=rows, seq_len=seq, n_layers=n_layers)[0].memory_analysis().temp_size_in_bytes
                 for m in (p, 4 * p)]
        assert temps[0] == temps[1]
        saved = blocks * x_bytes
        bound = plain.memory_analysis().temp_size_in_bytes + (p + 1) * (x_bytes + saved) + 2 * saved
        assert temps[0] <= 1.10 * bound, (n_layers, temps[0], bound)
        per_block[blocks] = temps[0] - plain.memory_analysis().temp_size_in_bytes
    # two blocks more a stage, beyond the plain step's: two inputs more in each of the p + 1 slots,
    # the slot a forward writes, the one a backward reads and the last stage's own forward (its
    # backward runs forward, head and backward at once, in another branch): p + 4 (measured 5.8)
    assert per_block[4] - per_block[2] <= (p + 4) * 2 * x_bytes, per_block
    _, one = compiled(1, 2, stage=3, devices=2)  # ZeRO-3 over 2 data devices, without and with 4 stages
    _, four = compiled(4, 4, stage=3, devices=8)

    def per_device(state):
        leaves = [*jax.tree.leaves(state.params["blocks"]), *jax.tree.leaves(state.opt_state)]
        return sum(np.prod(x.sharding.shard_shape(x.shape)) for x in leaves if x.ndim and x.shape[0] == 4)

    assert per_device(one) == 4 * per_device(four)


def test_checkpoint_restores_on_other_stage_counts_and_continues_exactly(tmp_path):
    """Saved at p 2 x ZeRO-1 after one step, restored without a pipeline (ZeRO-3) and at p 4:
    the remaining steps give the plain loop's losses and params."""
    from jzero.runtime.checkpoint import Checkpointer

    init_fn, loss_fn = gpt.make(GPT4L)
    cfg = pp_config(2, 2, 1)
    losses, state = train(cfg, steps=slice(0, 1))
    with Checkpointer(tmp_path, cfg) as ckpt:
        assert ckpt.save(state, force=True)
    ref_losses, ref_params = reference()
    for other in (pp_config(1, 2, 3), pp_config(4, 4, 1)):
        target = jzero.abstract_init(init_fn, other, loss_fn=loss_fn, stages=gpt.stages(GPT4L))
        restored = Checkpointer(tmp_path).restore(target)
        rest, restored = train(other, state=restored, steps=slice(1, None))
        np.testing.assert_allclose([*losses, *rest], ref_losses, rtol=1e-5)
        jax.tree.map(assert_params_close, jax.device_get(restored.params), ref_params)


@pytest.mark.parametrize("change,match", [
    ({"pipeline": {"stages": 3}}, r"pipeline.stages: 3 does not divide the 8 devices"),
    ({"pipeline": {"stages": 0}}, r"pipeline.stages: must be >= 1"),
    ({"pipeline": {"stages": 2, "partition": "type:("}}, r"pipeline.partition: 'type:\(' is not a valid regex"),
    ({"pipeline": {"stages": 2}, "sequence_parallel_size": 2}, r"pipeline.stages: not with sequence_parallel_size"),
    ({"pipeline": {"stages": 2},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
     r"pipeline.stages: not with zero_optimization.offload_optimizer"),
    ({"pipeline": {"stages": 2, "depth": 2}}, r"pipeline.depth: unknown key"),
    ({"pipeline": {"stages": 2, "repeats": 0}}, r"pipeline.repeats: must be >= 1"),
    ({"pipeline": {"stages": 1, "repeats": 2}}, r"pipeline.repeats: 2 needs an even pipeline.stages"),
    ({"pipeline": {"stages": 8, "repeats": 2}, "gradient_accumulation_steps": 2},
     r"gradient_accumulation_steps: 2 is not a multiple of pipeline.stages / 2 = 4"),
])
def test_misconfiguration_is_one_line_naming_the_key(change, match):
    raw = {"train_batch_size": BATCH, "jzero": {"mesh": {"devices": 8}}, **change}
    with pytest.raises(jzero.ConfigError, match=match) as info:
        jzero.make_mesh(jzero.load_config(raw))
    assert "\n" not in str(info.value)


def test_a_model_without_stages_or_an_uneven_split_is_refused_naming_the_key():
    init_fn, loss_fn = gpt.make(GPT4L)
    with pytest.raises(jzero.ConfigError, match=r"pipeline.stages: 2 needs a model cut into stages"):
        jzero.abstract_init(init_fn, pp_config(2, 2, 1), loss_fn=loss_fn)
    with pytest.raises(jzero.ConfigError, match=r"pipeline.partition: 'parameters' splits the 4 blocks .* \[2, 1, 1\]"):
        jzero.abstract_init(init_fn, pp_config(3, 2, 1, devices=6), loss_fn=loss_fn, stages=gpt.stages(GPT4L))
    with pytest.raises(jzero.ConfigError, match=r"splits the 4 blocks .* over pipeline.stages 4 x pipeline.repeats 2"):
        jzero.abstract_init(init_fn, pp_config(4, 4, 1, repeats=2), loss_fn=loss_fn, stages=gpt.stages(GPT4L))


@pytest.mark.slow
def test_jzero_train_with_a_pipeline_logs_the_losses_of_one_without(tmp_path):
    """`jzero train` on the tiny GPT: 2 stages x 2 data devices x 2 micro-batches (its sample too)
    logs the losses of 4 data devices without a pipeline, same seed."""
    runs = {}
    for name, extra in (("plain", []), ("pipeline", ["--set", "pipeline.stages=2"])):
        proc = jzero_cli("train", str(TINY), "--out", str(tmp_path / name), "--devices", "4", *FAST,
                         "--set", "gradient_accumulation_steps=2", "--set", "zero_optimization.stage=1", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "sample" in proc.stdout
        runs[name] = [float(r["loss"]) for r in read_csv(tmp_path / name / "metrics.csv")]
    assert "'stage': 2" in proc.stdout and len(runs["plain"]) == 4
    np.testing.assert_allclose(runs["pipeline"], runs["plain"], rtol=1e-5)


@pytest.mark.slow
def test_estimate_plans_gpt3_175b_in_3d():
    """`jzero estimate configs/gpt3_175b_3d.json`: 8 stages x tp 8 x 16 data devices (MT-NLG's
    shape), ZeRO-1 inside each stage: the per-device state is the formula's (each device's
    1/64 of the model, optimizer state over 16), the bubble is DeepSpeed's 7 / 103, the stages
    exchange activations only, and it fits an 80 GB GPU."""
    proc = jzero_cli("estimate", "configs/gpt3_175b_3d.json", "--json", timeout=300, optimized=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    row = out["stages"][0]
    assert out["devices"] == 1024 and row["stage"] == 1 and row["pipeline_stages"] == 8
    assert row["bubble_fraction"] == pytest.approx(7 / 103) == row["bubble_formula"]
    assert row["persistent_bytes_per_param"] == pytest.approx(row["jzero_formula_bytes_per_param"], rel=0.01)
    x_gib = 2048 * 12288 * 2 / 8 / 2**30  # a device's share of a micro-batch's activations (bf16, Megatron-SP)
    assert row["between_stages_gib"] == pytest.approx(pipeline.ticks(8, 96) * x_gib)  # one a tick
    assert row["peak_gib"] < 80e9 / 2**30


@pytest.mark.parametrize("remat", ["full", "none"])
def test_stashed_residuals_are_activations_and_give_the_vjps_gradients(remat):
    """What a stage stores for a micro-batch's backward (`jzero.zero.residuals`): no leaf of the
    weights (handed back at the backward), under full remat exactly each block's input (and the
    embedding's token indices), more under none; the rebuilt pullback gives jax.vjp's
    gradients. Negative control: a weight transformed inside the forward is a new array, stored."""
    from jzero.zero import residuals
    model_cfg = dataclasses.replace(GPT4L, remat=remat)
    cut = gpt.stages(model_cfg)
    params = gpt.make(model_cfg)[0](jax.random.key(0))
    ends, chunk = {k: v for k, v in params.items() if k != "blocks"}, params["blocks"]
    mb = jax.tree.map(lambda x: x[:2], token_batches(1, 2, GPT4L.seq_len, GPT4L.vocab_size)[0])
    x = jax.random.normal(jax.random.key(1), (2, GPT4L.seq_len, GPT4L.d_model))
    ct = jax.random.normal(jax.random.key(2), x.shape)

    def forward(consts, params, x):
        (mb, first), (chunk, ends) = consts, params
        return cut.layers(chunk, jax.numpy.where(first, cut.embed(ends, mb), x))

    for first in (False, True):
        consts = (mb, jax.numpy.bool_(first))
        _, shapes, saved = residuals.shapes(forward, consts, (chunk, ends), x)
        weights = {leaf.shape for leaf in jax.tree.leaves((chunk, ends))}
        assert not weights & {s.shape for s in shapes}
        stored = sum(np.prod(s.shape) * s.dtype.itemsize for s in shapes)
        if remat == "full":
            assert stored == GPT4L.n_layers * x.size * 4 + mb["inputs"].size * 4
        else:
            assert stored > 4 * GPT4L.n_layers * x.size * 4

        @jax.jit
        def both(consts, params, x, ct):
            out, keep, saved = residuals.forward(forward, consts, params, x)
            return out, residuals.pullback(saved, consts, params, keep)(ct), jax.vjp(
                lambda p, x: forward(consts, p, x), params, x)[1](ct)

        _, mine, theirs = both(consts, (chunk, ends), x, ct)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), mine, theirs)

    _, shapes, _ = residuals.shapes(lambda c, p, x: x @ p.T, (), jax.numpy.ones((8, 4)), jax.numpy.ones((3, 4)))
    assert sorted(s.shape for s in shapes) == [(3, 4), (4, 8)]  # the input; the transposed weight, a new array


def test_profile_counts_each_micro_batchs_work_once():
    """FLOPs read from the compiled pipelined step weight each branch of the schedule's switch by
    how often it runs (`jzero.zero.branches`); on 36819f1 every branch counted at every tick: 3.9x
    the FLOPs. A stage keeps its forward's residuals (`jzero.zero.residuals`) for the backward
    rather than running the forward again: until 7864f25 it kept only its input and recomputed,
    1 + (1 - 1/p) / 4 of the plain step's matmuls (full remat: forward, recompute, backward x 2).
    Now each scope's matmuls are the same tokens' without a pipeline."""
    from jzero.analysis import estimate, profile

    def scopes(pp, micro):
        cfg = jzero.load_config({
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 2, "pipeline": {"stages": pp},
            "zero_optimization": {"stage": 1}, "jzero": {"mesh": {"devices": 4}, "remat": "full", "model": {
                "name": "gpt", "n_layers": 4, "n_heads": 4, "d_model": 64, "d_ff": 256, "seq_len": 64,
                "vocab_size": 128}}})
        return profile.matmul_flops_by_scope(estimate.compile_step(cfg).compiled)  # per device, 4 devices each

    plain, piped = scopes(1, 4), scopes(2, 8)  # the same 64 rows a step
    assert set(piped) == set(plain) == {"attention", "head", "mlp"}
    for scope in plain:
        assert piped[scope] == pytest.approx(plain[scope], rel=1e-6), (scope, piped, plain)

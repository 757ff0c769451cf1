"""`jzero estimate`: exact per-device memory and communication of a config, with no hardware.

The train step of the config's reference model is compiled ahead of time on abstract shapes
(`jzero.abstract_init`: no parameter is allocated) for the requested device count, and
`jzero.analysis.profile` reads memory, collectives and FLOPs from the executable. The ZeRO paper's and
DeepSpeed's formulas are printed beside the measurement.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding

from jzero import models
from jzero.analysis import hlo, overlap, profile
from jzero.analysis.hlo import DTYPE_BYTES
from jzero.config import Config
from jzero.models import attention
from jzero.models.moe import DISPATCH
from jzero.train.resolve import check_zero
from jzero.train.state import TrainState, abstract_init
from jzero.train.step import train_step
from jzero.zero import pipeline, precision
from jzero.zero.mesh import DATA_AXES, EXPERT, FSDP, MODEL_AXES, STAGE, TENSOR, data_parallel_size, keeping, make_mesh
from jzero.zero.sharding import ZERO_RULES, is_expert, is_stacked

GiB = 2**30


@dataclass(frozen=True)
class Estimate:
    stage: int
    accumulation: int
    mesh: dict[str, int]
    num_params: int
    memory: profile.MemoryReport
    grads_bytes: int  # the gradient buffer per device (full at stages 0-1, else Plan.grads), part of temp
    comm_elements: int
    comm_ring_bytes: float
    flops: float | None  # None for a TPU target: its matmuls are windowed convolutions `profile.flops` cannot count
    analytic: profile.Analytic
    compile_s: float
    all_to_alls: int = 0  # MoE token dispatch: all-to-alls per step
    all_to_all_bytes: int = 0  # their bytes per device per step
    wire_bytes: float = 0.0  # ZeRO's collectives, bytes per device per step in the dtype moved
    unquantized_wire_bytes: float | None = None  # the same step without ZeRO++ quantization
    widened: tuple[str, ...] = ()  # collectives this backend widens ("reduce-scatter bf16->f32")
    sequence: dict[str, float] = dataclasses.field(default_factory=dict)  # `long_sequence`
    model_comm: dict[str, float] = dataclasses.field(default_factory=dict)  # `model_parallel_comm`
    pipeline: dict[str, float] = dataclasses.field(default_factory=dict)  # `pipeline_plan`
    accelerator: dict[str, float] = dataclasses.field(default_factory=dict)  # `accelerator_comm`

    def row(self) -> dict[str, Any]:
        m, a = self.memory, self.analytic
        n = self.num_params
        return {
            "stage": self.stage,
            "micro_batches_per_step": self.accumulation,
            "params_gib": m.params / GiB,
            "opt_state_gib": m.opt_state / GiB,
            "grads_gib": self.grads_bytes / GiB,
            "activations_other_gib": max(0, m.temp - self.grads_bytes) / GiB,
            "peak_gib": m.peak / GiB,
            "persistent_bytes_per_param": m.per_param(m.persistent),
            "device_persistent_bytes_per_param": m.per_param(m.device_persistent),
            "host_bytes_per_param": m.per_param(m.host),
            "jzero_formula_bytes_per_param": a.jzero_bytes / n,
            "zero_paper_gib": a.paper_bytes / GiB,
            "deepspeed_estimate_gib": a.deepspeed_bytes / GiB,
            "comm_elements_per_param": self.comm_elements / n,
            "deepspeed_comm_per_param": a.comm_elements / n,
            "comm_ring_gib": self.comm_ring_bytes / GiB,
            "wire_gib": self.wire_bytes / GiB,
            **self._quantized(),
            **({} if self.flops is None else {"tflops_per_step": self.flops / 1e12}),
            "compile_s": self.compile_s,
            **self._experts(),
            **self.sequence,
            **self.model_comm,
            **self.pipeline,
            **self.accelerator,
        }

    def _quantized(self) -> dict[str, Any]:
        """ZeRO++: the wire against the unquantized step's, and what the backend widened (its
        bytes are counted as moved, not as the program asks)."""
        out: dict[str, Any] = {}
        if self.unquantized_wire_bytes:
            out = {"unquantized_wire_gib": self.unquantized_wire_bytes / GiB,
                   "wire_vs_unquantized": self.wire_bytes / self.unquantized_wire_bytes}
        if self.widened:
            out["widened_by_backend"] = ", ".join(self.widened)
        return out

    def _experts(self) -> dict[str, float]:
        """MoE models: the per-device state split into expert and non-expert bytes."""
        m = self.memory
        if not m.expert_params:
            return {}
        return {"all_to_alls_per_step": self.all_to_alls, "all_to_all_gib": self.all_to_all_bytes / GiB,
                "expert_params_gib": m.expert_params / GiB, "expert_opt_state_gib": m.expert_opt_state / GiB,
                "non_expert_params_gib": (m.params - m.expert_params) / GiB,
                "non_expert_opt_state_gib": (m.opt_state - m.expert_opt_state) / GiB}


def fits(row: dict[str, Any], device_gb: float) -> str:
    """Whether an estimate `Estimate.row` fits a device of ``device_gb`` GB (10^9 bytes), and where
    blockwise attention is in use, whether the same step with naive attention would."""
    capacity = device_gb * 1e9 / GiB

    def verdict(peak: float) -> str:
        return (f"fits with {capacity - peak:.1f} GiB to spare" if peak <= capacity
                else f"does not fit, by {peak - capacity:.1f} GiB")

    line = (f"ZeRO-{row['stage']}: peak {row['peak_gib']:.2f} GiB per device on a {device_gb:g} GB device "
            f"({capacity:.1f} GiB): {verdict(row['peak_gib'])}")
    saved = row.get("saved_by_blockwise_attention_gib")
    if saved is not None:
        naive = row["peak_gib"] + saved
        line += f"; with naive attention, peak {naive:.2f} GiB: {verdict(naive)}"
    return line


class CompiledStep(NamedTuple):
    compiled: Any  # the executable
    state: TrainState  # the abstract state it was compiled for (ShapeDtypeStructs with shardings)
    batch: dict[str, jax.ShapeDtypeStruct]
    model: models.Model
    compile_s: float


def compile_step(config: Config, devices: list[Any] | None = None) -> CompiledStep:
    """The config's training step compiled on abstract shapes for its reference model, for
    ``devices`` (default: this host's; `jzero.analysis.target.devices` for a TPU topology);
    nothing is allocated."""
    model = models.build(config)
    state = abstract_init(model.init_fn, config, loss_fn=model.loss_fn, mesh=make_mesh(config, devices),
                          stages=model.stages)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=state.plan.batch)
             for k, v in model.batch_spec(state.config.train_batch_size).items()}
    t0 = time.perf_counter()
    compiled = train_step.lower(state, batch).compile()
    return CompiledStep(compiled, state, batch, model, time.perf_counter() - t0)


def estimate(config: Config, stage: int | None = None, devices: list[Any] | None = None) -> Estimate:
    """Compile the config's training step at ``stage`` (default: the config's) for ``devices``
    (`compile_step`) and measure it."""
    if stage is not None:
        config = dataclasses.replace(config, zero_optimization=dataclasses.replace(
            config.zero_optimization, stage=stage))
        check_zero(config.zero_optimization)
    compiled, state, _, model, compile_s = compile_step(config, devices)
    cfg, mesh = state.config, state.plan.mesh
    mem = profile.memory(compiled)
    comm = profile.comm(compiled)
    # Stages 0-1 (and a pipeline) hold each device's unreduced gradient of its whole share of the
    # model (split by the stages and tensor groups, not by ZeRO) until the step's one reduction.
    reduce_once = ZERO_RULES[cfg.zero_optimization.stage].reduce_once or cfg.pipeline.stages > 1
    layouts = [NamedSharding(mesh, keeping(s.spec, lambda a: a not in DATA_AXES)) for s in
               jax.tree.leaves(state.plan.compute)] if reduce_once else jax.tree.leaves(state.plan.grads)
    grads = sum(profile.shard_bytes(x.shape, x.dtype, s)
                for x, s in zip(jax.tree.leaves(state.params), layouts, strict=True))
    a2a = [c for c in comm.collectives if DISPATCH in c.op_name and c.group_size > 1]  # MoE's tokens
    zero = _zero_comm(comm, mesh)
    unquantized = None
    if cfg.zero_optimization.zero_quantized_weights or cfg.zero_optimization.zero_quantized_gradients:
        plain = dataclasses.replace(cfg.zero_optimization, zero_quantized_weights=False,
                                    zero_quantized_gradients=False)
        plain_step = compile_step(dataclasses.replace(config, zero_optimization=plain), devices).compiled
        unquantized = _zero_comm(profile.comm(plain_step), mesh).total_wire_bytes()
    widened = tuple(sorted({f"{c.kind} {c.dtype}->{c.widened_to}" for c in zero.collectives if c.widened_to}))
    return Estimate(stage=cfg.zero_optimization.stage, accumulation=cfg.gradient_accumulation_steps,
                    mesh=dict(mesh.shape), num_params=mem.num_params,
                    memory=mem, grads_bytes=grads, comm_elements=zero.total_elements(),
                    comm_ring_bytes=comm.total_ring_bytes(), flops=None if devices else profile.flops(compiled),
                    analytic=_analytic(state), compile_s=compile_s, all_to_alls=sum(c.count for c in a2a),
                    all_to_all_bytes=sum(c.elements * DTYPE_BYTES.get(c.dtype, 4) * c.count for c in a2a),
                    wire_bytes=zero.total_wire_bytes(), unquantized_wire_bytes=unquantized, widened=widened,
                    sequence=long_sequence(config, mem, devices) if attention.long_context(model.spec) else {},
                    model_comm=model_parallel_comm(comm, mesh), pipeline=pipeline_plan(compiled.as_text(), cfg),
                    accelerator=accelerator_comm(compiled, comm, mesh, cfg) if devices else {})


def accelerator_comm(compiled: Any, comm: profile.CommReport, mesh: Any, cfg: Config) -> dict[str, float]:
    """What a target's compiled program moves, by collective kind (GiB each device sends per step in
    ZeRO's accounting, `profile.Collective.wire_bytes`: the TPU compiler may run an all-gather or a
    reduce-scatter as an all-reduce, and then it is counted as one), DeepSpeed's formula in the
    same units (its elements, `profile.analytic`, at jzero's wire dtypes: the updated fp32 params
    gathered once at stages 1-2, each layer's compute-dtype params twice a micro-batch at stage 3,
    gradients in the communication dtype), and the share of those bytes the schedule runs beside
    compute (`overlap.overlapped`)."""
    out = {f"{kind.replace('-', '_')}_wire_gib": 0.0 for kind in hlo.COLLECTIVES}
    for (kind, _), nbytes in comm.wire_bytes_by_kind_dtype().items():
        out[f"{kind.replace('-', '_')}_wire_gib"] += nbytes / GiB
    out = {k: v for k, v in out.items() if v}
    policy = precision.policy(cfg)
    psi, stage, k = profile.memory(compiled).num_params, cfg.zero_optimization.stage, cfg.gradient_accumulation_steps
    compute, reduced_in = (jax.numpy.dtype(d).itemsize for d in (policy.compute_dtype, policy.comm_dtype))
    # stages 1-2 gather the updated fp32 params, stage 3 each layer's in the compute dtype twice
    gathered = {0: 0, 1: 4 * psi, 2: 4 * psi, 3: 2 * k * psi * compute}[stage]
    reduced = {0: 2, 1: 1, 2: k, 3: k}[stage] * psi * reduced_in
    out["formula_wire_gib"] = (gathered + reduced) / GiB if data_parallel_size(mesh) > 1 else 0.0
    out["overlapped_comm_fraction"] = overlap.overlapped(compiled).fraction
    return out


def pipeline_plan(text: str, cfg: Config) -> dict[str, float]:
    """A pipelined step's schedule and traffic: its ticks, the idle fraction of the schedule the
    step runs (`jzero.zero.pipeline.table`) beside its closed form (DeepSpeed's at repeats 1),
    the micro-batches whose forward residuals a stage keeps at once (its stash's slots), and the
    GiB each device sends to another stage per step (every collective-permute of the compiled
    program, idle ticks' included, in the compute dtype; circular stages' once-a-step exchange
    of the stack adds its permutes, not its all-to-alls). Memory rows are per device, the same
    on every stage: one program runs them all."""
    p, m, v = cfg.pipeline.stages, cfg.gradient_accumulation_steps, cfg.pipeline.repeats
    if p == 1:
        return {}
    permutes = [i for i in hlo.parse(text).instructions() if i.op in ("collective-permute", "collective-permute-start")]
    # in the compute dtype the step sends (XLA:CPU widens a bf16 collective-permute to f32)
    width = jax.numpy.dtype(precision.policy(cfg).compute_dtype).itemsize
    sent = sum(i.count * math.prod(dims) * width for i in permutes for _, dims in hlo.shapes(i.result)[:1])
    return {"pipeline_stages": p, "pipeline_repeats": v, "pipeline_ticks": pipeline.ticks(p, m, v),
            "bubble_fraction": pipeline.idle_fraction(p, m, v), "bubble_formula": pipeline.bubble_formula(p, m, v),
            "micro_batches_kept": pipeline.stash_size(p, m, v), "between_stages_gib": sent / GiB}


def model_parallel_comm(comm: profile.CommReport, mesh: Any) -> dict[str, float]:
    """The collectives over the tensor and sequence groups (Megatron's all-reduces or all-gathers
    and reduce-scatters, Ulysses' all-to-alls): how many a step runs and the GiB each device's
    results hold, by kind and axes."""
    out: dict[str, float] = {}
    for (kind, axes), traffic in sorted(profile.by_axes(comm, mesh).items()):
        if set(axes) & set(MODEL_AXES):
            name = f"{kind.replace('-', '_')}_over_{'_'.join(axes)}"
            out[f"{name}_per_step"] = float(traffic.count)
            out[f"{name}_gib"] = traffic.nbytes / GiB
    return out


def long_sequence(config: Config, mem: profile.MemoryReport, devices: list[Any] | None = None) -> dict[str, float]:
    """What attention and the language-model loss cost per device: attention's share of the
    temporaries (the step compiled once more without attention: `attention.absent`), and where
    the config uses them, what blockwise attention, the tiled loss and the tiled feed-forward
    save (the peak of the same step with naive attention, whole logits, an untiled feed-forward).
    `estimate` asks only for a `attention.long_context` model (each row is another compile)."""
    with attention.absent():
        bare = profile.memory(compile_step(dataclasses.replace(config), devices).compiled)
    if bare.temp == mem.temp:
        return {}
    out = {"attention_temp_gib": (mem.temp - bare.temp) / GiB}
    model = config.jzero.model
    for name, change in _savings(config).items():
        other = dataclasses.replace(config, jzero=dataclasses.replace(
            config.jzero, model=dataclasses.replace(model, **change)))
        out[name] = (profile.memory(compile_step(other, devices).compiled).peak - mem.peak) / GiB
    return out


def _savings(config: Config) -> dict[str, dict[str, Any]]:
    """The long-sequence features this config's model uses, each as the model-section change that
    turns it off: blockwise attention (in use from ``blockwise_from`` tokens, or under a sparse
    layout), and the GPT's tiled loss and tiled feed-forward (each in use above one tile of tokens
    a device)."""
    spec = models.build(config).spec
    out: dict[str, dict[str, Any]] = {}
    settings = spec.attention
    blockwise = settings.implementation == "blockwise" or getattr(spec, "sparse_attention", None) is not None or (
        settings.implementation == "auto" and spec.seq_len >= settings.blockwise_from)
    if blockwise:
        out["saved_by_blockwise_attention_gib"] = {"attention": dataclasses.replace(settings, implementation="naive")}
    tokens = config.train_micro_batch_size_per_gpu * spec.seq_len
    for key, row in (("loss_tile", "saved_by_tiled_loss_gib"), ("mlp_tile", "saved_by_tiled_mlp_gib")):
        if getattr(spec, key, 0) and tokens > getattr(spec, key):
            out[row] = {key: 0}
    return out


def _zero_comm(comm: profile.CommReport, mesh: Any) -> profile.CommReport:
    """ZeRO's collectives: all but MoE's token all-to-alls, those over the tensor and sequence
    groups (`model_parallel_comm`) and those between pipeline stages (`pipeline_plan`)."""
    def zeros(c: profile.Collective) -> bool:
        model = bool(c.groups) and bool(set(profile.axes_of(c.groups[0], mesh)) & {STAGE, *MODEL_AXES})
        return DISPATCH not in c.op_name and c.group_size > 1 and not model
    return profile.CommReport(tuple(c for c in comm.collectives if zeros(c)))


def _analytic(state: TrainState) -> profile.Analytic:
    """The formulas for the state's params: non-expert params over the ZeRO group of
    ("fsdp", "expert"), each device's E / ep_size experts over "fsdp" (`jzero.zero.sharding`)."""
    cfg, mesh = state.config, state.plan.mesh
    # each device's share of a leaf a tensor group splits (and of a stack the stages split, whose
    # layers stay whole): ZeRO runs on it over the data devices
    split = [(mesh.shape[TENSOR] if TENSOR in str(s.spec) else 1, mesh.shape[STAGE] if STAGE in str(s.spec) else 1)
             for s in jax.tree.leaves(state.plan.params)]
    leaves = [(path, math.prod(x.shape) // (t * st), math.prod(x.shape[1:]) // t)
              for (path, x), (t, st) in zip(jax.tree_util.tree_flatten_with_path(state.params)[0], split, strict=True)]
    layer = sum(per_layer for path, _, per_layer in leaves if is_stacked(path))  # DeepSpeed's largest layer
    expert = sum(size for path, size, _ in leaves if is_expert(path)) // mesh.shape[EXPERT]
    dense = sum(size for _, size, _ in leaves) - expert * mesh.shape[EXPERT]
    parts = [profile.analytic(n, cfg.zero_optimization.stage, group, largest_layer_params=layer,
                              accumulation=cfg.gradient_accumulation_steps, offload=state.plan.offload is not None)
             for n, group in ((dense, mesh.shape[FSDP] * mesh.shape[EXPERT]), (expert, mesh.shape[FSDP])) if n]
    total = functools.reduce(operator.add, parts)
    # one data device (the model axes fill the mesh): ZeRO's formulas move nothing
    return total if data_parallel_size(mesh) > 1 else dataclasses.replace(total, comm_elements=0.0)

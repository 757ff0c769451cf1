"""Config: typed, frozen configuration with DeepSpeed's key names. The schema (here, `model`,
`attention`, `parallel`), its parser (`typed`), DeepSpeed's elasticity arithmetic (`elastic`), the checker of
`{param: default}` tables (`paramtable`), HF's "auto" (`hf`). The bottom layer: imports no jzero module outside it.

`typed` and `elastic` import no jzero module at all, so every module can read a `Config` and raise
`ConfigError` without pulling anything else in. `parse_config` turns a DeepSpeed ``ds_config`` dict into the
dataclasses below: an unknown key or a wrong type raises `ConfigError` with the dotted key path and what would
be valid; the batch rule (micro x accum x dp = train) is resolved against a data-parallel size and re-resolved
by `Config.for_dp` when the mesh differs. What DeepSpeed features jzero refuses, value ranges, and the
sections owned by other modules (optimizer, scheduler, remat, model) are checked above this module, by
`jzero.train.resolve.load_config`, the public entry point.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from jzero.config.attention import AttentionConfig, SparseAttentionConfig
from jzero.config.data import DataConfig
from jzero.config.elastic import micro_batch, v01, v02
from jzero.config.model import ModelConfig
from jzero.config.parallel import PipelineConfig, TensorParallelConfig, TPLayerSpec, data_devices, model_parallel_size
from jzero.config.typed import AUTO, ConfigError, ConfigWarning, auto_field, parse, read_json, to_dict, unknown

__all__ = ["AUTO", "AttentionConfig", "ConfigError", "ConfigWarning", "DataConfig", "ModelConfig",  # re-exported
           "PipelineConfig", "SparseAttentionConfig", "TPLayerSpec", "TensorParallelConfig", "data_devices",
           "model_parallel_size", "read_json", "unknown"]


# ---- Sections (the model's live in `model`, the attention ones in `attention`) --------------
@dataclass(frozen=True)
class OffloadConfig:
    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: bool = False
    nvme_path: str | None = None
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``. Bucket/overlap knobs are accepted: XLA schedules the collectives."""

    stage: Literal[0, 1, 2, 3] = 0
    stage3_param_persistence_threshold: int = auto_field(100_000)
    zero_hpz_partition_size: int = 1
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = auto_field(500_000_000)
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = auto_field(50_000_000)
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    sub_group_size: int = 1_000_000_000
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True
    elastic_checkpoint: bool = False
    load_from_fp32_weights: bool = True
    memory_efficient_linear: bool = True
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    mics_shard_size: int = -1


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False
    immediate_grad_update: bool = False


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: DeepSpeed's dynamic loss scaler (`loss_scale` 0 = dynamic, else static)."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    fp16_master_weights_and_grads: bool = False


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing``: present -> ``jzero.remat`` "full" ("offload" with
    ``cpu_checkpointing``) unless ``jzero.remat`` is set; the other keys have no XLA meaning."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class DataTypesConfig:
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: ``type`` is case-insensitive; ``params`` use DeepSpeed/torch names."""

    type: str = "AdamW"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MonitorConfig:
    """``tensorboard`` / ``csv_monitor`` (DeepSpeed's monitor sections)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "jzero"


@dataclass(frozen=True)
class MeshConfig:
    """Mesh shape. ``devices``: how many devices to use (default: all); ``fsdp``: ZeRO shard
    group size (default: ``zero_hpz_partition_size`` when > 1, else all devices)."""

    devices: int | None = None
    fsdp: int | None = None
    megatron_sequence_parallel: bool = False  # tensor group also splits the sequence outside the matmuls


@dataclass(frozen=True)
class ElasticityConfig:
    """DeepSpeed's ``elasticity`` (`jzero.config.elastic`): the global batch and micro-batch are chosen so
    that many data-parallel sizes train the same thing; DeepSpeed's defaults."""

    enabled: bool = False
    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    min_time: int = 0
    version: float = 0.2
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1


@dataclass(frozen=True)
class MoEConfig:
    """``moe``: DeepSpeed-MoE's layer arguments (`deepspeed.moe.layer.MoE`) for the reference GPT,
    plus the aux-loss coefficient and the MoE layer interval (Megatron-DeepSpeed's
    ``--moe-loss-coeff`` and ``--expert-interval``). Checked by `jzero.models.moe.validate`."""

    enabled: bool = True
    num_experts: int = 8
    ep_size: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_residual: bool = False
    noisy_gate_policy: Literal["Jitter", "RSample"] | None = None
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True
    aux_loss_coef: float = 0.01
    expert_interval: int = 1


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    eval_interval: int = 50
    eval_batches: int = 4


@dataclass(frozen=True)
class CheckpointConfig:
    """``jzero.checkpoint``: `jzero train` saves to ``OUT/checkpoints`` every ``interval`` steps
    (None: only at the end of the run and on SIGTERM/SIGINT), keeping the newest ``max_to_keep``."""

    interval: int | None = None
    max_to_keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class WatchdogConfig:
    """``jzero.watchdog`` (`jzero.runtime.watchdog`): a process whose phase of a step (data, compute,
    evaluation, checkpoint) outlasts ``step_timeout`` seconds (default ``"auto"``: 20 x the
    slowest recent step, at least ``min_timeout``) exits naming itself and the process holding the
    run up; multi-process start-up and its first barrier give up after ``startup_timeout``."""

    enabled: bool = True
    step_timeout: float | None = auto_field(None)
    min_timeout: float = 300.0
    startup_timeout: float = 300.0


@dataclass(frozen=True)
class ParamGroupConfig:
    """One ``jzero.param_groups`` entry (DeepSpeed's param groups, which it takes in code): the
    leaves whose name (``blocks/stacked/attn/w_qkv``) ``pattern`` finds (a regex, searched) take
    this ``weight_decay`` (default: the optimizer's) and ``lr_scale`` x the lr. The first
    matching group wins; the rest of the params are the group "default"."""

    pattern: str
    name: str | None = None
    weight_decay: float | None = None
    lr_scale: float = 1.0


@dataclass(frozen=True)
class FrozenConfig:
    """``jzero.frozen``: leaves whose name any of ``patterns`` finds are not trained (no gradient
    reduction, no optimizer state); ``compute_dtype``: store them in the compute dtype (bf16
    under bf16) instead of fp32."""

    patterns: tuple[str, ...] = ()
    compute_dtype: bool = False


@dataclass(frozen=True)
class LoraConfig:
    """``jzero.lora`` (`jzero.models.lora`): rank-``r`` adapters on the kernels of the modules
    whose path a ``target_modules`` regex finds (``q_proj``, ``v_proj`` ...), scaled by
    ``alpha / r``; every other param is frozen."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class JzeroConfig:
    """jzero's own section (DeepSpeed has no such keys)."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    remat: str = "full"
    compute_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    max_loss_scale: float = 2.0**24
    quantization_block_size: int = 2048  # ZeRO++ int8 block (benchmarks/zeropp.py: scales 0.2% of the wire)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    param_groups: tuple[ParamGroupConfig, ...] = ()
    frozen: FrozenConfig = field(default_factory=FrozenConfig)
    lora: LoraConfig | None = None
    auto: Literal["hf_defaults", "strict"] = "hf_defaults"  # HF Trainer "auto" keys: `jzero.config.hf`


@dataclass(frozen=True, eq=False)
class Config:
    """The resolved configuration. Compared and hashed by identity (it is static jit data)."""

    train_batch_size: int = auto_field(None)
    train_micro_batch_size_per_gpu: int = auto_field(None)
    gradient_accumulation_steps: int = auto_field(None)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    bf16: BF16Config = field(default_factory=BF16Config)
    fp16: FP16Config = field(default_factory=FP16Config)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = auto_field(1.0)  # DeepSpeed >= 0.19.3 clips at 1.0 unless told 0
    steps_per_print: int = 10
    seed: int = 42
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    zero_allow_untested_optimizer: bool = True
    zero_force_ds_cpu_optimizer: bool = False
    dump_state: bool = False
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    moe: MoEConfig | None = None
    sparse_attention: SparseAttentionConfig | None = None
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    sequence_parallel_size: int = 1  # DeepSpeed-Ulysses: devices splitting each sequence
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    elasticity: ElasticityConfig = field(default_factory=ElasticityConfig)
    jzero: JzeroConfig = field(default_factory=JzeroConfig)
    # Resolution record (not user keys).
    dp_size: int = field(default=1, metadata={"internal": True})
    given_batch: tuple = field(default=(None, None, None), metadata={"internal": True})
    source: Mapping[str, Any] = field(default_factory=dict, metadata={"internal": True})

    def for_dp(self, dp: int) -> "Config":
        """This config with the batch rule re-resolved for a data-parallel size of ``dp``."""
        if dp == self.dp_size:
            return self
        train, micro, accum = batch_rule(self, self.given_batch, dp)
        return dataclasses.replace(self, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                                   gradient_accumulation_steps=accum, dp_size=dp)

    def to_dict(self) -> dict:
        """The user-facing keys as plain JSON data (resolved values)."""
        out = to_dict(self)
        for name in ("dp_size", "given_batch", "source"):
            out.pop(name)
        return out


def parse_config(raw: Mapping[str, Any], dp_size: int | None = None) -> Config:
    """The typed `Config` of ``raw`` (a DeepSpeed/jzero dict with only schema keys) with the batch
    rule resolved for a data-parallel size of ``dp_size`` (default: ``jzero.mesh.devices``, else
    every device). ``"auto"`` batch keys are inferred by the rule; ``"auto"`` ZeRO sizes stay
    ``AUTO`` until the model is known (`with_hidden_size`)."""
    cfg = parse(Config, raw, "")
    if dp_size is None:
        dp_size = data_devices(cfg, cfg.jzero.mesh.devices or _device_count())
    batch = {k: None for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                               "gradient_accumulation_steps") if getattr(cfg, k) == AUTO}
    cfg = dataclasses.replace(cfg, **batch)
    given = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    for key, value in zip(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
                          given, strict=True):
        if value is not None and value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    train, micro, accum = batch_rule(cfg, given, dp_size)
    return dataclasses.replace(cfg, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                               gradient_accumulation_steps=accum, dp_size=dp_size, given_batch=given,
                               source=dict(raw))


def batch_rule(cfg: Config, given: tuple, dp: int) -> tuple[int, int, int]:
    """(train, micro, accum) for ``dp``: DeepSpeed's elasticity when enabled, else the batch rule."""
    if cfg.elasticity.enabled:
        return elastic_batch(cfg.elasticity, given, dp)
    return resolve_batch(*given, dp)


def elastic_batch(e: ElasticityConfig, given: tuple, dp: int) -> tuple[int, int, int]:
    """(train, micro, accum) by DeepSpeed's elasticity (`jzero.config.elastic`) for a data-parallel size
    of ``dp``; ConfigError naming the key when the section is wrong or ``dp`` is not valid."""
    sizes = list(e.micro_batch_sizes)
    checks = [("micro_batch_sizes", bool(sizes) and all(isinstance(m, int) and not isinstance(m, bool) and m > 0
                                                         for m in sizes), "must be a list of positive integers"),
              ("max_train_batch_size", bool(sizes) and e.max_train_batch_size >= max(sizes),
               "must be >= every micro batch size"),
              ("min_gpus", 1 <= e.min_gpus <= e.max_gpus, "must be >= 1 and <= max_gpus"),
              ("version", e.version in (0.1, 0.2), "must be 0.1 or 0.2"),
              ("model_parallel_size", e.model_parallel_size == 1, "jzero has no model parallelism; must be 1"),
              ("num_gpus_per_node", e.num_gpus_per_node >= 1, "must be >= 1")]
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"elasticity.{key}: {why}, got {getattr(e, key)!r}")
    if any(v is not None for v in given) and not e.ignore_non_elastic_batch_info:
        raise ConfigError("elasticity: sets train_batch_size, train_micro_batch_size_per_gpu and "
                          "gradient_accumulation_steps itself; remove them or set "
                          "elasticity.ignore_non_elastic_batch_info: true")
    if e.version == 0.1:
        train, valid = v01(sizes, e.max_train_batch_size, e.min_gpus, e.max_gpus, e.prefer_larger_batch)
    else:
        train, valid = v02(sizes, e.max_train_batch_size, dp, e.min_gpus, e.max_gpus, e.prefer_larger_batch,
                                   e.num_gpus_per_node, e.model_parallel_size)
    if dp not in valid:
        raise ConfigError(f"elasticity: a data-parallel size of {dp} is not valid for global batch {train}; "
                          f"valid sizes: {', '.join(map(str, valid))}")
    micro = micro_batch(train, dp, sizes)
    return train, micro, train // (micro * dp)


# HF's "auto" rules for the ZeRO sizes, from the model's hidden size h.
AUTO_SIZES = {"reduce_bucket_size": lambda h: h * h,
              "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
              "stage3_param_persistence_threshold": lambda h: 10 * h}


def with_hidden_size(cfg: Config, hidden: int) -> Config:
    """``cfg`` with its ``"auto"`` ZeRO sizes resolved from the model's hidden size (HF's rules)."""
    zero = cfg.zero_optimization
    updates = {key: rule(hidden) for key, rule in AUTO_SIZES.items() if getattr(zero, key) == AUTO}
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(zero, **updates)) if updates else cfg


def resolve_batch(train: int | None, micro: int | None, accum: int | None, dp: int) -> tuple[int, int, int]:
    """DeepSpeed's batch rule: train = micro x accum x dp; any two given -> the third inferred."""
    if dp < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {dp}")
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * dp:
            raise ConfigError(
                f"train_batch_size: {train} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {accum} x data-parallel size {dp} (= {micro * accum * dp})")
        return train, micro, accum
    if train is not None and micro is not None:
        accum, rem = divmod(train, micro * dp)
        if rem or accum == 0:
            raise ConfigError(f"train_batch_size: {train} is not a multiple of train_micro_batch_size_per_gpu "
                              f"{micro} x data-parallel size {dp} (= {micro * dp})")
        return train, micro, accum
    if train is not None:
        accum = accum or 1
        micro, rem = divmod(train, accum * dp)
        if rem or micro == 0:
            raise ConfigError(f"train_batch_size: {train} is not a multiple of gradient_accumulation_steps "
                              f"{accum} x data-parallel size {dp} (= {accum * dp})")
        return train, micro, accum
    if micro is not None:
        accum = accum or 1
        return micro * accum * dp, micro, accum
    raise ConfigError("train_batch_size: set train_batch_size or train_micro_batch_size_per_gpu "
                      "(with gradient_accumulation_steps, any two determine the third)")


def _device_count() -> int:
    import jax

    return jax.device_count()

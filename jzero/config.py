"""Typed, frozen configuration with DeepSpeed's key names and semantics.

`load_config` accepts a DeepSpeed ``ds_config.json`` (path or dict). Every key is checked against
the dataclasses below: an unknown key, a wrong type or an out-of-range value raises `ConfigError`
with the dotted key path and what would be valid. jzero's own keys live under ``"jzero"``.
The batch rule (micro x accum x dp = train) is resolved against the data-parallel size of the
mesh the config will run on, and re-resolved by `Config.for_dp` when the mesh differs.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

AUTO = "auto"


class ConfigError(ValueError):
    """A config key is unknown, mistyped, out of range or inconsistent; the message names the key."""


class ConfigWarning(UserWarning):
    """A DeepSpeed key that jzero accepts but that has no effect under XLA."""


def unknown(where: str, label: str, name: str, valid: Any, cutoff: float = 0.6) -> ConfigError:
    """The error for an unknown name, with the closest valid one suggested and all listed."""
    valid = list(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=cutoff)
    if not close:
        lowered = {v.lower(): v for v in valid}
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), lowered, n=1, cutoff=cutoff)]
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(f"{where}: unknown {label}; {hint}valid: {', '.join(valid)}")


def _auto(default: Any = None, **kw: Any) -> Any:
    """A field that may also be written as ``"auto"`` (resolved by `load_config`)."""
    return field(default=default, metadata={"auto": True}, **kw)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OffloadConfig:
    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: bool = False
    nvme_path: Optional[str] = None
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``. Bucket/overlap knobs are accepted: XLA schedules the collectives."""

    stage: Literal[0, 1, 2, 3] = 0
    stage3_param_persistence_threshold: int = _auto(100_000)
    zero_hpz_partition_size: int = 1
    overlap_comm: Optional[bool] = None
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = _auto(500_000_000)
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = _auto(50_000_000)
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
    number_checkpoints: Optional[int] = None
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

    devices: Optional[int] = None
    fsdp: Optional[int] = None


@dataclass(frozen=True)
class ModelConfig:
    """Reference model for the CLI. ``size`` picks a preset; other keys override it."""

    name: Literal["gpt"] = "gpt"
    size: str = "tiny"
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    d_ff: Optional[int] = None
    positions: Optional[Literal["learned", "rotary"]] = None
    tie_embeddings: Optional[bool] = None


@dataclass(frozen=True)
class DataConfig:
    """Training data: ``path`` is a text file/folder or a token file (.npy / .bin); none = the
    bundled corpus (the Python standard library's sources, byte level)."""

    path: Optional[str] = None
    dtype: Literal["uint8", "uint16", "int32"] = "uint16"
    heldout_fraction: float = 0.05
    max_bytes: int = 4_000_000


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    eval_interval: int = 50
    eval_batches: int = 4


@dataclass(frozen=True)
class CheckpointConfig:
    """``jzero.checkpoint``: `jzero train` saves to ``OUT/checkpoints`` every ``interval`` steps
    (None: only at the end of the run and on SIGTERM/SIGINT), keeping the newest ``max_to_keep``."""

    interval: Optional[int] = None
    max_to_keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class JzeroConfig:
    """jzero's own section (DeepSpeed has no such keys)."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    remat: str = "full"
    compute_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    max_loss_scale: float = 2.0**24
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass(frozen=True, eq=False)
class Config:
    """The resolved configuration. Compared and hashed by identity (it is static jit data)."""

    train_batch_size: int = _auto(None)
    train_micro_batch_size_per_gpu: int = _auto(None)
    gradient_accumulation_steps: int = _auto(None)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    bf16: BF16Config = field(default_factory=BF16Config)
    fp16: FP16Config = field(default_factory=FP16Config)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    activation_checkpointing: Optional[ActivationCheckpointingConfig] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: float = _auto(1.0)  # DeepSpeed >= 0.19.3 clips at 1.0 unless told 0
    steps_per_print: int = 10
    seed: int = 42
    communication_data_type: Optional[Literal["fp32", "fp16", "bf16"]] = None
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    zero_allow_untested_optimizer: bool = True
    zero_force_ds_cpu_optimizer: bool = False
    dump_state: bool = False
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    jzero: JzeroConfig = field(default_factory=JzeroConfig)
    # Resolution record (not user keys).
    dp_size: int = field(default=1, metadata={"internal": True})
    given_batch: tuple = field(default=(None, None, None), metadata={"internal": True})
    source: Mapping[str, Any] = field(default_factory=dict, metadata={"internal": True})

    def for_dp(self, dp: int) -> "Config":
        """This config with the batch rule re-resolved for a data-parallel size of ``dp``."""
        if dp == self.dp_size:
            return self
        train, micro, accum = resolve_batch(*self.given_batch, dp)
        return dataclasses.replace(self, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                                   gradient_accumulation_steps=accum, dp_size=dp)

    def to_dict(self) -> dict:
        """The user-facing keys as plain JSON data (resolved values)."""
        out = _to_dict(self)
        for name in ("dp_size", "given_batch", "source"):
            out.pop(name)
        return out


# --------------------------------------------------------------------------------------------
# DeepSpeed features jzero refuses (they change what is trained or where memory lives) and
# diagnostics keys it accepts as no-ops (warned once).
# --------------------------------------------------------------------------------------------
UNSUPPORTED_SECTIONS = {
    "pipeline": "pipeline parallelism is not implemented; jzero shards with ZeRO over the mesh",
    "moe": "mixture-of-experts layers are not implemented",
    "sparse_attention": "DeepSpeed sparse attention kernels are not implemented",
    "amp": "NVIDIA apex AMP does not exist in JAX; use the bf16 or fp16 section",
    "compression_training": "compression training is not implemented",
    "curriculum_learning": "curriculum learning is not implemented",
    "data_efficiency": "data-efficiency sampling is not implemented",
    "elasticity": "elastic training is not implemented; checkpoints restore onto any mesh instead",
    "aio": "NVMe offload (aio) is not implemented",
    "wandb": "Weights & Biases monitoring is not implemented; use tensorboard or csv_monitor",
    "comet": "Comet monitoring is not implemented; use tensorboard or csv_monitor",
    "hybrid_engine": "the RLHF hybrid engine is not implemented",
    "sequence_parallel_size": "sequence parallelism is not implemented",
    "tensor_parallel": "DeepSpeed AutoTP is not implemented; give the model PartitionSpecs instead",
}
NOOP_SECTIONS = {"flops_profiler", "comms_logger", "autotuning", "checkpoint", "gradient_predivide",
                 "zero_optimization_stage"}


def load_config(source: str | os.PathLike | Mapping[str, Any], *, dp_size: int | None = None) -> Config:
    """Parse, validate and resolve a jzero/DeepSpeed config (a JSON file path or a dict).

    ``dp_size`` is the data-parallel size the batch rule is checked against; by default the
    number of devices the config's mesh will use (``jzero.mesh.devices`` or all devices).
    """
    raw = _read(source)
    raw = {k: v for k, v in raw.items() if not k.startswith("_comment")}
    for key in raw:
        if key in UNSUPPORTED_SECTIONS and _enabled(raw[key]):
            raise ConfigError(f"{key}: not supported by jzero: {UNSUPPORTED_SECTIONS[key]}")
    noops = sorted(k for k in raw if k in NOOP_SECTIONS or (k in UNSUPPORTED_SECTIONS))
    parsed = {k: v for k, v in raw.items() if k not in NOOP_SECTIONS and k not in UNSUPPORTED_SECTIONS}
    cfg = _parse(Config, parsed, "")
    if cfg.activation_checkpointing is not None and "remat" not in raw.get("jzero", {}):
        remat = "offload" if cfg.activation_checkpointing.cpu_checkpointing else "full"
        cfg = dataclasses.replace(cfg, jzero=dataclasses.replace(cfg.jzero, remat=remat))
    _check_unsupported_zero(cfg.zero_optimization)
    if noops:
        warnings.warn(f"jzero ignores these DeepSpeed sections (no effect under XLA): {', '.join(noops)}",
                      ConfigWarning, stacklevel=2)
    cfg = _resolve_auto(cfg)
    _validate(cfg)
    if dp_size is None:
        dp_size = cfg.jzero.mesh.devices or _device_count()
    given = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    train, micro, accum = resolve_batch(*given, dp_size)
    return dataclasses.replace(cfg, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                               gradient_accumulation_steps=accum, dp_size=dp_size, given_batch=given,
                               source=raw)


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


# --------------------------------------------------------------------------------------------
# Generic typed parsing
# --------------------------------------------------------------------------------------------
def _read(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
    return data


def _enabled(value: Any) -> bool:
    if isinstance(value, Mapping):
        return bool(value.get("enabled", True)) and bool(value)
    return bool(value)


def _parse(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected an object, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            raise unknown(where, "key", key, sorted(fields))
        if value == AUTO and fields[key].metadata.get("auto"):
            values[key] = AUTO
            continue
        values[key] = _coerce(hints[key], value, where)
    return cls(**values)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if dataclasses.is_dataclass(tp):
        return _parse(tp, value, where)
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if tp is tuple:
        return tuple(value)
    raise TypeError(f"unhandled config type {tp} at {where}")


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: _to_dict(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


# --------------------------------------------------------------------------------------------
# "auto", consistency checks
# --------------------------------------------------------------------------------------------
def _device_count() -> int:
    import jax

    return jax.device_count()


def _resolve_auto(cfg: Config) -> Config:
    """HF-style ``"auto"``: from the model (hidden size h) where jzero knows it, else an error."""
    from jzero.models.gpt import gpt_config  # the model section is the only source of h

    def hidden() -> int:
        return gpt_config(cfg.jzero.model).d_model

    zero = cfg.zero_optimization
    zero_updates = {}
    for key, fn in (("reduce_bucket_size", lambda h: h * h),
                    ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
                    ("stage3_param_persistence_threshold", lambda h: 10 * h)):
        if getattr(zero, key) == AUTO:
            zero_updates[key] = fn(hidden())
    batch = {k: None for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                               "gradient_accumulation_steps") if getattr(cfg, k) == AUTO}
    if cfg.gradient_clipping == AUTO:
        raise ConfigError("gradient_clipping: 'auto' has no source in jzero (no HF TrainingArguments); "
                          "set a number (0 = off)")
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(zero, **zero_updates), **batch)


def _check_unsupported_zero(zero: ZeroConfig) -> None:
    for name in ("offload_optimizer", "offload_param"):
        device = getattr(zero, name).device
        if device != "none":
            raise ConfigError(f"zero_optimization.{name}.device: '{device}' offload is not supported "
                              "(valid: 'none'); ZeRO-3 sharding over more devices is the jzero way")
    for name in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zero, name):
            raise ConfigError(f"zero_optimization.{name}: quantized ZeRO++ collectives are not supported "
                              "(valid: false)")
    if zero.mics_shard_size > 0:
        raise ConfigError("zero_optimization.mics_shard_size: MiCS is not supported; "
                          "use zero_hpz_partition_size for hierarchical sharding")


def _positive(where: str, value: Any, minimum: float = 1) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")


def _validate(cfg: Config) -> None:
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "steps_per_print"):
        _positive(key, getattr(cfg, key))
    _positive("gradient_clipping", cfg.gradient_clipping, 0)
    zero = cfg.zero_optimization
    _positive("zero_optimization.zero_hpz_partition_size", zero.zero_hpz_partition_size)
    _positive("zero_optimization.stage3_param_persistence_threshold", zero.stage3_param_persistence_threshold, 0)
    fp16 = cfg.fp16
    if cfg.bf16.enabled and fp16.enabled:
        raise ConfigError("bf16.enabled and fp16.enabled: choose one mixed-precision mode")
    _positive("fp16.loss_scale", fp16.loss_scale, 0)
    _positive("fp16.loss_scale_window", fp16.loss_scale_window)
    _positive("fp16.hysteresis", fp16.hysteresis)
    _positive("fp16.initial_scale_power", fp16.initial_scale_power, 0)
    if fp16.min_loss_scale <= 0:
        raise ConfigError(f"fp16.min_loss_scale: must be > 0, got {fp16.min_loss_scale}")
    if cfg.jzero.max_loss_scale < max(fp16.min_loss_scale, 1.0):
        raise ConfigError(f"jzero.max_loss_scale: must be >= fp16.min_loss_scale, got {cfg.jzero.max_loss_scale}")
    mesh = cfg.jzero.mesh
    _positive("jzero.mesh.devices", mesh.devices)
    _positive("jzero.mesh.fsdp", mesh.fsdp)
    train = cfg.jzero.train
    _positive("jzero.train.steps", train.steps)
    _positive("jzero.train.eval_interval", train.eval_interval)
    _positive("jzero.train.eval_batches", train.eval_batches)
    _positive("jzero.checkpoint.interval", cfg.jzero.checkpoint.interval)
    _positive("jzero.checkpoint.max_to_keep", cfg.jzero.checkpoint.max_to_keep)
    if not 0 < cfg.jzero.data.heldout_fraction < 1:
        raise ConfigError(f"jzero.data.heldout_fraction: must be in (0, 1), got {cfg.jzero.data.heldout_fraction}")
    # Deferred imports: these modules own the name tables the config is checked against.
    from jzero.models.gpt import gpt_config
    from jzero.optim import validate_optimizer
    from jzero.remat import POLICIES
    from jzero.schedules import validate_scheduler

    if cfg.jzero.remat not in POLICIES:
        raise unknown("jzero.remat", f"policy '{cfg.jzero.remat}'", cfg.jzero.remat, POLICIES)
    gpt_config(cfg.jzero.model)
    validate_optimizer(cfg.optimizer)
    if cfg.scheduler is not None:
        validate_scheduler(cfg.scheduler, cfg)

"""`load_config`: a DeepSpeed/jzero config parsed, checked and resolved, ready to train.

`jzero.config` parses the schema; this module adds jzero's policy on top and is the one place
each section's owner checks and resolves it: the optimizer (`jzero.zero.optim.validate`), the
scheduler (`jzero.zero.schedules.validate`), the remat policy (`jzero.zero.remat.validate`) and the
reference model (`jzero.models.validate`). Resolved optimizer and scheduler params (defaults
filled in, ``"auto"`` replaced) are stored in the Config once, so nothing re-resolves them.
DeepSpeed features jzero refuses raise `ConfigError`; diagnostics sections it accepts as no-ops
warn once. ``"auto"`` ZeRO sizes are resolved from the model actually trained, when its params'
shapes are known (`resolve_auto_sizes`, called by `jzero.init`).
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import jax

from jzero import models
from jzero.config import (
    AUTO,
    AUTO_SIZES,
    Config,
    ConfigError,
    ConfigWarning,
    ZeroConfig,
    hf,
    parse_config,
    read_json,
    with_hidden_size,
)
from jzero.models import lora, moe
from jzero.zero import groups, optim, pipeline, remat, schedules

# DeepSpeed features jzero refuses (they change what is trained or where memory lives).
UNSUPPORTED_SECTIONS = {
    "amp": "NVIDIA apex AMP does not exist in JAX; use the bf16 or fp16 section",
    "compression_training": "compression training is not implemented",
    "curriculum_learning": "curriculum learning is not implemented",
    "data_efficiency": "data-efficiency sampling is not implemented",
    "aio": "NVMe offload (aio) is not implemented",
    "wandb": "Weights & Biases monitoring is not implemented; use tensorboard or csv_monitor",
    "comet": "Comet monitoring is not implemented; use tensorboard or csv_monitor",
    "hybrid_engine": "the RLHF hybrid engine is not implemented",
}
# Diagnostics sections accepted as no-ops (warned once).
NOOP_SECTIONS = {"flops_profiler", "comms_logger", "autotuning", "checkpoint", "gradient_predivide",
                 "zero_optimization_stage"}


def load_config(source: str | os.PathLike | Mapping[str, Any], *, dp_size: int | None = None) -> Config:
    """Parse, check and resolve a jzero/DeepSpeed config (a JSON file path or a dict).

    ``dp_size`` is the data-parallel size the batch rule is checked against; by default the
    number of devices the config's mesh will use (``jzero.mesh.devices`` or all devices).
    """
    raw = _fill_trainer_auto({k: v for k, v in read_json(source).items() if not k.startswith("_comment")})
    for key in raw:
        if key in UNSUPPORTED_SECTIONS and _enabled(raw[key]):
            raise ConfigError(f"{key}: not supported by jzero: {UNSUPPORTED_SECTIONS[key]}")
    noops = sorted(k for k in raw if k in NOOP_SECTIONS or k in UNSUPPORTED_SECTIONS)
    _check_elasticity_keys(raw)
    cfg = parse_config({k: v for k, v in raw.items() if k not in noops}, dp_size)
    if cfg.activation_checkpointing is not None and "remat" not in raw.get("jzero", {}):
        remat_name = "offload" if cfg.activation_checkpointing.cpu_checkpointing else "full"
        cfg = dataclasses.replace(cfg, jzero=dataclasses.replace(cfg.jzero, remat=remat_name))
    check_zero(cfg.zero_optimization)
    if cfg.moe is not None and not cfg.moe.enabled:
        cfg = dataclasses.replace(cfg, moe=None)
    if noops:
        warnings.warn(f"jzero ignores these DeepSpeed sections (no effect under XLA): {', '.join(noops)}",
                      ConfigWarning, stacklevel=2)
    _check_ranges(cfg)
    _check_model_parallel(cfg)
    remat.validate(cfg.jzero.remat)
    models.validate(cfg, named="model" in raw.get("jzero", {}))
    moe.validate(cfg)
    if cfg.jzero.lora is not None:  # the adapters train, nothing else
        lora.validate(cfg.jzero.lora)
        frozen = dataclasses.replace(cfg.jzero.frozen, patterns=(*cfg.jzero.frozen.patterns, lora.FROZEN))
        cfg = dataclasses.replace(cfg, jzero=dataclasses.replace(cfg.jzero, frozen=frozen))
    groups.validate(cfg)
    cfg = dataclasses.replace(cfg, optimizer=optim.validate(cfg.optimizer), source=raw)
    return dataclasses.replace(cfg, scheduler=schedules.validate(cfg))


def _fill_trainer_auto(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the "auto" keys only HF's Trainer fills given the Trainer's defaults (one
    warning lists them), or one error listing them all under ``jzero.auto: strict``."""
    filled_raw, filled = hf.fill(raw)
    if not filled:
        return raw
    section = raw.get("jzero")
    if isinstance(section, Mapping) and section.get("auto") == "strict":
        finder = " (an lr: or run jzero train --auto-lr)" if "optimizer.params.lr" in filled else ""
        raise ConfigError(f"jzero.auto: strict, and these keys are 'auto', which only HF's Trainer fills (from its "
                          f"TrainingArguments): {', '.join(filled)}; set each to a value{finder}")
    warnings.warn(hf.describe(filled), ConfigWarning, stacklevel=3)
    return filled_raw


def resolve_auto_sizes(config: Config, params_shape: Any) -> Config:
    """``config`` with ``"auto"`` ZeRO sizes (HF's rules: h², 0.9·h², 10·h) resolved from the
    hidden size of the model actually trained, read from its params' shapes (`hidden_size`)."""
    zero = config.zero_optimization
    if not any(getattr(zero, key) == AUTO for key in AUTO_SIZES):
        return config
    return with_hidden_size(config, hidden_size(params_shape))


def hidden_size(params_shape: Any) -> int:
    """The model's hidden size: the dimension its params share most (every leaf's dims counted,
    a stacked layer dimension included; ties go to the larger size). For a transformer that is
    d_model: it sizes the embeddings, every projection and every norm."""
    counts = Counter(d for leaf in jax.tree.leaves(params_shape) for d in leaf.shape)
    if not counts:
        raise ConfigError("zero_optimization: 'auto' sizes need a model with parameters")
    return max(counts, key=lambda d: (counts[d], d))


def _check_elasticity_keys(raw: Mapping[str, Any]) -> None:
    """DeepSpeed requires these two keys of an enabled ``elasticity`` section (no defaults)."""
    section = raw.get("elasticity")
    if isinstance(section, Mapping) and section.get("enabled") is True:
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if key not in section:
                raise ConfigError(f"elasticity.{key}: required when elasticity is enabled (DeepSpeed has no default)")


def _check_model_parallel(cfg: Config) -> None:
    """ConfigError naming the key when pipeline, tensor or sequence parallelism meets what it does
    not compose with: MoE (experts split over the data devices only), ZeRO++'s int8 wire and
    offload (both flatten or move whole shards, which the compiler's model axes would gather);
    a pipeline also not with Ulysses (its stages move whole sequences)."""
    tp, sp, zero, pp = cfg.tensor_parallel, cfg.sequence_parallel_size, cfg.zero_optimization, cfg.pipeline
    if tp.autotp_size < 0:
        raise ConfigError(f"tensor_parallel.autotp_size: must be >= 0 (0 or 1: off), got {tp.autotp_size}")
    if sp < 1:
        raise ConfigError(f"sequence_parallel_size: must be >= 1, got {sp}")
    if pp.stages < 1:
        raise ConfigError(f"pipeline.stages: must be >= 1 (1: off), got {pp.stages}")
    pipeline.check_method(pp.partition)
    pipeline.check_repeats(pp.stages, cfg.gradient_accumulation_steps, pp.repeats)
    if cfg.jzero.mesh.megatron_sequence_parallel and tp.size == 1:
        raise ConfigError("jzero.mesh.megatron_sequence_parallel: splits the tensor group's tokens; it needs "
                          "tensor_parallel.autotp_size > 1")
    if pp.stages > 1 and sp > 1:
        raise ConfigError(f"pipeline.stages: not with sequence_parallel_size {sp} (a stage sends whole sequences)")
    if tp.size * sp * pp.stages == 1:
        return
    key = next(k for k, n in (("pipeline.stages", pp.stages), ("tensor_parallel.autotp_size", tp.size),
                              ("sequence_parallel_size", sp)) if n > 1)
    refused = [("moe", cfg.moe is not None, "experts are split over the data devices only"),
               ("zero_optimization.zero_quantized_weights", zero.zero_quantized_weights, "int8 blocks flatten a "
                "shard"), ("zero_optimization.zero_quantized_gradients", zero.zero_quantized_gradients,
                           "int8 blocks flatten a shard"),
               ("zero_optimization.offload_optimizer", zero.offload_optimizer.device != "none", "not with a split "
                "model"), ("zero_optimization.offload_param", zero.offload_param.device != "none",
                           "not with a split model")]
    for other, on, why in refused:
        if on:
            raise ConfigError(f"{key}: not with {other} ({why})")


def _enabled(value: Any) -> bool:
    if isinstance(value, Mapping):
        return bool(value.get("enabled", True)) and bool(value)
    return bool(value)


def check_zero(zero: ZeroConfig) -> None:
    """ConfigError for a ``zero_optimization`` section jzero cannot run (checked again by
    whoever changes the stage after loading, e.g. `jzero estimate --stage`)."""
    _check_offload(zero)
    if zero.zero_quantized_weights and zero.stage != 3:
        raise ConfigError(f"zero_optimization.zero_quantized_weights: quantizes stage 3's weight all-gathers; "
                          f"needs stage 3 (got stage {zero.stage})")
    if zero.zero_quantized_gradients and zero.stage == 0:
        raise ConfigError("zero_optimization.zero_quantized_gradients: quantizes the gradient reduce-scatter of "
                          "stages 1-3; stage 0 all-reduces (got stage 0)")
    if zero.mics_shard_size > 0:
        raise ConfigError("zero_optimization.mics_shard_size: MiCS is not supported; "
                          "use zero_hpz_partition_size for hierarchical sharding")


def _check_offload(zero: ZeroConfig) -> None:
    """ZeRO-Offload (optimizer) at stages 1-3 and ZeRO-Infinity's parameter offload at stage 3,
    both to host memory; NVMe-only knobs are refused rather than ignored."""
    for name in ("offload_optimizer", "offload_param"):
        off = getattr(zero, name)
        where = f"zero_optimization.{name}"
        if off.device == "nvme":
            raise ConfigError(f"{where}.device: NVMe offload is not supported; use 'cpu' (host memory, "
                              "pinned with pin_memory: true)")
        if off.device == "none":
            continue
        if off.nvme_path is not None:
            raise ConfigError(f"{where}.nvme_path: only meaningful with device 'nvme', which is not supported")
        if off.ratio != 1.0:
            raise ConfigError(f"{where}.ratio: partial offload is not supported (valid: 1.0)")
        if not off.pin_memory:
            warnings.warn(f"{where}.pin_memory: false, but the compiled step can only write host arrays to "
                          "pinned host memory (XLA host offloading); using pinned memory", ConfigWarning, stacklevel=3)
        if off.buffer_count != 4 or off.fast_init:
            warnings.warn(f"{where}: buffer_count / fast_init tune DeepSpeed's NVMe and CPU-Adam buffers; "
                          "no effect here (XLA moves the arrays)", ConfigWarning, stacklevel=3)
    if zero.offload_optimizer.device == "cpu" and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3 (got stage 0)")
    if zero.offload_param.device == "cpu":
        if zero.stage != 3:
            raise ConfigError(f"zero_optimization.offload_param: parameter offload needs ZeRO stage 3 "
                              f"(got stage {zero.stage})")
        if zero.offload_optimizer.device != "cpu":
            raise ConfigError("zero_optimization.offload_param: needs offload_optimizer.device 'cpu' too "
                              "(the offloaded compute params are cast from the offloaded master copy)")


def offload_kinds(zero: ZeroConfig) -> tuple[str | None, str | None]:
    """(memory kind of master params + optimizer state, of compute params): "pinned_host" for
    offloaded sections, None on the device. Always pinned: a jitted program moves arrays only
    to pinned host memory (``device_put`` to "unpinned_host" inside ``jit`` is a no-op)."""
    def kind(off):
        return None if off.device == "none" else "pinned_host"

    return kind(zero.offload_optimizer), kind(zero.offload_param)


def _positive(where: str, value: Any, minimum: float = 1) -> None:
    if value is not None and value != AUTO and value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")


def _check_ranges(cfg: Config) -> None:
    _positive("steps_per_print", cfg.steps_per_print)
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
    _positive("jzero.quantization_block_size", cfg.jzero.quantization_block_size)
    _positive("jzero.mesh.devices", cfg.jzero.mesh.devices)
    _positive("jzero.mesh.fsdp", cfg.jzero.mesh.fsdp)
    for key in ("steps", "eval_interval", "eval_batches"):
        _positive(f"jzero.train.{key}", getattr(cfg.jzero.train, key))
    _positive("jzero.checkpoint.interval", cfg.jzero.checkpoint.interval)
    _positive("jzero.checkpoint.max_to_keep", cfg.jzero.checkpoint.max_to_keep)
    watch = cfg.jzero.watchdog
    for key in ("step_timeout", "min_timeout", "startup_timeout"):
        value = getattr(watch, key)
        if value != AUTO and value is not None and value <= 0:
            raise ConfigError(f"jzero.watchdog.{key}: must be > 0 seconds, got {value}")
    if not 0 < cfg.jzero.data.heldout_fraction < 1:
        raise ConfigError(f"jzero.data.heldout_fraction: must be in (0, 1), got {cfg.jzero.data.heldout_fraction}")

"""The model-parallel sections: DeepSpeed's ``tensor_parallel`` (AutoTP training), ``pipeline``
(its PipelineModule's stages) and the device arithmetic of ``sequence_parallel_size``
(DeepSpeed-Ulysses): what pipeline, tensor and sequence parallelism take of the devices, and so
the data-parallel size the batch rule sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from jzero.config.typed import ConfigError


@dataclass(frozen=True)
class TPLayerSpec:
    """One ``tensor_parallel.partition_config.layer_specs`` entry (DeepSpeed's AutoTP
    ``TPLayerSpec``): leaves whose name (``blocks/stacked/qkv/kernel``) any of ``patterns`` finds
    (regexes, searched) are split ``column`` (output features), ``row`` (input features) or
    ``skip`` (replicated) over the tensor group (`jzero.zero.autotp`)."""

    patterns: tuple[str, ...] = ()
    partition_type: Literal["row", "column", "skip"] = "column"


@dataclass(frozen=True)
class PartitionConfig:
    """``tensor_parallel.partition_config``: rules before (``use_default_specs``) or instead of
    the built-in table of the reference models' and common HF names."""

    use_default_specs: bool = True
    layer_specs: tuple[TPLayerSpec, ...] = ()


@dataclass(frozen=True)
class TensorParallelConfig:
    """DeepSpeed's ``tensor_parallel`` (AutoTP training): ``autotp_size`` devices split each
    layer's matmuls (Megatron's column/row split; 0 or 1: off). ``tp_overlap_comm`` and
    ``preset_model`` are accepted: XLA schedules the collectives, and the rule table covers the
    presets' names."""

    autotp_size: int = 0
    tp_overlap_comm: bool = False
    preset_model: str | None = None
    partition_config: PartitionConfig = field(default_factory=PartitionConfig)

    @property
    def size(self) -> int:
        return max(self.autotp_size, 1)


@dataclass(frozen=True)
class PipelineConfig:
    """DeepSpeed's ``pipeline`` section with its PipelineModule's arguments: ``stages`` devices
    in a row each hold a contiguous share of the model's layer stack (1: off), chosen by
    ``partition`` (DeepSpeed's ``partition_method``: "parameters", "uniform" or "type:REGEX"
    over the layers' class names; `jzero.zero.pipeline`). Micro-batches are
    ``gradient_accumulation_steps``, run by the 1F1B schedule. ``repeats`` > 1: circular
    (interleaved) stages, the stack cut into stages x repeats chunks dealt round-robin, each
    micro-batch going round the ring ``repeats`` times (MaxText's ``num_pipeline_repeats``,
    Megatron's virtual pipeline size)."""

    stages: int = 1
    partition: str = "parameters"
    repeats: int = 1


def model_parallel_size(cfg: Any) -> int:
    """Devices that hold one model replica's split: the pipeline's stages x the tensor group x
    the sequence group."""
    return cfg.pipeline.stages * cfg.tensor_parallel.size * cfg.sequence_parallel_size


def data_devices(cfg: Any, devices: int) -> int:
    """The data-parallel size of ``devices``: what tensor and sequence parallelism leave (DeepSpeed's
    dp world = world / (tp x sp)); ConfigError naming the key when they do not divide it."""
    if cfg.pipeline.stages < 1:
        raise ConfigError(f"pipeline.stages: must be >= 1 (1: off), got {cfg.pipeline.stages}")
    for key, size in (("pipeline.stages", cfg.pipeline.stages),
                      ("tensor_parallel.autotp_size", cfg.tensor_parallel.autotp_size),
                      ("sequence_parallel_size", cfg.sequence_parallel_size)):
        if size < 0 or (size > 1 and devices % size):
            raise ConfigError(f"{key}: {size} does not divide the {devices} devices of the mesh")
    if devices % model_parallel_size(cfg):
        raise ConfigError(f"pipeline.stages x tensor_parallel.autotp_size x sequence_parallel_size = "
                          f"{model_parallel_size(cfg)} does not divide the {devices} devices of the mesh")
    return devices // model_parallel_size(cfg)

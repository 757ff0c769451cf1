"""LoRA (Hu et al. 2021) on any model, from the config: ``jzero.lora: {r, alpha, target_modules}``.

A target is a module whose path a ``target_modules`` regex finds (``q_proj`` finds
``layers/stacked/self_attn/q_proj``, as PEFT's names find Hugging Face modules) and that has a
``kernel`` (``[in, out...]``, with the leading layer axis in a `scan_layers` stack). Beside its
kernel it gets ``lora_A`` ``[in, r]`` (PEFT's Kaiming-uniform init) and ``lora_B`` ``[r, out]``
(zeros, so training starts from the base model), and the model computes with
``kernel + alpha / r x lora_A @ lora_B``. Every other param is frozen (`jzero.zero.groups`:
no gradient reduction, no optimizer state; ``jzero.frozen.compute_dtype`` keeps them in bf16).

The adapters are merged into the weight where the weight is used, not rewritten into the model:
a stack's layer is merged inside the scan body after ZeRO-3's gather (`jzero.models.layers`
calls `merged` on each layer's params, so one layer's merged weight lives at a time and the
recompute of a remat policy merges again), the rest by the loss (`applied`). This works for a
Linen, NNX or plain-JAX model alike, costs ``2 x in x out x r`` FLOPs a target per layer
(``r / tokens`` of the layer's matmul), and needs no hook in the model's code. What it cannot
give is dropout on the adapter's input alone: ``dropout`` must be 0.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jzero.config import ConfigError, LoraConfig
from jzero.models.base import Stages
from jzero.zero import treepath
from jzero.zero.modelstate import Variables
from jzero.zero.sharding import STACKED_KEY

A, B = "lora_A", "lora_B"
SEED = 0x10A  # folded into the init key for the adapters' draws
FROZEN = rf"^(?!.*/{A}$)(?!.*/{B}$)"  # jzero.frozen's pattern under LoRA: every leaf but the adapters

_SCALE: contextvars.ContextVar[float | None] = contextvars.ContextVar("jzero_lora_scale", default=None)


def validate(cfg: LoraConfig) -> None:
    """ConfigError naming the ``jzero.lora`` key that cannot work."""
    if cfg.r < 1:
        raise ConfigError(f"jzero.lora.r: must be >= 1, got {cfg.r}")
    if cfg.dropout != 0:
        raise ConfigError(f"jzero.lora.dropout: {cfg.dropout} is not supported: jzero merges each adapter into its "
                          "weight where the layer runs, so dropout on the adapter's input alone has no place; use 0")
    if not cfg.target_modules:
        raise ConfigError("jzero.lora.target_modules: give regexes of the modules to adapt, e.g. [\"q_proj\", "
                          "\"v_proj\"] for a Hugging Face Llama, [\"qkv\", \"proj\"] for the reference GPT")
    for i, pattern in enumerate(cfg.target_modules):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"jzero.lora.target_modules[{i}]: {pattern!r} is not a regular expression "
                              f"({e})") from None


def targets(params: Any, cfg: LoraConfig) -> list[str]:
    """The paths (``a/b/module``) of the modules to adapt; ConfigError when none matches."""
    names = sorted({name.rsplit("/", 1)[0] for name in _names(params) if name.endswith("/kernel")})
    found = [n for n in names if any(re.search(p, n) for p in cfg.target_modules)]
    if not found:
        raise ConfigError(f"jzero.lora.target_modules: {list(cfg.target_modules)} matches no module with a kernel; "
                          f"modules: {', '.join(names) or 'none'}")
    return found


def _names(params: Any) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return [treepath.SEP.join(map(treepath.key_name, path)) for path, _ in leaves]


def with_adapters(params: Any, cfg: LoraConfig, rng: jax.Array) -> Any:
    """``params`` with ``lora_A`` / ``lora_B`` beside each target's kernel."""
    params = jax.tree.map(lambda x: x, params)  # a copy of the nesting, leaves shared
    for i, path in enumerate(targets(params, cfg)):
        module = _module(params, path)
        if A in module and B in module:  # a LoRA checkpoint's own adapters
            continue
        kernel = module["kernel"]
        stacked = STACKED_KEY in path.split("/")
        lead, fan_in = kernel.shape[:1] if stacked else (), kernel.shape[1 if stacked else 0]
        out = math.prod(kernel.shape[2 if stacked else 1:])
        bound = 1 / math.sqrt(fan_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) of an [r, in] weight
        module[A] = jax.random.uniform(jax.random.fold_in(rng, i), (*lead, fan_in, cfg.r), jnp.float32, -bound, bound)
        module[B] = jnp.zeros((*lead, cfg.r, out), jnp.float32)
    return params


def _module(params: Any, path: str) -> dict:
    node = params
    for key in path.split("/"):
        node = node[key]
    return node


def merged(params: Any, scale: float | None = None) -> Any:
    """``params`` with every adapted kernel merged (``kernel + scale x A @ B``, the kernel
    taking no gradient) and the adapters dropped; ``scale`` defaults to the one `scaled` set
    (a no-op without adapters). Stacked or not, any depth; it does not enter a stack."""
    scale = _SCALE.get() if scale is None else scale
    if scale is None or not isinstance(params, Mapping):
        return params
    if A in params and B in params:
        kernel = params["kernel"]
        delta = jnp.matmul(params[A], params[B]).reshape(kernel.shape) * scale
        rest = {k: v for k, v in params.items() if k not in (A, B, "kernel")}
        return {**rest, "kernel": jax.lax.stop_gradient(kernel) + delta.astype(kernel.dtype)}
    return {k: v if k == STACKED_KEY else merged(v, scale) for k, v in params.items()}


def merged_all(params: Any, scale: float) -> Any:
    """``params`` with every adapter merged, stacks included (export, inference)."""
    if not isinstance(params, Mapping):
        return params
    if A in params:
        return merged(params, scale)
    return {k: merged_all(v, scale) for k, v in params.items()}


def for_inference(params: Any, cfg: LoraConfig | None) -> Any:
    """``params`` as a model without adapters runs them (generation, held-out forward)."""
    return params if cfg is None else merged_all(params, scale_of(cfg))


def from_raw(config: Mapping[str, Any]) -> LoraConfig | None:
    """The ``jzero.lora`` section of a checkpoint's saved (raw) config, or None."""
    raw = config.get("jzero", {}).get("lora")
    if raw is None:
        return None
    return LoraConfig(**{**raw, "target_modules": tuple(raw.get("target_modules", ()))})


@contextlib.contextmanager
def scaled(scale: float) -> Iterator[None]:
    """Trace the model with adapters merged at ``scale`` (`jzero.models.layers` reads it)."""
    token = _SCALE.set(scale)
    try:
        yield
    finally:
        _SCALE.reset(token)


def current_scale() -> float | None:
    """The scale `scaled` set (None: no adapters are being merged)."""
    return _SCALE.get()


def scale_of(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.r


def applied(init_fn: Callable, loss_fn: Callable, stages: Stages | None, cfg: LoraConfig
            ) -> tuple[Callable, Callable, Stages | None]:
    """``(init_fn, loss_fn, stages)`` of the adapted model: params with adapters, the loss (and
    each pipeline stage) merging them."""
    scale = scale_of(cfg)

    def init(rng):
        out = init_fn(rng)
        if isinstance(out, Variables):
            return Variables(with_adapters(out.params, cfg, jax.random.fold_in(rng, SEED)), out.state)
        return with_adapters(out, cfg, jax.random.fold_in(rng, SEED))

    def merging(fn):  # the loss, or a pipeline stage: its unstacked adapters merged, the stacks' by run_stack
        def run(params, *rest):
            with scaled(scale):
                return fn(merged(params), *rest)
        return run

    if stages is not None:
        stages = stages._replace(embed=merging(stages.embed), layers=merging(stages.layers), head=merging(stages.head))
    return init, merging(loss_fn), stages

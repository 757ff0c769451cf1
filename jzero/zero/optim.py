"""The optimizer from the DeepSpeed ``optimizer`` section, as an optax transformation.

Names are case-insensitive and params use DeepSpeed/torch names (lr, betas, eps, weight_decay,
momentum, ...). Every optimizer is wrapped in `optax.inject_hyperparams`, so the lr (and
OneCycle's momentum) follow the schedule and the lr actually applied is readable from the state.
Gradient clipping is not part of the chain: the step computes the global norm once (it reports
it, and later folds it into fp16 unscaling) and scales the grads before calling ``update``.

Adam/AdamW run on the Pallas fused step (`jzero.zero.fused`) when ``optimizer.params.fused`` says so:
"auto" (default) = on GPU and TPU, off on CPU; true = on (CPU: Pallas interpret mode, slow, for
tests); false = off. Where no Pallas backend serves the platform, or its kernel does not compile
with the installed jax, the XLA path runs, with a one-line notice.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzero.config import Config, ConfigError, ConfigWarning, OptimizerConfig
from jzero.config.paramtable import Choice, canonical, resolve
from jzero.zero import fused, groups, schedules

FUSED = Choice(("auto", True, False), "auto")
CLIENT = "client"  # the optimizer type of a config trained with a client optimizer (tx=)
# canonical type -> {param: default}; DeepSpeed's defaults (FusedAdam, FusedLamb, Lion, torch SGD).
PARAMS: dict[str, dict[str, Any]] = {
    "Adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True,
             "bias_correction": True, "amsgrad": False, "torch_adam": False, "fused": FUSED},
    "AdamW": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
              "amsgrad": False, "torch_adam": False, "fused": FUSED},
    "Lamb": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
             "max_coeff": 10.0, "min_coeff": 0.01, "max_grad_norm": 0.0},
    "Lion": {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0},
    "SGD": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False, "dampening": 0.0},
    "Adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "initial_accumulator_value": 0.0},
}
# Values jzero cannot honour exactly: (param, value that is supported, why).
RESTRICTED = {
    "bias_correction": (True, "optax's Adam/Lamb always correct the bias"),
    "amsgrad": (False, "AMSGrad is not wired into the ZeRO step"),
    "dampening": (0.0, "SGD dampening has no optax equivalent"),
    "max_grad_norm": (0.0, "use the top-level gradient_clipping key"),
}


class Optimizer(NamedTuple):
    tx: optax.GradientTransformation
    schedules: schedules.Schedules


def validate(opt: OptimizerConfig) -> OptimizerConfig:
    """The section with its canonical type and every param checked, DeepSpeed's defaults filled
    in (what `build` reads; resolved once, by `jzero.train.resolve.load_config`)."""
    name = canonical("optimizer", opt.type, PARAMS)
    params = resolve("optimizer", name, PARAMS[name], opt.params)
    for key, (ok, why) in RESTRICTED.items():
        if key in params and params[key] != ok:
            raise ConfigError(f"optimizer.params.{key}: {params[key]!r} is not supported ({why}); valid: {ok!r}")
    if params["lr"] < 0:
        raise ConfigError(f"optimizer.params.lr: must be >= 0, got {params['lr']}")
    return OptimizerConfig(type=name, params=params)


# Defaults that stay compiled-in constants: injected, `optax.inject_hyperparams` turns a default
# into state, and eps_root (0 in every DeepSpeed optimizer) then costs ``nu + 0``, one more pass
# over every element (+1 FLOP a param; benchmarks/overhead.py --target). Checkpoints written while
# it was state still restore (`jzero.runtime.checkpoint.RETIRED`).
CONSTANT_HYPER = ("eps_root",)


def build(cfg: Config, lr: schedules.Schedule | None = None) -> Optimizer:
    """The optax transformation and its schedules for the resolved ``cfg.optimizer`` / ``cfg.scheduler``;
    ``lr``: this lr schedule instead of the config's (the lr range test's sweep)."""
    name, p = cfg.optimizer.type, cfg.optimizer.params
    sched = (schedules.build(cfg, p["lr"], cycles_betas="betas" in PARAMS[name]) if lr is None
             else schedules.Schedules(lr, None))
    if name == "Adam" and not p["adam_w_mode"]:
        name = "AdamL2"
    backend = fused_backend(cfg, notice=True)
    factory = functools.partial(fused.fused_adamw, backend=backend) if backend else _FACTORIES[name]

    def one(group: groups.Group) -> optax.GradientTransformation:
        decay = {} if group.weight_decay is None else {"weight_decay": group.weight_decay}
        hyper = _HYPER[name]({**p, **decay}, _scaled(sched, group.lr_scale))
        # Constant betas stay Python floats, as in optax.adamw(...) and torch: injected, they would
        # be float32 arrays and (1 - b) round differently (a client optax.adamw would drift ~2e-6
        # from the config's AdamW over 20 steps). Scheduled ones (OneCycle's beta1) are injected.
        static = tuple(k for k, v in hyper.items() if isinstance(v, bool) or (k in ("b1", "b2") and not callable(v)))
        static += tuple(k for k in CONSTANT_HYPER if k in inspect.signature(factory).parameters)
        return optax.inject_hyperparams(factory, static_args=static)(**hyper)

    return Optimizer(groups.wrap(cfg, one), sched)


def _scaled(sched: schedules.Schedules, scale: float) -> schedules.Schedules:
    """``sched`` with its lr times ``scale`` (a parameter group's lr multiplier)."""
    if scale == 1.0:
        return sched
    lr = sched.lr
    return sched._replace(lr=(lambda count: scale * lr(count)) if callable(lr) else scale * lr)


def learning_rate(opt_state: Any) -> jax.Array | None:
    """The lr the optimizer applies: the first ``learning_rate`` hyperparameter that
    `optax.inject_hyperparams` keeps in ``opt_state`` (None: the optimizer does not expose one)."""
    def injected(x: Any) -> bool:
        return isinstance(x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))

    if isinstance(opt_state, optax.MultiTransformState) and groups.DEFAULT in opt_state.inner_states:
        opt_state = opt_state.inner_states[groups.DEFAULT]  # the default group's lr (scales apply to others)

    found = (x.hyperparams["learning_rate"] for x in jax.tree.leaves(opt_state, is_leaf=injected)
             if injected(x) and "learning_rate" in x.hyperparams)
    return next(found, None)


def transformation(tx: Any) -> Any:
    """A client optimizer as a GradientTransformation: ``optax.MultiSteps`` (what Flax users pass
    for accumulation inside the optimizer) is not one, but gives one."""
    return tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx


def client(cfg: Config, tx: Any) -> Config:
    """``cfg`` for a client optimizer ``tx`` (DeepSpeed's ``optimizer=`` argument): refused beside
    the config's own optimizer or scheduler, as DeepSpeed refuses two optimizers."""
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"tx: expected an optax.GradientTransformation (or optax.MultiSteps), got "
                          f"{type(tx).__name__}")
    for section in ("optimizer", "scheduler"):
        if section in cfg.source:
            raise ConfigError(f"{section}: the config has one and a client optimizer (tx=) is given; drop the "
                              f"section or tx= (a client optimizer carries its own schedule)")
    if cfg.jzero.param_groups:
        raise ConfigError("jzero.param_groups: they shape the config's optimizer; with a client optimizer (tx=) "
                          "build them into tx (optax.multi_transform with jzero.param_labels(config))")
    return dataclasses.replace(cfg, optimizer=OptimizerConfig(type=CLIENT, params={}))


def fused_backend(cfg: Config, *, notice: bool = False) -> str | None:
    """The Pallas backend of the fused AdamW step for this config on this platform, or None
    for the XLA path. With ``notice``, says in one line why a requested fused step is off."""
    name, p = cfg.optimizer.type, cfg.optimizer.params
    setting = p.get("fused", False)
    platform = jax.default_backend()
    if setting is False or (setting == "auto" and platform == "cpu"):
        return None
    why = None
    if cfg.zero_optimization.offload_optimizer.device != "none":
        why = "zero_optimization.offload_optimizer runs the update on the host, where Pallas does not"
    elif name == "Adam" and not p["adam_w_mode"]:
        why = "the fused step is AdamW's (adam_w_mode: true)"
    elif groups.active(cfg):
        why = "jzero.param_groups / jzero.frozen split the optimizer into groups"
    backend = pallas_backend(platform)
    if backend is None and why is None:
        why = f"no Pallas backend for platform '{platform}'"
    if why is None and backend != "interpret" and _compile_error(backend):
        why = f"its {backend} kernel does not compile here ({_compile_error(backend)})"
    if why is not None:
        if notice:
            warnings.warn(f"optimizer.params.fused: {setting!r} but {why}; using the XLA optimizer step",
                          ConfigWarning, stacklevel=3)
        return None
    return backend


@functools.cache
def _compile_error(backend: str) -> str | None:
    """Why the fused kernel does not compile for ``backend`` on this machine (None: it does).
    Tried once per process on a small buffer, so a jax without that lowering falls back."""
    from pallas_kernels import adamw as kernel

    f32 = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    hyper = jax.ShapeDtypeStruct((kernel.HYPER_SIZE,), jnp.float32)
    try:
        jax.jit(functools.partial(kernel.adamw, backend=backend)).lower(hyper, f32, f32, f32, f32).compile()
    except Exception as e:  # any lowering or compile failure means: use the XLA step
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
    return None


def _gpu_backend() -> str | None:
    """Mosaic GPU on Hopper and newer (jax's default GPU Pallas backend), else Triton."""
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    if float(capability) >= 9.0:
        return "mosaic_gpu"
    try:
        from jax.experimental.pallas import triton  # noqa: F401  (deprecated in jax 0.11; may go)
    except ImportError:
        return None
    return "triton"


_PLATFORM_BACKENDS: dict[str, Callable[[], str | None]] = {
    "cpu": lambda: "interpret",
    "gpu": _gpu_backend,
    "cuda": _gpu_backend,
    "tpu": lambda: "tpu",
}


def pallas_backend(platform: str) -> str | None:
    """The Pallas backend of the fused step on ``platform`` ("cpu": interpret mode), or None."""
    return _PLATFORM_BACKENDS.get(platform, lambda: None)()


def _betas(p: Mapping[str, Any], sched: schedules.Schedules) -> dict[str, Any]:
    """beta1/beta2; OneCycle cycles beta1 and (as DeepSpeed does) fixes beta2 at 0.99."""
    b1, b2 = p["betas"]
    if sched.momentum is not None:
        return {"b1": sched.momentum, "b2": 0.99}
    return {"b1": b1, "b2": b2}


def _adam_hyper(p, sched):
    return {"learning_rate": sched.lr, **_betas(p, sched), "eps": p["eps"], "weight_decay": p["weight_decay"]}


def _adam_l2(learning_rate, b1, b2, eps, weight_decay):
    """torch Adam with L2 (DeepSpeed ``adam_w_mode: false``): decay added to the gradient."""
    return optax.chain(optax.add_decayed_weights(weight_decay), optax.scale_by_adam(b1, b2, eps),
                       optax.scale_by_learning_rate(learning_rate))


class FusedLambState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def _lamb(learning_rate, b1, b2, eps, weight_decay, min_coeff, max_coeff) -> optax.GradientTransformation:
    """DeepSpeed's FusedLamb (``csrc/lamb/fused_lamb_cuda_kernel.cu``): uncorrected moments,
    u = m / (sqrt(v) + eps) + decay * p, trust ratio ||p|| / ||u|| clipped to [min, max] (1 when
    either norm is 0), and the bias corrections folded into the step size
    lr * sqrt(1 - b2^t) / (1 - b1^t)."""
    def init(params):
        return FusedLambState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params),
                              jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params):
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        t = count.astype(jnp.float32)
        step_size = learning_rate * jnp.sqrt(1 - b2**t) / (1 - b1**t)

        def one(m, v, w):
            u = m / (jnp.sqrt(v) + eps) + weight_decay * w
            w_norm, u_norm = jnp.linalg.norm(w), jnp.linalg.norm(u)
            ratio = jnp.where((w_norm > 0) & (u_norm > 0), w_norm / jnp.where(u_norm > 0, u_norm, 1.0), 1.0)
            return -step_size * jnp.clip(ratio, min_coeff, max_coeff) * u

        return jax.tree.map(one, mu, nu, params), FusedLambState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def _sgd(learning_rate, momentum, weight_decay, nesterov):
    return optax.chain(optax.add_decayed_weights(weight_decay),
                       optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov))


class TorchAdagradState(NamedTuple):
    sum_of_squares: Any


def _adagrad(learning_rate, eps, weight_decay, initial_accumulator_value) -> optax.GradientTransformation:
    """torch.optim.Adagrad (what DeepSpeed runs for "Adagrad" without offload): L2 decay added
    to the gradient, sum += g^2, p -= lr * g / (sqrt(sum) + eps). optax.adagrad puts eps inside
    the square root, which moves small-gradient steps by far more than rounding."""
    def init(params):
        return TorchAdagradState(jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value), params))

    def update(grads, state, params):
        grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
        sums = jax.tree.map(lambda s, g: s + g * g, state.sum_of_squares, grads)
        updates = jax.tree.map(lambda g, s: -learning_rate * g / (jnp.sqrt(s) + eps), grads, sums)
        return updates, TorchAdagradState(sums)

    return optax.GradientTransformation(init, update)


_FACTORIES: dict[str, Callable[..., optax.GradientTransformation]] = {
    "Adam": optax.adamw,
    "AdamW": optax.adamw,
    "AdamL2": _adam_l2,
    "Lamb": _lamb,
    "Lion": optax.lion,
    "SGD": _sgd,
    "Adagrad": _adagrad,
}
_HYPER: dict[str, Callable[[Mapping[str, Any], schedules.Schedules], dict[str, Any]]] = {
    "Adam": _adam_hyper,
    "AdamW": _adam_hyper,
    "AdamL2": _adam_hyper,
    "Lamb": lambda p, s: {**_adam_hyper(p, s), "min_coeff": p["min_coeff"], "max_coeff": p["max_coeff"]},
    "Lion": lambda p, s: {"learning_rate": s.lr, **_betas(p, s), "weight_decay": p["weight_decay"]},
    "SGD": lambda p, s: {"learning_rate": s.lr, "momentum": p["momentum"],
                         "weight_decay": p["weight_decay"], "nesterov": p["nesterov"]},
    "Adagrad": lambda p, s: {"learning_rate": s.lr, "eps": p["eps"], "weight_decay": p["weight_decay"],
                             "initial_accumulator_value": p["initial_accumulator_value"]},
}

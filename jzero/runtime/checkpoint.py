"""`Checkpointer`: layout-free Orbax checkpoints of a `TrainState` (docs/design.md, "Checkpoints").

A checkpoint holds global arrays, not shards: it restores onto whatever mesh and ZeRO stage the
*target* state was built for (8 devices at stage 3 -> 2 devices at stage 1 -> one CPU). Each step
directory has two Orbax items:

- ``state``: params, the model state, opt_state, step, rng (as key data) and the fp16
  loss-scale state, as nested dicts named by `jzero.zero.treepath` (no optax or Flax classes
  on disk);
- ``record``: JSON with the jzero version, mesh, stage, parameter count and dtypes, the resolved
  config and the user's source config, the data position, and each leaf's shape, dtype and a
  content checksum.

Orbax writes a step into a temporary directory and renames it when complete, so a save killed
halfway is never picked up. The checksums are computed from the arrays on device when saving and
again after loading: a file truncated or edited on disk is reported by name (TensorStore alone
returns edited bytes silently), and `restore` falls back to the newest readable step with a
warning. Nothing on any load path unpickles or runs code: arrays are TensorStore, the record is JSON.
"""
from __future__ import annotations

import datetime
import functools
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental.compute_on import compute_on

from jzero.config import Config, ConfigError
from jzero.runtime import distributed
from jzero.runtime.loops import draining
from jzero.train import state as state_lib
from jzero.zero import precision, treepath
from jzero.zero.mesh import platform
from jzero.zero.sharding import HOST_KINDS

FORMAT = "jzero-checkpoint"
FORMAT_VERSION = 1
STATE, RECORD = "state", "record"
_WEIGHT = 0x9E3779B1  # odd (golden-ratio) multiplier: every element's weight in the checksum is odd


class CheckpointError(RuntimeError):
    """No readable checkpoint where one was asked for (missing, truncated, edited)."""


class CheckpointMismatchError(ConfigError):
    """The checkpoint holds a different model or optimizer than the target state."""


class CheckpointWarning(UserWarning):
    """A checkpoint step was unreadable and an older one was restored instead."""


class _Unreadable(Exception):
    """One step failed to load; `restore` decides whether to fall back."""


def checksum(x: jax.Array) -> jax.Array:
    """A layout-free, order-sensitive checksum of an array's bits: the sum over elements of
    bits_i x (2 x i x 0x9E3779B1 + 1) mod 2**32, i the C-order index.

    Wrapping uint32 sums do not depend on reduction order, so every mesh gets the same value
    (and `host_checksum` on numpy); any single changed element changes it (its weight is odd).
    """
    bits = _bits_jnp(x)
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        shape = [1] * bits.ndim
        shape[axis] = bits.shape[axis]
        index = index + jnp.arange(bits.shape[axis], dtype=jnp.uint32).reshape(shape) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    index = jax.device_put(index, jax.typeof(bits).memory_space)  # beside an offloaded leaf, on the host
    return jnp.sum(bits * (index * jnp.uint32(2 * _WEIGHT % 2**32) + jnp.uint32(1)), dtype=jnp.uint32)


def host_checksum(x: np.ndarray, chunk: int = 1 << 16) -> int:
    """`checksum` of a host array, in chunks so temporaries stay small next to the array."""
    flat = np.ascontiguousarray(x).reshape(-1)
    total = 0
    for start in range(0, flat.size, chunk):
        bits = _bits_np(flat[start:start + chunk]).reshape(-1)
        per = bits.size // len(flat[start:start + chunk])
        index = np.arange(start * per, start * per + bits.size, dtype=np.uint64).astype(np.uint32)
        total += int(np.sum(bits * (index * np.uint32(2 * _WEIGHT % 2**32) + np.uint32(1)), dtype=np.uint32))
    return total % 2**32


def _bits_jnp(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _bits_np(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).reshape(*x.shape, 2)
    return x.view(f"u{x.dtype.itemsize}").astype(np.uint32)


def _checksums(leaves: list[jax.Array]) -> list[jax.Array]:
    """Every leaf's `checksum`, each computed where the leaf lives (an offloaded leaf on the
    host: moving it to the device could need more memory than the device has)."""
    on_host = tuple(getattr(getattr(x, "sharding", None), "memory_kind", None) in HOST_KINDS for x in leaves)
    return _checksums_where(leaves, on_host)


@functools.partial(jax.jit, static_argnums=1)
def _checksums_where(leaves: list[jax.Array], on_host: tuple[bool, ...]) -> list[jax.Array]:
    def one(x, host):
        if not host:
            return checksum(x)
        with compute_on("device_host"):
            return checksum(x)

    return [one(x, host) for x, host in zip(leaves, on_host, strict=True)]


def _saved_tree(state: Any) -> dict[str, Any]:
    """The TrainState's arrays (or abstract arrays) by name; a typed PRNG key as its key data."""
    rng = state.rng
    if isinstance(rng, jax.ShapeDtypeStruct) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, rng)
        rng = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=rng.sharding)
    elif jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    parts = {"params": state.params, "model_state": state.model_state, "opt_state": state.opt_state,
             "step": state.step, "rng": rng, "loss_scale": state.loss_scale}  # a model mismatch: at a param first
    return {name: leaf for prefix, tree in parts.items() for name, leaf in treepath.named_leaves(tree, prefix).items()}


class Checkpointer:
    """Saves a TrainState every ``jzero.checkpoint.interval`` steps and restores it onto any mesh.

    With a ``config``, `save` saves the steps its ``jzero.checkpoint.interval`` divides (no
    interval: only forced saves); without one, every call saves. ``max_to_keep`` newest steps
    are kept. With ``async_save`` the arrays are copied to host memory in `save` and written in
    the background (the state may be donated to the next step right away); `wait` or `close`
    blocks until the writes are committed. Every process of a multi-host run makes the same calls.
    """

    def __init__(self, directory: str | os.PathLike, config: Config | None = None, *, max_to_keep: int = 3,
                 async_save: bool = True):
        if max_to_keep < 1:
            raise ConfigError(f"max_to_keep: must be >= 1, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        self.interval = config.jzero.checkpoint.interval if config is not None else 1
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={STATE: ocp.PyTreeCheckpointHandler(), RECORD: ocp.JsonCheckpointHandler()})

    # ---------------------------------------------------------------- saving
    def save(self, state: Any, *, force: bool = False, data_position: Any = None) -> bool:
        """Save ``state`` if its step is due (or ``force``) and not saved yet; True if it saved.

        ``data_position`` is any JSON value that tells a data loader where to continue; by default
        the step (jzero's batches are a pure function of the step).
        """
        step = int(state.step)
        if not force and (self.interval is None or step % self.interval):
            return False
        if step in self.all_steps():
            return False
        named = _saved_tree(state)
        sums = jax.device_get(_checksums(list(named.values())))
        record = _record(state, named, sums, step if data_position is None else data_position)
        self._manager.save(step, force=True, args=ocp.args.Composite(
            **{STATE: ocp.args.PyTreeSave(treepath.nest(named)), RECORD: ocp.args.JsonSave(record)}))
        return True

    def wait(self) -> None:
        """Block until every started save is committed to disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- reading
    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (a save still in flight or killed halfway is not listed)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record of ``step`` (version, mesh, stage, config, leaves, data position)."""
        try:
            return self._read_record(step)
        except _Unreadable as e:
            raise CheckpointError(f"{self.directory} step {step}: {e}") from None

    def _read_record(self, step: int) -> dict[str, Any]:
        if step not in self.all_steps():
            raise CheckpointError(f"{self.directory}: no checkpoint at step {step}; have {self.all_steps()}")
        try:
            record = ocp.JsonCheckpointHandler().restore(self.directory / str(step) / RECORD,
                                                         args=ocp.args.JsonRestore())
        except Exception as e:
            raise _Unreadable(f"its record is unreadable ({_first_line(e)})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT or "leaves" not in record:
            raise _Unreadable("its record is not a jzero checkpoint record")
        return record

    def restore(self, target: Any, *, step: int | None = None) -> Any:
        """``target`` (a TrainState for the current mesh and stage; abstract is fine) filled with
        the checkpoint's values, resharded onto ``target``'s layout.

        Without ``step``: the newest step every process can read, agreed between processes (each
        may see the folder differently: a damaged file, a missing step), so all restore the same
        one; unreadable newer steps are skipped with a `CheckpointWarning` saying which process
        found what. A model that does not fit raises `CheckpointMismatchError` naming the first
        differing leaf.
        """
        steps, failures = ([step], []) if step is not None else self.agreed_steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no checkpoint to restore"
                                  + (f" ({'; '.join(failures)})" if failures else ""))
        for s in steps:
            try:
                restored = self._restore_step(target, s)
            except _Unreadable as e:
                failures.append(f"step {s}: {e}")
                if step is not None:
                    break
                continue
            if failures:
                warnings.warn(f"{self.directory}: restored step {s} because newer checkpoints are unreadable "
                              f"({'; '.join(failures)})", CheckpointWarning, stacklevel=2)
            return restored
        raise CheckpointError(f"{self.directory}: no readable checkpoint ({'; '.join(failures)})")

    def agreed_steps(self) -> tuple[list[int], list[str]]:
        """(the steps every process lists, newest first; what the others list that some do not)."""
        listed = distributed.all_gather_json(self.all_steps())
        common = set(listed[0]).intersection(*listed[1:])
        missing = [f"step {s}: process {', '.join(str(i) for i, steps in enumerate(listed) if s not in steps)} "
                   "does not list it" for s in sorted(set().union(*listed) - common, reverse=True)]
        return sorted(common, reverse=True), missing

    def _restore_step(self, target: Any, step: int) -> Any:
        """Load ``step`` (each process its part) and check its checksums (a collective); each
        verdict is agreed between processes, so all of them accept or skip the same step."""
        try:
            loaded, problem = self._load_step(target, step), None
        except _Unreadable as e:
            loaded, problem = None, str(e)
        _agree(problem)
        record, wanted, named = loaded
        sums = jax.device_get(_checksums([named[n] for n in wanted]))
        _agree(next((f"{name} does not match its checksum (a file was edited or damaged)"
                     for name, value in zip(wanted, sums, strict=True)
                     if int(value) != record["leaves"][name]["checksum"]), None))
        return _assemble(target, {n: named[n].astype(wanted[n].dtype) for n in wanted},
                         any(n.startswith("loss_scale/") for n in wanted), record.get("rng_impl"))

    def _load_step(self, target: Any, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, jax.Array]]:
        """(record, the wanted leaves of ``target`` by name, the loaded arrays by name): this
        process's reads only, no collective."""
        record = self._read_record(step)
        saved = {name: tuple(leaf["shape"]) for name, leaf in record["leaves"].items()}
        template = _saved_tree(target)
        keep_scale = any(n.startswith("loss_scale/") for n in saved)
        wanted = {n: x for n, x in template.items() if keep_scale or not n.startswith("loss_scale/")}
        comparable = {n: s for n, s in saved.items()
                      if n in wanted or not (n.startswith("loss_scale/") or RETIRED.search(n))}
        mismatch = treepath.first_mismatch({n: x.shape for n, x in wanted.items()}, comparable,
                                           "target state", "checkpoint")
        if mismatch:
            raise CheckpointMismatchError(f"{self.directory} step {step} does not fit the target state: {mismatch}")
        abstract = treepath.nest({n: jax.ShapeDtypeStruct(x.shape, np.dtype(record["leaves"][n]["dtype"]),
                                                          sharding=x.sharding) for n, x in wanted.items()})
        skipped = any(RETIRED.search(n) and n not in wanted for n in saved)  # read the rest only
        named = treepath.named_leaves(self._load(step, abstract, ocp.checkpoint_utils.construct_restore_args(abstract),
                                                 partial=skipped))
        return record, wanted, named

    def read_array(self, step: int, name: str) -> np.ndarray:
        """One saved leaf (e.g. ``params/blocks/stacked/mlp/fc/kernel``) as a host numpy array,
        checked against its checksum: `jzero.export` reads a checkpoint this way, leaf by leaf."""
        leaves = self.record(step)["leaves"]
        if name not in leaves:
            raise KeyError(f"{self.directory} step {step} has no leaf {name!r}")
        try:
            value = treepath.named_leaves(self._load(step, treepath.nest({name: 0}), treepath.nest(
                {name: ocp.RestoreArgs(restore_type=np.ndarray)}), partial=True))[name]
            if host_checksum(value) != leaves[name]["checksum"]:
                raise _Unreadable(f"{name} does not match its checksum (a file was edited or damaged)")
        except _Unreadable as e:
            raise CheckpointError(f"{self.directory} step {step}: {e}") from None
        return value

    def _load(self, step: int, item: Any, restore_args: Any, partial: bool = False) -> Any:
        handler = ocp.PyTreeCheckpointHandler()
        try:
            with draining():  # a failed read leaves no pending task behind (`jzero.runtime.loops`)
                return handler.restore(self.directory / str(step) / STATE, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore_args, partial_restore=partial))
        except Exception as e:
            reason = _first_line(e).split(" See full TensorStore details")[0]  # the rest is a repr
            raise _Unreadable(f"its arrays are unreadable ({reason})") from None
        finally:
            handler.close()


# Optimizer hyperparameters that earlier versions kept in the state and this one compiles in as
# constants (`jzero.zero.optim.build`): a checkpoint's copy held that same constant and is skipped.
RETIRED = re.compile(r"(^|/)hyperparams/eps_root$")


def _agree(problem: str | None) -> None:
    """Raise `_Unreadable` on every process when any process found ``problem`` (a collective),
    naming the processes when there are several."""
    problems = distributed.all_gather_json(problem)
    if len(problems) == 1 and problem:
        raise _Unreadable(problem)
    if any(problems):
        raise _Unreadable("; ".join(f"process {i}: {p}" for i, p in enumerate(problems) if p))


def _assemble(target: Any, named: dict[str, jax.Array], has_scale: bool, rng_impl: str | None) -> Any:
    """A TrainState like ``target`` holding the loaded arrays."""
    def part(prefix: str, tree: Any) -> Any:
        return treepath.fill(tree, {n[len(prefix) + 1:]: x for n, x in named.items() if n.startswith(prefix + "/")})

    rng = named["rng"]
    if jnp.issubdtype(target.rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng, impl=rng_impl)
        if rng.dtype != target.rng.dtype:
            raise CheckpointMismatchError(f"rng: the checkpoint's key is {rng.dtype}, the target's {target.rng.dtype}")
    if has_scale or target.loss_scale is None:
        loss_scale = None if target.loss_scale is None else part("loss_scale", target.loss_scale)
    else:
        warnings.warn("the checkpoint has no fp16 loss-scale state; the loss scaler starts fresh", CheckpointWarning,
                      stacklevel=3)
        loss_scale = state_lib.replicated(precision.loss_scaler(target.config).init, target.plan)
    model_state = None if target.model_state is None else part("model_state", target.model_state)
    return target.replace(step=named["step"], params=part("params", target.params), model_state=model_state,
                          opt_state=part("opt_state", target.opt_state), rng=rng, loss_scale=loss_scale)


def _record(state: Any, named: dict[str, jax.Array], sums: Sequence[Any], data_position: Any) -> dict[str, Any]:
    from jzero import __version__

    config, plan = state.config, state.plan
    params = treepath.named_leaves(state.params)
    dtypes: dict[str, int] = {}
    for x in params.values():
        dtypes[str(x.dtype)] = dtypes.get(str(x.dtype), 0) + int(np.prod(x.shape))
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "jzero_version": __version__,
        "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "step": int(state.step),
        "mesh": {"shape": {k: int(v) for k, v in plan.mesh.shape.items()}, "devices": int(plan.mesh.size),
                 "platform": platform(plan.mesh)},
        "zero_stage": plan.stage,
        "param_count": sum(dtypes.values()), "param_dtypes": dtypes,
        "rng_impl": str(jax.random.key_impl(state.rng)) if jnp.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
        else None,
        "data_position": data_position, "seed": config.seed,
        "config": config.to_dict(), "config_source": dict(config.source),
        "leaves": {name: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": int(s)}
                   for (name, x), s in zip(named.items(), sums, strict=True)},
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__

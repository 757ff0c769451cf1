"""`Engine`: the DeepSpeed-style façade that trains a config's task (`jzero.tasks`).

It joins the pieces a user would otherwise wire by hand: task (data + model) -> sharded state ->
AOT-compiled step (compile time and per-device memory read from the executable) -> the loop
with progress, logs, held-out evaluation (loss and the task's metrics), a summary and the
task's preview. `jzero train` is a thin shell over it.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jzero import tasks
from jzero.analysis import profile
from jzero.config import Config, ConfigWarning
from jzero.models import attention, hfconfig
from jzero.runtime import hf
from jzero.runtime.checkpoint import Checkpointer
from jzero.runtime.monitor import Monitor, RunSummary
from jzero.runtime.watchdog import Unwatched, Watchdog
from jzero.train.state import TrainState, abstract_init, init
from jzero.train.step import eval_step, train_step
from jzero.zero import groups
from jzero.zero.mesh import make_mesh


def pretrained(config: Config, model: Any) -> Any:
    """The weights of ``config``'s Hugging Face directory, read lazily (each device reads its
    shard: `jzero.runtime.hf`); None for a model trained from scratch."""
    directory = config.jzero.model.hf
    if directory is None:
        return None
    return hf.lazy_params(directory, hfconfig.spec(config).name, jax.eval_shape(model.init_fn, jax.random.key(0)))


def _starting(config: Config, model: Any) -> Any:
    """Training's starting weights: the Hugging Face directory's, or None (random) for none, or
    for a directory with a config and a tokenizer but no weights (pretraining from scratch)."""
    directory = config.jzero.model.hf
    if directory is not None and not hf.has_weights(directory):
        warnings.warn(f"jzero.model.hf: {directory} holds no weights ({hf.SINGLE} or {hf.INDEX}): training starts "
                      "from random weights of its architecture", ConfigWarning, stacklevel=2)
        return None
    return pretrained(config, model)


class Engine:
    """Builds the task (data and model) and the sharded state for ``config``; `train` runs the loop."""

    def __init__(self, config: Config, checkpointer: Checkpointer | None = None,
                 watch: Watchdog | Unwatched | None = None):
        """With a ``checkpointer`` holding a step, the state is restored from the newest step
        every process can read (onto this config's mesh and stage) instead of freshly
        initialised. ``watch`` (`jzero.runtime.watchdog`) is told each phase of the restore and of
        every training step."""
        self.watch = watch or Unwatched()
        self.task = tasks.build(config)
        self.model = self.task.model
        init_fn, loss_fn = self.model.init_fn, self.model.loss_fn
        mesh = make_mesh(config)
        self.resumed = checkpointer is not None and bool(checkpointer.agreed_steps()[0])
        if self.resumed:
            self.watch.enter("restore")
            self.state: TrainState = checkpointer.restore(abstract_init(init_fn, config, loss_fn=loss_fn, mesh=mesh,
                                                                    stages=self.model.stages))
            self.watch.pause()
        else:
            self.state = init(init_fn, config, loss_fn=loss_fn, rng=jax.random.key(config.seed), mesh=mesh,
                              stages=self.model.stages, params=_starting(config, self.model))
        self.config = self.state.config  # batch rule resolved for the real mesh

    def header(self, flags: list[str]) -> list[str]:
        """The run's opening lines: data, model, stage, mesh, batch rule, remat, the parameter
        groups' effective settings, XLA flags."""
        from jzero.runtime import xla_flags
        from jzero.zero.mesh import data_parallel_size

        cfg, mesh = self.config, self.state.plan.mesh
        shape = cfg.jzero.model.hf or cfg.jzero.model.size
        lines = [f"jzero: {self.task.describe}",
                 f"jzero: {self.model.name.upper()} {shape} ({self.num_params:,} params), ZeRO stage "
                 f"{cfg.zero_optimization.stage}, mesh {dict(mesh.shape)} on {jax.devices()[0].platform}, "
                 f"batch {cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} x accum "
                 f"{cfg.gradient_accumulation_steps} x dp {data_parallel_size(mesh)}, remat {cfg.jzero.remat}"]
        lines += [f"jzero: param group {line}" for line in groups.describe(cfg, self.state.params)]
        described = xla_flags.describe(flags, jax.default_backend())
        return lines + ([described] if described else [])

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))

    def batch(self, split: str, step: int) -> dict:
        return self.task.batch(split, step, self.config.train_batch_size, self.state.plan.batch)

    def evaluate(self) -> dict[str, float]:
        """``eval_loss``, the mean held-out loss over ``jzero.train.eval_batches`` fixed batches,
        and the task's held-out metrics.

        At most two batches are in flight: XLA's CPU runtime aborts with a collective rendezvous
        timeout when hundreds of sharded programs are queued at once (docs/design.md).
        """
        losses = []
        for i in range(self.config.jzero.train.eval_batches):
            losses.append(eval_step(self.state, self.batch("heldout", i)))
            if i:
                losses[i - 1].block_until_ready()
        return {"eval_loss": float(np.mean(jax.device_get(losses))), **self.task.evaluate(self.state)}

    def _scalars(self, metrics: dict) -> dict[str, float]:
        """The step's metrics as floats, with the model's `step_metrics` out of the loss's aux."""
        aux = metrics.pop("aux", None)
        out = {k: float(v) for k, v in metrics.items()}
        out.update({k: float(aux[k]) for k in self.model.step_metrics})
        return out

    def sample(self) -> str:
        """The task's preview of the current model (a generated sample, held-out predictions)."""
        return self.task.preview(self.state)

    def _step(self, compiled: Callable, step: int) -> tuple[dict[str, float], float]:
        """Train step ``step`` + 1 under the watch: (its metrics, its compute seconds)."""
        t_data = time.perf_counter()
        self.watch.enter("data", step)
        batch = self.batch("train", step)
        self.watch.enter("compute/collective")
        t = time.perf_counter()
        self.state, metrics = compiled(self.state, batch)
        metrics = self._scalars(jax.device_get(metrics))
        dt = time.perf_counter() - t
        self.watch.step_done(step + 1, time.perf_counter() - t_data)
        return metrics, dt

    def _attention_temp(self, temp: int, step: int) -> int | None:
        """Attention's share of the step's temporaries: the step compiled once more without
        attention (`jzero.models.attention.absent`; a copy of the config, so jit traces anew);
        None for a model without attention."""
        bare_state = self.state.replace(config=dataclasses.replace(self.state.config))
        with attention.absent():
            bare = profile.memory(train_step.lower(bare_state, self.batch("train", step)).compile()).temp
        return None if bare == temp else temp - bare

    def train(self, steps: int, monitor: Monitor, checkpointer: Checkpointer | None = None,
              should_stop: Callable[[], bool] | None = None) -> RunSummary:
        """Train from the state's current step up to ``steps``; returns what the summary shows.

        The ``checkpointer`` saves at its interval and once more when the loop ends; the loop ends
        early, after a whole step, when ``should_stop()`` turns true (a signal arrived).
        """
        cfg, summary, watch = self.config, RunSummary(), self.watch
        tokens_per_step = cfg.train_batch_size * self.model.tokens_per_example
        start = summary.steps = int(self.state.step)
        t0 = time.perf_counter()
        compiled = train_step.lower(self.state, self.batch("train", start)).compile()
        summary.compile_s = time.perf_counter() - t0
        try:
            summary.memory = profile.memory(compiled)
            if attention.long_context(self.model.spec):
                summary.attention_temp = self._attention_temp(summary.memory.temp, start)
        except RuntimeError:  # a backend without memory_analysis(): the summary omits memory
            summary.memory = None
        eval_every = cfg.jzero.train.eval_interval
        window_time, window_steps, total_time = 0.0, 0, 0.0
        for step in range(start, steps):
            metrics, dt = self._step(compiled, step)
            window_time, window_steps, total_time = window_time + dt, window_steps + 1, total_time + dt
            done = step + 1
            tps = window_steps * tokens_per_step / max(window_time, 1e-9)
            monitor.update(done, {**metrics, "tokens_per_s": tps})
            summary.stopped = should_stop is not None and should_stop()
            is_eval = done == start + 1 or done % eval_every == 0 or done == steps
            if is_eval or done % cfg.steps_per_print == 0 or summary.stopped:
                row = {"step": done, **metrics, "tokens_per_s": tps, "eval_loss": None}
                if is_eval:
                    watch.enter("evaluation")
                    row.update(self.evaluate())
                    if np.isnan(summary.first_eval_loss):
                        summary.first_eval_loss = row["eval_loss"]
                    summary.eval_loss = row["eval_loss"]
                    summary.eval_metrics = {k: row[k] for k in self.task.metrics}
                monitor.log(row)
                window_time, window_steps = 0.0, 0
            summary.train_loss, summary.steps = metrics["loss"], done
            if checkpointer is not None:
                watch.enter("checkpoint")
                checkpointer.save(self.state)
            if summary.stopped:
                break
        if checkpointer is not None:
            watch.enter("checkpoint")
            checkpointer.save(self.state, force=True)
            checkpointer.wait()
        watch.pause()
        done_steps = summary.steps - start
        summary.tokens_per_s = done_steps * tokens_per_step / max(total_time, 1e-9)
        summary.samples_per_s = done_steps * cfg.train_batch_size / max(total_time, 1e-9)
        summary.step_s = total_time / max(done_steps, 1)
        summary.model_flops_per_step = self.model.flops(cfg.train_batch_size)["total"]
        summary.devices = self.state.plan.mesh.size
        return summary


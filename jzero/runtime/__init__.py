"""Runtime: running a job. The training loop (`engine`), metrics, checkpoints and weight export,
multi-process start-up, the launcher, progress reports and the step watchdog, XLA flags.
Imports every layer below it; only `jzero.cli` imports it.
"""

"""Test setup: 8 simulated CPU devices (set before JAX is imported) and shared tiny models."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; import jax after conftest"
# Compile time dominates the suite (tiny models); XLA's cheap pipeline halves it and leaves
# the numerics within every tolerance the tests assert.
jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="session")
def devices():
    return jax.devices()


def token_batches(num_steps: int, batch: int, seq_len: int, vocab: int, seed: int = 0):
    """Deterministic learnable token batches {"inputs", "targets"}: each row counts up from a
    random start with a random stride in 1..3 (mod vocab), so the loss falls within a few steps."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_steps):
        start = rng.integers(0, vocab, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        tok = ((start + stride * np.arange(seq_len + 1)) % vocab).astype(np.int32)
        out.append({"inputs": tok[:, :-1], "targets": tok[:, 1:]})
    return out

"""Test setup: 8 simulated CPU devices (set before JAX is imported) and shared tiny models."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices; import jax after conftest"
# Compile time dominates the suite (tiny models); XLA's cheap pipeline halves it and leaves
# the numerics within every tolerance the tests assert.
jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(scope="session")
def devices():
    return jax.devices()

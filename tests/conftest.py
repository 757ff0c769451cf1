"""Test setup: 8 simulated CPU devices (set before JAX is imported) and shared tiny models."""
import os

# XLA:CPU's fusion emitters off: the suite is compile-bound and they cost ~30% of a compile
# (the Evoformer's step 8.1 -> 5.6 s; the same losses); `helpers.cli_env` passes it on.
CHEAP_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), CHEAP_XLA_FLAGS,
                                    "--xla_force_host_platform_device_count=8"]).strip()
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


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One XLA compilation cache for the whole run, shared by every `jzero` subprocess the tests
    start: many run the same program (the CLI's tiny run and its resume, one config under several
    checks) and compile time dominates the suite. It lives in pytest's run folder (workers share
    its parent), which pytest prunes like any other. The test processes themselves do not write
    to it: with jax 0.10.2, after a few hundred compilations in one process, serializing the next
    executable for the cache crashed XLA:CPU (a segfault or abort inside
    ``executable.serialize()``, in whichever ZeRO++ test came first; docs/design.md, "Tests")."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-cache"
    settings = {"jax_compilation_cache_dir": str(folder), "jax_persistent_cache_min_compile_time_secs": 0.2}
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)

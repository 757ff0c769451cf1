"""Gradient buckets (jzero/zero/buckets.py) against JAX's own collectives, one leaf at a time, on
8 simulated devices; and the step's collectives: one reduce-scatter per layer, not per leaf."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jzero.zero import buckets

# Leaves scattered along their first, middle and last dimension (each divisible by the 4 of fsdp).
SHAPES_DIMS = [((16, 3), 0), ((3, 8, 5), 1), ((2, 24), 1), ((4, 2, 8), 2)]


def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "fsdp"))


def local_gradients():
    """Each device's own gradient of every leaf: integer-valued, so any order of summing is exact."""
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.integers(-50, 50, (8, *shape)), jnp.float32) for shape, _ in SHAPES_DIMS]


def per_device(fn, outs):
    """``fn`` on each device's slice (leading dim 8 over both axes), results stacked back."""
    spec = P(("replica", "fsdp"))
    return jax.jit(jax.shard_map(lambda *gs: [o[None] for o in fn([g[0] for g in gs])], mesh=mesh(),
                                 in_specs=spec, out_specs=[spec] * outs, check_vma=False))


def test_bucket_reduce_scatter_equals_one_collective_per_leaf():
    gs, dims = local_gradients(), [d for _, d in SHAPES_DIMS]

    def reference(local):
        return [jax.lax.psum(jax.lax.psum_scatter(g, "fsdp", scatter_dimension=d, tiled=True), "replica")
                for g, d in zip(local, dims, strict=True)]

    bucketed = per_device(lambda local: buckets.reduce_scatter(local, dims, ("fsdp",), ("replica",)), len(gs))(*gs)
    want = per_device(reference, len(gs))(*gs)
    for got, ref in zip(bucketed, want, strict=True):
        np.testing.assert_array_equal(got, ref)
    # negative control: the last leaf scattered along its first dimension instead of its last
    wrong = per_device(lambda local: buckets.reduce_scatter(local, [0, 1, 1, 0], ("fsdp",), ("replica",)),
                       len(gs))(*gs)
    assert not np.array_equal(np.ravel(wrong[3]), np.ravel(want[3]))


@pytest.mark.parametrize("shape,dim", SHAPES_DIMS)
def test_all_gather_puts_every_chunk_in_place(shape, dim):
    full = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    spec = P(*[("fsdp" if d == dim else None) for d in range(len(shape))])
    gather = jax.jit(jax.shard_map(lambda s: buckets.all_gather(s, dim, ("fsdp",)), mesh=mesh(), in_specs=spec,
                                   out_specs=P(), check_vma=False))
    np.testing.assert_array_equal(gather(jax.device_put(full, jax.NamedSharding(mesh(), spec))), full)

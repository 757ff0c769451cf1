"""A process that saves checkpoints back to back until it is killed (tests/test_checkpoint.py
SIGKILLs it in the middle of a save). ``python ckpt_writer.py DIR``; prints "saved N" per save."""
import sys

import jax
import jax.numpy as jnp

import jzero
from jzero.runtime.checkpoint import Checkpointer

SHAPES = {"w1": (1024, 1024), "w2": (1024, 1024), "b": (1024,)}  # ~12 MB of params + Adam state


def make():
    """(init_fn, loss_fn, config) of the state the writer saves."""
    def init_fn(rng):
        keys = jax.random.split(rng, len(SHAPES))
        return {name: jax.random.normal(k, shape) for k, (name, shape) in zip(keys, SHAPES.items(), strict=True)}

    def loss_fn(params, batch, rng):
        return jnp.mean((jnp.tanh(batch @ params["w1"]) @ params["w2"] + params["b"]) ** 2)

    config = jzero.load_config({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                               dp_size=1)
    return init_fn, loss_fn, config


def main(directory: str) -> None:
    init_fn, loss_fn, config = make()
    state = jzero.init(init_fn, config, loss_fn=loss_fn, rng=0, mesh=jzero.make_mesh(config, jax.devices()[:1]))
    ckpt = Checkpointer(directory, max_to_keep=2)
    for step in range(1, 10_000):
        state = state.replace(step=jnp.int32(step), params=jax.tree.map(lambda x: x + 1, state.params))
        ckpt.save(state)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

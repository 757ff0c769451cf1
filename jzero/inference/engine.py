"""The KV-cached generation engine: JetStream's interface over a model's `Decoder`.

* `Engine.start` opens a request (its sampling settings and seed) as an empty `Prefix`;
* `Engine.prefill` runs up to ``chunk`` prompt tokens into a prefix's own cache (a long prompt
  takes several calls, so a scheduler can decode between them) and samples the request's first
  token from the last one;
* `Engine.insert` copies a finished prefix into a decode slot;
* `Engine.generate` feeds every active slot its last token and samples one more for each.

Every function is compiled ahead of time once per shape: `generate` and `insert` once, `prefill`
once per prompt bucket (powers of two from ``min_bucket`` up to ``chunk``; a prompt is padded to
the next bucket, the padding at the sentinel position `jzero.models.kvcache` drops).
`Engine.compiles` lists what was compiled and how long it took, so a user sees every recompile.
The decode state is donated to each call (the cache is updated in place, not copied).

On several devices the slots are split over them (a 1-D ``slots`` mesh) and the weights are
replicated, or split ZeRO-3 style and gathered a layer at a time (`jzero.inference.storage`).
Token ``i`` of a request is drawn with ``fold_in(key(seed), i)``, whatever slot it sits in and
whatever shares the batch (`jzero.inference.sampling`), so it equals
`jzero.inference.uncached.generate`'s for the same seed.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import Config, ConfigError
from jzero.inference import sampling, storage
from jzero.models import gpt
from jzero.models.kvcache import Decoder, KVCache
from jzero.zero import treepath


class Prefix(NamedTuple):
    """One request's prompt so far: its cache ``[layers, 1, max_len, ...]``, the positions filled,
    the token sampled after the last of them and its logits ``[vocab]``, and its sampling."""

    cache: KVCache
    length: jax.Array
    token: jax.Array
    logits: jax.Array
    key: jax.Array
    settings: tuple[jax.Array, jax.Array, jax.Array]  # temperature, top_k, top_p


class DecodeState(NamedTuple):
    """Every slot's cache ``[layers, slots, max_len, ...]``, next position, last token, tokens
    sampled so far, key, sampling settings and whether it holds a request (all ``[slots]``)."""

    cache: KVCache
    lengths: jax.Array
    tokens: jax.Array
    produced: jax.Array
    keys: jax.Array
    settings: tuple[jax.Array, jax.Array, jax.Array]
    active: jax.Array


class Step(NamedTuple):
    """What `Engine.generate` returns beside the state: each slot's new token and its logits."""

    tokens: jax.Array
    logits: jax.Array


def _draw(logits: jax.Array, keys: jax.Array, index: jax.Array, settings: tuple) -> jax.Array:
    """Row ``i``'s token from ``logits[i]`` with ``fold_in(keys[i], index[i])``."""
    return sampling.sample(logits, jax.vmap(jax.random.fold_in)(keys, index), *settings)


def prefill_step(decoder: Decoder, fetch: Callable, params: Any, prefix: Prefix, tokens: jax.Array,
                 true_length: jax.Array) -> Prefix:
    """``tokens[:true_length]`` (``[C]``, padded) written after ``prefix``'s positions."""
    at = prefix.length + jnp.arange(tokens.shape[0])
    positions = jnp.where(jnp.arange(tokens.shape[0]) < true_length, at, decoder.max_len)[None]
    logits, cache = decoder.forward(params, tokens[None], positions, prefix.cache, fetch)
    last = logits[0, true_length - 1]
    token = _draw(last[None], prefix.key[None], jnp.zeros((1,), jnp.int32), tuple(s[None] for s in prefix.settings))
    return Prefix(cache, prefix.length + true_length, token[0], last, prefix.key, prefix.settings)


def insert_step(prefix: Prefix, state: DecodeState, slot: jax.Array) -> DecodeState:
    """``state`` with ``prefix`` in ``slot``: its first token sampled, the next at index 1."""
    cache = KVCache(*(c.at[:, slot].set(p[:, 0]) for c, p in zip(state.cache, prefix.cache, strict=True)))
    settings = tuple(s.at[slot].set(p) for s, p in zip(state.settings, prefix.settings, strict=True))
    return DecodeState(cache, state.lengths.at[slot].set(prefix.length), state.tokens.at[slot].set(prefix.token),
                       state.produced.at[slot].set(1), state.keys.at[slot].set(prefix.key), settings,
                       state.active.at[slot].set(True))


def generate_step(decoder: Decoder, fetch: Callable, params: Any, state: DecodeState) -> tuple[DecodeState, Step]:
    """One token for every active slot (idle slots compute at the sentinel and keep their state)."""
    positions = jnp.where(state.active, state.lengths, decoder.max_len)
    logits, cache = decoder.forward(params, state.tokens[:, None], positions[:, None], state.cache, fetch)
    logits = logits[:, 0]
    drawn = _draw(logits, state.keys, state.produced, state.settings)
    tokens = jnp.where(state.active, drawn, state.tokens)
    step = state.active.astype(jnp.int32)
    return state._replace(cache=cache, lengths=state.lengths + step, tokens=tokens,
                          produced=state.produced + step), Step(tokens, logits)


def retire_step(state: DecodeState, slot: jax.Array) -> DecodeState:
    return state._replace(active=state.active.at[slot].set(False))


def buckets(chunk: int, min_bucket: int) -> tuple[int, ...]:
    """The prompt lengths `Engine.prefill` compiles for: powers of two from ``min_bucket``, and ``chunk``."""
    sizes, size = [], min_bucket
    while size < chunk:
        sizes.append(size)
        size *= 2
    return (*sizes, chunk)


@dataclass
class Compiled:
    """One ahead-of-time compilation: what, for which shape, and its seconds."""

    name: str
    shape: tuple[int, ...]
    seconds: float


@dataclass
class Engine:
    """The engine of one model's ``params`` with ``slots`` decode slots (module docstring).

    ``chunk``: most prompt tokens per `prefill` call; ``dtype``: the compute dtype (params are
    cast to it once, the cache is kept in it); ``devices``: how many devices the slots are split
    over (they must divide ``slots``); ``weights``: where they live (`storage.PLACEMENTS`:
    ``"sharded"`` splits them over the devices, ``"host"`` is ZeRO-Inference); ``int8_block``:
    int8 weights with a scale per that many elements (0: unquantized)."""

    decoder: Decoder
    params: Any
    slots: int = 8
    chunk: int = 256
    min_bucket: int = 16
    dtype: Any = jnp.float32
    devices: int = 1
    weights: str = "device"
    int8_block: int = 0
    compiles: list[Compiled] = field(default_factory=list)

    def __post_init__(self):
        for name, value in (("slots", self.slots), ("chunk", self.chunk), ("min_bucket", self.min_bucket),
                            ("devices", self.devices)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"engine {name}: must be an integer >= 1, got {value!r}")
        local = jax.local_devices()  # each process serves on its own devices
        if self.devices > len(local) or self.slots % self.devices:
            raise ValueError(f"engine devices: {self.devices} must divide slots ({self.slots}) and be at most the "
                             f"{len(local)} devices present")
        self.chunk = min(self.chunk, self.decoder.max_len)
        self.buckets = buckets(self.chunk, min(self.min_bucket, self.chunk))
        mesh = Mesh(np.array(local[: self.devices]), ("slots",))
        self._replicated, self._by_slot = NamedSharding(mesh, P()), NamedSharding(mesh, P("slots"))
        cache, slot = NamedSharding(mesh, P(None, "slots")), self._by_slot
        self._state_layout = DecodeState(KVCache(cache, cache), slot, slot, slot, slot, (slot,) * 3, slot)
        if self.int8_block < 0:
            raise ValueError(f"engine int8_block: must be >= 0 (0: unquantized), got {self.int8_block}")
        self.fetch = storage.fetcher(self.weights, self.dtype, mesh)
        store = functools.partial(storage.stored, dtype=self.dtype, int8_block=self.int8_block)
        layout = storage.shardings(jax.eval_shape(store, self.params), self.weights, mesh)
        self.params = jax.jit(store, out_shardings=layout)(jax.device_put(self.params, self._replicated))
        self._executables: dict[tuple[str, tuple[int, ...]], Any] = {}

    # --- state -----------------------------------------------------------------------------------
    def empty_state(self) -> DecodeState:
        """Every slot idle."""
        n = self.slots
        state = DecodeState(self.decoder.cache(n, self.dtype), jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32),
                            jnp.zeros((n,), jnp.int32), jax.random.split(jax.random.key(0), n),
                            sampling.as_arrays([sampling.SamplingParams()] * n), jnp.zeros((n,), bool))
        return jax.device_put(state, self._state_layout)

    def start(self, settings: sampling.SamplingParams, seed: int) -> Prefix:
        """An empty prefix for a request sampled with ``settings`` from ``seed``."""
        arrays = tuple(a[0] for a in sampling.as_arrays([settings]))
        prefix = Prefix(self.decoder.cache(1, self.dtype), jnp.int32(0), jnp.int32(0),
                        jnp.zeros((self.decoder.vocab_size,), jnp.float32), jax.random.key(seed), arrays)
        return jax.device_put(prefix, self._replicated)

    # --- the four calls --------------------------------------------------------------------------
    def prefill(self, prefix: Prefix, tokens: np.ndarray) -> Prefix:
        """``prefix`` with ``tokens`` (1-D, at most ``chunk``) written after it; ValueError if they
        do not fit ``max_len``."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = tokens.shape[0]
        if not 1 <= n <= self.chunk:
            raise ValueError(f"prefill: 1 to {self.chunk} tokens per call (the engine's chunk), got {n}")
        bucket = next(b for b in self.buckets if b >= n)
        padded = np.zeros((bucket,), np.int32)
        padded[:n] = tokens
        run = self._compiled("prefill", (bucket,), functools.partial(prefill_step, self.decoder, self.fetch),
                             (self.params, prefix, padded, np.int32(n)), self._replicated, donate=(1,))
        return run(self.params, prefix, padded, np.int32(n))

    def prefill_all(self, prefix: Prefix, tokens: np.ndarray) -> Prefix:
        """`prefill` of a whole prompt, ``chunk`` tokens at a time."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        for begin in range(0, len(tokens), self.chunk):
            prefix = self.prefill(prefix, tokens[begin: begin + self.chunk])
        return prefix

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        """``state`` with ``prefix`` (a whole prompt) in ``slot``, ready to `generate`."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"insert: slot {slot} is not in 0..{self.slots - 1}")
        run = self._compiled("insert", (), insert_step, (prefix, state, np.int32(slot)),
                             self._state_layout, donate=(1,))
        return run(prefix, state, np.int32(slot))

    def generate(self, state: DecodeState) -> tuple[DecodeState, Step]:
        """One token for every active slot."""
        run = self._compiled("generate", (), functools.partial(generate_step, self.decoder, self.fetch),
                             (self.params, state), (self._state_layout, Step(self._by_slot, self._by_slot)),
                             donate=(1,))
        return run(self.params, state)

    def retire(self, state: DecodeState, slot: int) -> DecodeState:
        """``state`` with ``slot`` idle (its cache is overwritten by the next insert)."""
        run = self._compiled("retire", (), retire_step, (state, np.int32(slot)), self._state_layout,
                             donate=(0,))
        return run(state, np.int32(slot))

    def executable(self, name: str, shape: tuple[int, ...] = ()) -> Any:
        """The compiled ``name`` program for ``shape`` (`compiles` lists them): to read its
        ``memory_analysis()`` or HLO."""
        return self._executables[(name, shape)]

    # --- compilation -----------------------------------------------------------------------------
    def _compiled(self, name: str, shape: tuple[int, ...], fn: Callable, args: tuple, out_shardings: Any,
                  donate: tuple[int, ...]) -> Any:
        key = (name, shape)
        if key not in self._executables:
            began = time.perf_counter()
            self._executables[key] = jax.jit(fn, out_shardings=out_shardings, donate_argnums=donate).lower(
                *args).compile()
            self.compiles.append(Compiled(name, shape, time.perf_counter() - began))
        return self._executables[key]


def unservable(cfg: gpt.GPTConfig) -> str | None:
    """Why `gpt.decoder` cannot serve this GPT (None: it can)."""
    if cfg.moe is not None:
        return "the KV-cached decoder serves dense GPTs; this config has a moe section"
    if cfg.sparse_attention is not None:
        return "the KV-cached decoder attends densely; this config has a sparse_attention section"
    return None


def for_config(config: Config, params: Any, source: str = "params", **settings: Any) -> Engine:
    """The `Engine` of ``config``'s model over ``params`` (checked against the model's shapes;
    ``source`` names where they came from in the error), ``settings`` passed to `Engine`."""
    from jzero import models

    model = models.build(config)
    if model.name == "gpt" and unservable(model.spec):
        raise ConfigError(f"generation: {unservable(model.spec)}")
    if model.decoder is None:
        raise ConfigError(f"jzero.model.name: generation serves a KV-cache decoder (gpt, llama, a Hugging Face "
                          f"directory), got {config.jzero.model.name!r}")
    want = jax.eval_shape(model.init_fn, jax.random.key(0))
    mismatch = treepath.first_mismatch(*({k: tuple(v.shape) for k, v in treepath.named_leaves(t).items()}
                                         for t in (want, params)), "config's model", source)
    if mismatch:
        raise ConfigError(f"{source}: does not fit the config's model: {mismatch}")
    return Engine(model.decoder, params, **settings)

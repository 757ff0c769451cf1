"""`jzero eval`: a language model's mean next-token cross entropy and perplexity over documents.

Each document is tokenized on its own, exactly as its tokenizer gives it (`jzero.inference.text`:
a Hugging Face ``tokenizer.json``'s post-processor decides BOS/EOS), cut to the model's context
(``seq_len`` tokens), and contributes every position it predicts (length - 1): the loss is the
mean over all predicted positions of all documents, as transformers' loss over the same rows
is. Rows are padded to the context (one compiled shape) and batched over the devices; the
padding is masked out of the sum. Fine-tuning records (`jzero.tasks.records`) count only the
tokens their loss mask trains: a prompt/completion file's completions, a chat's assistant turns.
The params stay in the layout they were placed in (a ZeRO-3
model evaluates sharded).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError


class Result(NamedTuple):
    loss: float  # mean next-token cross entropy, nats
    tokens: int  # predicted positions
    documents: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def as_dict(self) -> dict[str, float | int]:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens, "documents": self.documents}


def rows(documents: Iterable[list[int]], seq_len: int,
         masks: Iterable[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n, seq_len + 1] padded with 0, mask [n, seq_len] of the predicted positions):
    each document cut to ``seq_len`` tokens, then predicting its tokens 1..len-1 (those a
    document's loss mask keeps, given ``masks``: fine-tuning records' completions)."""
    toks, mask = [], []
    for ids, keep in zip(documents, itertools.repeat(None) if masks is None else masks, strict=False):
        ids = list(ids)[:seq_len]
        row = np.zeros(seq_len + 1, np.int32)
        row[:len(ids)] = ids
        toks.append(row)
        predicted = np.arange(seq_len) < len(ids) - 1
        if keep is not None:
            predicted &= np.pad(np.asarray(keep[1:len(ids)], bool), (0, seq_len - len(ids) + 1))
        mask.append(predicted)
    if not toks:
        raise ConfigError("jzero eval --data: no documents found")
    return np.stack(toks), np.stack(mask)


def evaluate(forward: Any, params: Any, tokens: np.ndarray, mask: np.ndarray, mesh: Any,
             batch: int) -> Result:
    """The mean cross entropy of ``forward(params, inputs) -> logits`` over the masked positions,
    ``batch`` rows a call (split over the mesh's devices)."""
    @jax.jit
    def sums(params, inputs, targets, keep):
        logp = jax.nn.log_softmax(forward(params, inputs).astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(keep, picked, 0.0)), jnp.sum(keep)

    split = NamedSharding(mesh, P(mesh.axis_names))
    total, count, documents = 0.0, 0, len(tokens)
    pad = (-len(tokens)) % batch
    tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
    mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
    for start in range(0, len(tokens), batch):
        part = tokens[start:start + batch]
        args = [jax.device_put(x, split) for x in (part[:, :-1], part[:, 1:], mask[start:start + batch])]
        s, n = sums(params, *args)
        total, count = total + float(s), count + int(n)
    if count == 0:
        raise ConfigError("jzero eval --data: the documents predict no token (each needs at least 2 tokens)")
    return Result(total / count, count, documents)

"""Token data for the CLI: the bundled corpus or the user's file, and deterministic batches.

The bundled corpus needs no download: the Python standard library's own ``.py`` sources (every
Python installation ships them), read in sorted path order as bytes (vocab 256). User data is a
text file or folder (bytes), a ``.npy`` token array, or a raw ``.bin`` token file (nanoGPT
style, memory-mapped). The last ``heldout_fraction`` of the tokens is the held-out split.

A batch is a pure function of ``(seed, step)``: every row's offset is drawn from
``np.random.default_rng([seed, split, step])``, so a resumed run sees the same data, and each
process materialises only its own rows before they become one global array.
"""
from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jzero.config import ConfigError, DataConfig

SPLITS = {"train": 0, "heldout": 1}


@dataclass(frozen=True)
class Corpus:
    """Train and held-out token streams and where they came from."""

    train: np.ndarray
    heldout: np.ndarray
    vocab_size: int
    source: str


def load_corpus(cfg: DataConfig, tokenizer: Any = None) -> Corpus:
    """The configured corpus (``jzero.data.path``), or the bundled standard-library corpus; with
    a ``tokenizer`` (`jzero.inference.text.HF`), text read as documents and tokenized."""
    if tokenizer is not None:
        if cfg.path is None:
            raise ConfigError("jzero.data.path: a Hugging Face model trains on your text: give --data FILE "
                              "(JSON lines of {\"text\": ...}, a text file or a folder of them)")
        tokens, vocab, source = tokenized(documents(cfg.path), tokenizer), tokenizer.vocab_size, cfg.path
    elif cfg.path is None:
        tokens, vocab, source = _stdlib_bytes(cfg.max_bytes), 256, "python-stdlib (bundled)"
    else:
        tokens, vocab, source = _user_tokens(cfg)
    cut = int(len(tokens) * (1 - cfg.heldout_fraction))
    return Corpus(train=tokens[:cut], heldout=tokens[cut:], vocab_size=vocab, source=source)


def documents(path: str | Path, key: str = "jzero.data.path") -> Iterator[str]:
    """The documents of ``path``: each line of a ``.jsonl`` file (its ``"text"``), a text file
    whole, or each file of a folder; ConfigError naming ``key``, the file and line of a bad record."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{key}: {path} does not exist (JSON lines of {{\"text\": ...}}, a text file "
                          "or a folder of them)")
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        if file.suffix != ".jsonl":
            yield file.read_text(encoding="utf-8", errors="replace")
            continue
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: {file} line {number}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f"{key}: {file} line {number}: expected {{\"text\": \"...\"}}")
            yield record["text"]


def tokenized(docs: Iterable[str], tokenizer: Any) -> np.ndarray:
    """The documents' tokens in one stream, each followed by the tokenizer's EOS (unless its
    post-processor already ended it with one), as the bundled corpus runs files together."""
    eos = tokenizer.eos[0] if tokenizer.eos else None
    out: list[int] = []
    for doc in docs:
        ids = tokenizer.encode(doc)
        out.extend(ids + ([eos] if eos is not None and (not ids or ids[-1] not in tokenizer.eos) else []))
    return np.asarray(out, np.int32)


def _stdlib_bytes(max_bytes: int) -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def _user_tokens(cfg: DataConfig) -> tuple[np.ndarray, int, str]:
    path = Path(cfg.path)
    if not path.exists():
        raise ConfigError(f"jzero.data.path: {path} does not exist (valid: a text file or folder, .npy, .bin)")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    elif path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.dtype(cfg.dtype), mode="r")
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        tokens = np.frombuffer(b"".join(p.read_bytes() for p in files)[: cfg.max_bytes], dtype=np.uint8)
    else:
        tokens = np.frombuffer(path.read_bytes()[: cfg.max_bytes], dtype=np.uint8)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"jzero.data.path: {path} must hold a 1-D integer token array, "
                          f"got {tokens.dtype} with shape {tokens.shape}")
    vocab = 256 if tokens.dtype == np.uint8 else int(tokens.max()) + 1
    return tokens, vocab, str(path)


def batch_rows(tokens: np.ndarray, seed: int, split: str, step: int, rows: range, seq_len: int) -> dict:
    """Rows ``rows`` of the global batch for ``(seed, split, step)``: inputs and next-token targets."""
    if len(tokens) <= seq_len + 1:
        raise ConfigError(f"jzero.data: the {split} split has {len(tokens)} tokens, fewer than "
                          f"seq_len + 2 = {seq_len + 2}; use more data or a shorter jzero.model.seq_len")
    rng = np.random.default_rng([seed, SPLITS[split], step])
    offsets = rng.integers(0, len(tokens) - seq_len - 1, size=rows.stop)[rows.start:rows.stop]
    window = np.stack([np.asarray(tokens[o:o + seq_len + 1]) for o in offsets]).astype(np.int32)
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def global_batch(tokens: np.ndarray, seed: int, split: str, step: int, batch_size: int, seq_len: int,
                 sharding: NamedSharding) -> dict:
    """The global batch as sharded arrays; this process builds only its own rows."""
    n_proc, proc = jax.process_count(), jax.process_index()
    per = batch_size // n_proc
    local = batch_rows(tokens, seed, split, step, range(proc * per, (proc + 1) * per), seq_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, seq_len))
            for k, v in local.items()}


def describe(corpus: Corpus) -> str:
    return (f"{corpus.source}: {len(corpus.train):,} train / {len(corpus.heldout):,} held-out tokens, "
            f"vocab {corpus.vocab_size}")


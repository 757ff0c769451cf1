"""Records tokenized once: a memory-mapped token cache beside the data.

Tokenizing a large corpus at every start would cost minutes; the cache keeps the documents'
tokens, loss masks and starts as ``.npy`` files in ``PATH.jzero-cache/KEY/`` and maps them on the
next start. KEY hashes what decides them: each data file's path, size and modification time,
the tokenizer (`jzero.inference.text.Ids.fingerprint`: its tokenizer.json, chat template, special
tokens) and the data settings that shape tokens or masks; a change to any builds a new entry
(the old one is removed once the new one is complete). An entry is written to a private folder
and renamed into place, so a stopped build leaves nothing a later start would read, and two
processes building at once both end with one complete entry. A folder that cannot be written
is read anyway: the tokens are then built in memory at every start.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jzero.config import ConfigError, ConfigWarning, DataConfig
from jzero.tasks import records

VERSION = 1
SETTINGS = ("format", "text_field", "messages_field", "prompt_field", "completion_field", "completion_only_loss",
            "assistant_only_loss")  # the DataConfig keys that change tokens or masks


@dataclass(frozen=True)
class Tokens:
    """All documents' tokens end to end, their masks, and where each starts (``starts[-1]``:
    the end); ``source`` says whether they were read from a cache or built."""

    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray
    source: str

    def __len__(self) -> int:
        return len(self.starts) - 1


def key(path: str | Path, cfg: DataConfig, tokenizer: Any) -> str:
    """The cache key of ``path``'s records under ``cfg`` and ``tokenizer``."""
    parts: list[Any] = [VERSION, tokenizer.fingerprint(), {k: getattr(cfg, k) for k in SETTINGS}]
    for file in records.files(path):
        stat = file.stat()
        parts.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def folder(path: str | Path) -> Path:
    """Where ``path``'s cache entries live: a folder beside it."""
    path = Path(path)
    return path.parent / f"{path.name}.jzero-cache"


def load(path: str | Path, cfg: DataConfig, tokenizer: Any) -> Tokens:
    """``path``'s documents as `Tokens`: from the cache when its entry is current, else
    tokenized (and cached, with ``jzero.data.cache``)."""
    entry = folder(path) / key(path, cfg, tokenizer)
    if cfg.cache and (entry / "starts.npy").is_file():
        arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r") for name in ("tokens", "mask", "starts")}
        return Tokens(**arrays, source=f"token cache {entry}")
    built = build(path, cfg, tokenizer)
    if cfg.cache:
        _write(built, entry)
    return built


def build(path: str | Path, cfg: DataConfig, tokenizer: Any) -> Tokens:
    """Tokenize every record of ``path`` (`jzero.tasks.records.documents`)."""
    tokens, masks, starts = [], [], [0]
    for doc in records.documents(path, cfg, tokenizer):
        tokens.append(doc.tokens)
        masks.append(doc.mask)
        starts.append(starts[-1] + len(doc.tokens))
    return Tokens(np.concatenate(tokens).astype(np.int32), np.concatenate(masks).astype(np.uint8),
                  np.asarray(starts, np.int64), source="tokenized")


def _write(built: Tokens, entry: Path) -> None:
    """``built`` into ``entry`` atomically; other entries of the folder removed after."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=entry.parent))
    except OSError as e:
        warnings.warn(f"jzero.data.cache: cannot write {entry.parent} ({e.strerror}); the data is tokenized "
                      "at every start", ConfigWarning, stacklevel=2)
        return
    for field in dataclasses.fields(built):
        if field.name != "source":
            np.save(tmp / f"{field.name}.npy", getattr(built, field.name))
    try:
        os.rename(tmp, entry)
    except OSError:  # another process completed the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    for other in entry.parent.iterdir():
        if other != entry and other.is_dir() and not other.name.startswith(".building-"):
            shutil.rmtree(other, ignore_errors=True)


def check_trained(tokens: Tokens, source: str) -> None:
    """ConfigError when no token is trained on (a document's first token never is: nothing predicts it)."""
    trained = int(np.sum(tokens.mask, dtype=np.int64)) - int(np.sum(np.asarray(tokens.mask)[tokens.starts[:-1]]))
    if trained <= 0:
        raise ConfigError(f"jzero.data.path: {source}: no token is trained on (every completion or assistant turn "
                          "is empty, or the loss flags mask everything)")


def check_vocab(tokens: Tokens, vocab_size: int, source: str) -> None:
    """ConfigError when a token id does not fit the model's vocabulary."""
    top = int(tokens.tokens.max(initial=0))
    if top >= vocab_size:
        raise ConfigError(f"jzero.model.vocab_size: {vocab_size} is smaller than the data's token ids "
                          f"(up to {top} in {source})")

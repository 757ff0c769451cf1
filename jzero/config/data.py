"""The ``jzero.data`` section: where training data comes from and how records become rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DataConfig:
    """Training data: ``path`` is a text file/folder or a token file (.npy / .bin); none = the
    bundled corpus (the Python standard library's sources, byte level). Records files (JSON
    lines or Parquet, `jzero.tasks.records`) are fine-tuning data: ``format`` and the field names
    say how to read them, the loss flags which tokens train, ``packing`` whether documents share
    rows (`jzero.tasks.packer`), ``cache`` whether their tokens are kept beside the data."""

    path: str | None = None
    dtype: Literal["uint8", "uint16", "int32"] = "uint16"
    heldout_fraction: float = 0.05
    max_bytes: int = 4_000_000
    format: Literal["auto", "text", "messages", "prompt_completion"] = "auto"
    text_field: str = "text"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    completion_only_loss: bool = True
    assistant_only_loss: bool = True
    packing: bool = True
    cache: bool = True

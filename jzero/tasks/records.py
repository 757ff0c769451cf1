"""Fine-tuning records in, token documents with loss masks out.

A data file is JSON lines (``.jsonl``) or Parquet (``.parquet``, read with pyarrow), or a folder
of them (sorted by path). Each record is one of three formats, as TRL's SFTTrainer takes them:

* ``text``: a string, every token trained on;
* ``messages``: a list of ``{role, content}``, rendered with the tokenizer's chat template;
  with ``assistant_only_loss`` only the assistant turns' tokens (their content and the template's
  end-of-turn marker) are trained on, found by rendering the conversation turn by turn: an
  assistant turn is the text between the rendering up to it (with the generation prompt) and
  the rendering through it;
* ``prompt`` + ``completion``: strings, tokenized apart and joined, or lists of messages
  (TRL's conversational prompt-completion: the prompt rendered with the generation prompt, the
  completion as what the template adds after it); with ``completion_only_loss`` only the
  completion's tokens are trained on.

The format is read from the fields present (``jzero.data.format: auto``) or fixed; the field
names are configurable. A document ends with the tokenizer's EOS, trained on where its last
token is. Bad input is a ConfigError naming the file, the row and the field.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jzero.config import ConfigError, DataConfig

SUFFIXES = (".jsonl", ".parquet")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Document:
    """One record's tokens and, per token, whether predicting it counts in the loss."""

    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8, tokens' shape


def is_records(path: str | Path) -> bool:
    """Whether ``path`` is a records file, or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        return any(_suffix(p) in SUFFIXES for p in path.rglob("*") if p.is_file())
    return _suffix(path) in SUFFIXES


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def files(path: str | Path) -> list[Path]:
    """The records files of ``path`` in order; ConfigError if none."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"jzero.data.path: {path} does not exist")
    found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p) in SUFFIXES) if path.is_dir() else [path]
    if not found:
        raise ConfigError(f"jzero.data.path: {path} holds no {' or '.join(SUFFIXES)} file")
    return found


def rows(file: Path) -> Iterator[tuple[int, dict]]:
    """``(row number from 1, record)`` of a records file; ConfigError on an empty file or a
    row that is not an object."""
    count = 0
    for number, record in (_parquet_rows(file) if _suffix(file) == ".parquet" else _jsonl_rows(file)):
        if not isinstance(record, dict):
            raise ConfigError(f"jzero.data.path: {file} row {number}: expected an object with fields, "
                              f"got {type(record).__name__}")
        count += 1
        yield number, record
    if not count:
        raise ConfigError(f"jzero.data.path: {file} is empty (no records)")


def _jsonl_rows(file: Path) -> Iterator[tuple[int, Any]]:
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"jzero.data.path: {file} row {number}: not UTF-8 "
                                  f"(byte {e.start} of the row)") from None
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"jzero.data.path: {file} row {number}: not JSON ({e.msg})") from None


def _parquet_rows(file: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"jzero.data.path: {file}: reading Parquet needs pyarrow "
                          "(pip install 'jzero[sft]')") from None
    number = 0
    for batch in pq.ParquetFile(file).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            number += 1
            yield number, record


def first_format(path: str | Path, cfg: DataConfig) -> str:
    """The format of ``path``'s first record (`detect`)."""
    file = files(path)[0]
    number, record = next(rows(file))
    return detect(record, cfg, f"{file} row {number}")


def detect(record: dict, cfg: DataConfig, where: str) -> str:
    """The record's format: ``jzero.data.format``, or the first whose fields it has."""
    if cfg.format != "auto":
        return cfg.format
    for name, fields in FORMATS.items():
        if all(getattr(cfg, f) in record for f in fields):
            return name
    wanted = " or ".join("+".join(repr(getattr(cfg, f)) for f in fields) for fields in FORMATS.values())
    raise ConfigError(f"jzero.data.path: {where}: no field {wanted} (fields: {', '.join(map(str, record)) or 'none'}; "
                      "jzero.data.*_field renames them)")


def _field(record: dict, cfg: DataConfig, key: str, where: str, kind: type) -> Any:
    name = getattr(cfg, key)
    if name not in record:
        raise ConfigError(f"jzero.data.path: {where}: missing field '{name}' (jzero.data.{key})")
    value = record[name]
    if kind is str and isinstance(value, list) and key in ("prompt_field", "completion_field"):
        raise ConfigError(f"jzero.data.path: {where}: field '{cfg.prompt_field}' is a string and "
                          f"'{cfg.completion_field}' a list; give both as text or both as messages")
    if not isinstance(value, kind):
        raise ConfigError(f"jzero.data.path: {where}: field '{name}' must be a {kind.__name__}, "
                          f"got {type(value).__name__}")
    return value


def _text(record: dict, cfg: DataConfig, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(_field(record, cfg, "text_field", where, str))
    return ids, [1] * len(ids)


def _prompt_completion(record: dict, cfg: DataConfig, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    if isinstance(record.get(cfg.prompt_field), list):  # conversational: lists of messages
        prompt = _checked_messages(_field(record, cfg, "prompt_field", where, list), cfg.prompt_field, where)
        answer = _checked_messages(_field(record, cfg, "completion_field", where, list), cfg.completion_field, where)
        render = _renderer(tokenizer, where)
        asked, whole = render(prompt, True), render(prompt + answer, False)
        if not whole.startswith(asked):
            raise ConfigError(f"jzero.data.path: {where}: the chat template renders the prompt differently alone "
                              "and followed by the completion, so the completion cannot be found")
        prompt_ids, answer_ids = tokenizer.encode(asked, special=False), tokenizer.encode(whole[len(asked):], False)
    else:
        prompt_ids = tokenizer.encode(_field(record, cfg, "prompt_field", where, str))
        answer_ids = tokenizer.encode(_field(record, cfg, "completion_field", where, str), special=False)
    return prompt_ids + answer_ids, [0 if cfg.completion_only_loss else 1] * len(prompt_ids) + [1] * len(answer_ids)


def _checked_messages(messages: list, field: str, where: str) -> list:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ConfigError(f"jzero.data.path: {where}: field '{field}'[{i}] must be "
                              "{\"role\": ..., \"content\": \"...\"}")
        if message.get("role") not in ROLES:
            raise ConfigError(f"jzero.data.path: {where}: field '{field}'[{i}]: unknown role "
                              f"{message.get('role')!r}; valid: {', '.join(ROLES)}")
    return messages


def _messages(record: dict, cfg: DataConfig, tokenizer: Any, where: str) -> tuple[list[int], list[int]]:
    messages = _checked_messages(_field(record, cfg, "messages_field", where, list), cfg.messages_field, where)
    render = _renderer(tokenizer, where)
    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and cfg.assistant_only_loss:
            start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
            if full[:end] != render(messages[: i + 1], False):
                raise ConfigError(f"jzero.data.path: {where}: the chat template renders a conversation's start "
                                  "differently from the whole, so assistant turns cannot be found; set "
                                  "jzero.data.assistant_only_loss: false")
            spans.append((start, end))
    ids, offsets = tokenizer.encode_offsets(full, special=False)
    if not cfg.assistant_only_loss:
        return ids, [1] * len(ids)
    return ids, [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]


def _renderer(tokenizer: Any, where: str) -> Any:
    if not getattr(tokenizer, "template", None):
        raise ConfigError(f"jzero.data.path: {where}: chat messages need the tokenizer's chat template, and it has "
                          "none (chat_template.jinja or tokenizer_config.json's chat_template)")
    return lambda messages, prompt: tokenizer.chat(messages, add_generation_prompt=prompt)


FORMATS: dict[str, tuple[str, ...]] = {  # format -> the config keys naming its fields, in detection order
    "messages": ("messages_field",),
    "prompt_completion": ("prompt_field", "completion_field"),
    "text": ("text_field",),
}
ENCODERS = {"messages": _messages, "prompt_completion": _prompt_completion, "text": _text}


def documents(path: str | Path, cfg: DataConfig, tokenizer: Any) -> Iterator[Document]:
    """Every record of ``path`` as a `Document`, each ended with the tokenizer's EOS."""
    eos = tokenizer.eos[0] if tokenizer.eos else None
    for file in files(path):
        for number, record in rows(file):
            where = f"{file} row {number}"
            ids, mask = ENCODERS[detect(record, cfg, where)](record, cfg, tokenizer, where)
            if eos is not None and (not ids or ids[-1] not in tokenizer.eos):
                ids, mask = ids + [eos], mask + [mask[-1] if mask else 1]
            yield Document(np.asarray(ids, np.int32), np.asarray(mask, np.uint8))

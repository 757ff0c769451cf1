"""Consolidated weights: a checkpoint's params (and model state) as one safetensors file, and back.

`export` streams leaf by leaf: the header is written from the checkpoint's record (names, shapes,
dtypes), then each leaf is read from the checkpoint as a host array, checked against its
checksum, cast and appended, so peak host memory is about the largest leaf, not the model
(DeepSpeed's zero_to_fp32 holds the whole model). The safetensors library cannot write a file
piece by piece, so the writer is ours (the format is an 8-byte length, a JSON header and raw
little-endian bytes); reading uses the library (memory-mapped, no pickle). Tensor names are the
param tree's dotted paths (``blocks.stacked.mlp.fc.kernel``); a model's state (BatchNorm
statistics) follows under ``model_state.`` (``model_state.batch_stats.BatchNorm_0.mean``), kept
in its saved dtype.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jzero.config import Config
from jzero.models import lora
from jzero.runtime.checkpoint import Checkpointer, CheckpointError
from jzero.zero import treepath

DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
                      "uint8": "U8", "bool": "BOOL"}
_ALIGN = 8
MODEL_STATE = "model_state"  # the prefix of the model state's leaves, in the checkpoint and the file


def resolve(checkpoint: str | os.PathLike) -> tuple[Checkpointer, int]:
    """A checkpoint directory (its newest readable step) or one step directory in it."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if re.fullmatch(r"\d+", path.name) and (path / "record").is_dir():
        return Checkpointer(path.parent), int(path.name)
    ckpt = Checkpointer(path)
    for step in reversed(ckpt.all_steps()):
        try:
            ckpt.record(step)
            return ckpt, step
        except CheckpointError:
            continue
    raise CheckpointError(f"{path}: no readable checkpoint (expected a jzero checkpoint directory or one step in it)")


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None) -> dict[str, Any]:
    """Write the params and model state of ``checkpoint`` to ``out`` (.safetensors); floating
    params cast to ``dtype`` ("fp32" or "bf16"; default: as saved). Returns what was written."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    ckpt, step = resolve(checkpoint)
    leaves = {name: leaf for name, leaf in ckpt.record(step)["leaves"].items()
              if name.startswith(("params/", f"{MODEL_STATE}/"))}
    layout, offset = {}, 0
    for name, leaf in leaves.items():
        out_dtype = _cast_dtype(np.dtype(leaf["dtype"]), dtype if name.startswith("params/") else None)
        size = int(np.prod(leaf["shape"])) * out_dtype.itemsize
        layout[name] = (_tensor_name(name), out_dtype, leaf["shape"], offset, offset + size)
        offset += size
    header = {"__metadata__": {"format": "jzero", "source": str(ckpt.directory), "step": str(step)}}
    header.update({key: {"dtype": SAFETENSORS_DTYPES[dt.name], "shape": list(shape), "data_offsets": [begin, end]}
                   for key, dt, shape, begin, end in layout.values()})
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write_header(f, header)
            for name, (_, out_dtype, _, _, _) in layout.items():
                np.ascontiguousarray(ckpt.read_array(step, name).astype(out_dtype, copy=False)).tofile(f)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"step": step, "tensors": len(layout), "bytes": offset, "path": str(out)}


def load_params(path: str | os.PathLike) -> dict[str, Any]:
    """The params of an exported safetensors file as a nested dict of numpy arrays: pass it to
    ``jzero.init(..., params=...)`` to start training (or evaluating) from it."""
    return treepath.nest({k: v for k, v in _read(path).items() if not k.startswith(f"{MODEL_STATE}{treepath.SEP}")})


def read_params(path: str | os.PathLike) -> dict[str, Any]:
    """The params wherever training left them, as host numpy arrays: an exported ``.safetensors``
    file, or a jzero checkpoint (a directory: its newest readable step, or one step directory;
    any stage, any mesh: each leaf is read whole and checked against its checksum)."""
    if Path(path).is_file():
        return load_params(path)
    ckpt, step = resolve(path)
    names = [name for name in ckpt.record(step)["leaves"] if name.startswith("params/")]
    return treepath.nest({name.removeprefix("params/"): ckpt.read_array(step, name) for name in names})


def load_model_state(path: str | os.PathLike) -> dict[str, Any] | None:
    """The model state of an exported safetensors file (None for a stateless model): pass it to
    ``jzero.init(..., model_state=...)`` with the params."""
    prefix = f"{MODEL_STATE}{treepath.SEP}"
    named = {k.removeprefix(prefix): v for k, v in _read(path).items() if k.startswith(prefix)}
    return treepath.nest(named) if named else None


def _read(path: str | os.PathLike) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such safetensors file")
    with safe_open(str(path), framework="numpy") as f:
        return {key.replace(".", treepath.SEP): f.get_tensor(key) for key in f.keys()}


def _tensor_name(name: str) -> str:
    return name.removeprefix("params/").replace(treepath.SEP, ".")


def _cast_dtype(saved: np.dtype, dtype: str | None) -> np.dtype:
    floating = np.issubdtype(saved, np.floating) or saved == DTYPES["bf16"]
    return DTYPES[dtype] if dtype is not None and floating else saved


def write_header(f: Any, header: dict[str, Any]) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % _ALIGN)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)


def with_saved_lora(config: Config, checkpoint: str | os.PathLike | None) -> Config:
    """``config``, with the ``jzero.lora`` section a LoRA checkpoint was trained with when the
    config has none (so eval, generate and serve of a checkpoint need not repeat it)."""
    if checkpoint is None or config.jzero.lora is not None or Path(checkpoint).is_file():
        return config
    ckpt, step = resolve(checkpoint)
    saved = lora.from_raw(ckpt.record(step)["config"])
    if saved is None:
        return config
    return dataclasses.replace(config, jzero=dataclasses.replace(config.jzero, lora=saved))

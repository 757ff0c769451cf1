"""Hugging Face weights out: ``jzero export CHECKPOINT --hf OUT`` writes a checkpoint trained from
a Hugging Face directory back in that directory's format, for transformers' ``from_pretrained``.

The architecture is the source directory's (``jzero.model.hf`` in the checkpoint's config): its
``config.json`` is copied with ``dtype`` (and 4.x's ``torch_dtype``) set to what is written, and
its tokenizer files come along. Each param leaf goes back through the family's rename table
(`jzero.runtime.hf.RENAMES`, inverted: a stacked leaf becomes one tensor a layer), in shards of
at most ``max_shard_size`` bytes with ``model.safetensors.index.json`` (one file, no index, when
it fits), as ``save_pretrained`` writes them; tied embeddings are written once. A leaf is read
whole from the checkpoint (checked against its checksum) and written before the next is read.
The directory appears whole or not at all: it is written beside OUT and renamed into place.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from jzero.config import ConfigError, LoraConfig
from jzero.models import hfconfig, lora
from jzero.runtime import hf
from jzero.runtime.weights import DTYPES, SAFETENSORS_DTYPES, resolve, write_header

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_bytes(size: str | int) -> int:
    """``"5GB"``, ``"40KB"``, ``"2GiB"`` or a number of bytes, as bytes; ValueError otherwise."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if not found or float(found.group(1)) <= 0:
        raise ValueError(f"--max-shard-size: expected a size like 5GB, 40KB or 2GiB, got {size!r}")
    return int(float(found.group(1)) * _UNITS[found.group(2) or ""])


class _Tensor(NamedTuple):
    hf: str  # its name in the files
    leaf: str  # the checkpoint leaf it comes from
    layer: int | None  # a stacked leaf's layer
    layout: str
    shape: tuple[int, ...]  # in the files
    dtype: np.dtype  # as written

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def _tensors(record: dict, family: str, tied: bool, dtype: np.dtype | None) -> list[_Tensor]:
    out = []
    for name, leaf in record["leaves"].items():
        if not name.startswith("params/") or name.rsplit("/", 1)[-1] in (lora.A, lora.B):
            continue
        param = name.removeprefix("params/")
        pattern, layout = hf.hf_name(family, param)
        if tied and pattern == "lm_head.weight":
            continue
        stacked, shape = "{i}" in pattern, tuple(leaf["shape"])
        written = dtype if dtype is not None else np.dtype(leaf["dtype"])
        hf_shape = hf.LAYOUTS[layout].hf_shape(shape[1:] if stacked else shape)
        out += [_Tensor(pattern.format(i=i), name, i, layout, hf_shape, written)
                for i in (range(shape[0]) if stacked else [None])]
    return out


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    shards: list[list[_Tensor]] = [[]]
    for t in tensors:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + t.nbytes > limit:
            shards.append([])
        shards[-1].append(t)
    return shards



def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
              max_shard_size: str | int = "5GB") -> dict[str, Any]:
    """Write ``checkpoint``'s params as a Hugging Face directory ``out`` (module docstring)."""
    limit = shard_bytes(max_shard_size)
    ckpt, step = resolve(checkpoint)
    record = ckpt.record(step)
    source = record["config"].get("jzero", {}).get("model", {}).get("hf")
    if source is None:
        raise ConfigError(f"export --hf: {checkpoint} was not trained from a Hugging Face directory "
                          "(jzero.model.hf): there is no architecture to write it as")
    if not (Path(source) / "config.json").is_file():
        raise ConfigError(f"export --hf: the checkpoint's Hugging Face directory {source} has no config.json "
                          "any more (it supplies the architecture and tokenizer)")
    raw = hfconfig.read(source)
    spec = hfconfig.from_dict(raw)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"export --hf: {out} exists and is not empty")
    cast = DTYPES[dtype] if dtype else None
    tensors = _tensors(record, spec.name, spec.model.tie_embeddings, cast)
    shards = _shards(tensors, limit)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        adapters, names = lora.from_raw(record["config"]), set(record["leaves"])
        weight_map = _write_shards(lambda leaf: _merged(ckpt, step, leaf, adapters, names), shards, tmp, cast)
        name = HF_DTYPE_NAMES[dtype] if dtype else _saved_dtype(record)
        raw = {**raw, "dtype": name, **({"torch_dtype": name} if "torch_dtype" in raw else {})}
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for file in TOKENIZER_FILES:
            if (Path(source) / file).is_file():
                shutil.copy2(Path(source) / file, tmp / file)
        if len(shards) > 1:
            total = sum(t.nbytes for t in tensors)
            (tmp / hf.INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"step": step, "tensors": len(tensors), "shards": len(shards), "bytes": sum(t.nbytes for t in tensors),
            "path": str(out)}


def _saved_dtype(record: dict) -> str:
    dtypes = {leaf["dtype"] for name, leaf in record["leaves"].items() if name.startswith("params/")}
    return "bfloat16" if dtypes == {"bfloat16"} else "float32"


def _write_shards(read: Any, shards: list[list[_Tensor]], folder: Path, cast: np.dtype | None) -> dict[str, str]:
    """Each shard's header from the plan, then its tensors streamed in: one leaf in memory
    (a kernel with LoRA adapters merged with them as it is read)."""
    weight_map, current = {}, (None, None)
    for i, shard in enumerate(shards, 1):
        file = hf.SINGLE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in shard:
            header[t.hf] = {"dtype": SAFETENSORS_DTYPES[t.dtype.name], "shape": list(t.shape),
                            "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
            weight_map[t.hf] = file
        with open(folder / file, "wb") as f:
            write_header(f, header)
            for t in shard:
                if current[0] != t.leaf:  # each leaf read once, whole; its layers written in order
                    value = read(t.leaf)
                    current = (t.leaf, value.astype(cast) if cast is not None else value)
                layer = current[1] if t.layer is None else current[1][t.layer]
                np.ascontiguousarray(hf.LAYOUTS[t.layout].to_hf(layer)).tofile(f)
    return weight_map


def _merged(ckpt: Any, step: int, leaf: str, adapters: LoraConfig | None, names: set[str]) -> np.ndarray:
    """Leaf ``leaf``, plus ``alpha / r x lora_A @ lora_B`` where the checkpoint (its leaf
    ``names``) has adapters for it."""
    value = ckpt.read_array(step, leaf)
    module = leaf.rsplit("/", 1)[0]
    if adapters is None or not leaf.endswith("/kernel") or f"{module}/{lora.A}" not in names:
        return value
    a, b = ckpt.read_array(step, f"{module}/{lora.A}"), ckpt.read_array(step, f"{module}/{lora.B}")
    delta = np.matmul(a.astype(np.float32), b.astype(np.float32)) * lora.scale_of(adapters)
    return (value.astype(np.float32) + delta.reshape(value.shape)).astype(value.dtype)

"""Hugging Face weights in: a model directory's safetensors, streamed into jzero's params.

The Llama family's params carry HF's names (`jzero.models.llama`), the GPT's GPT-2's under
other words, so each family's conversion is a rename table (`RENAMES`): a jzero leaf name
pattern, the HF tensor it comes from (``{i}``: the layer, for the stacked layers) and how the
layout differs: ``T`` (torch's Linear is [out, in], a Flax kernel [in, out]), ``RESHAPE``
(GPT-2's fused c_attn [C, 3C] is the GPT's qkv [C, 3, C]) or none.

Nothing is read until a device asks for its shard: `lazy_params` gives a tree of `Lazy` leaves
that `jzero.init(params=...)` places shard by shard (``jax.make_array_from_callback``); a shard
reads, per layer, only the rows (and for a transposed kernel, the columns) it holds from the
memory-mapped file. Host memory during a load is one shard plus one tensor's slice at a time,
never the model. The files are parsed here (8-byte header length, JSON header, raw
little-endian data): numpy has no bfloat16, which `ml_dtypes` supplies, and no torch is needed.
"""
from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from jzero.config import ConfigError
from jzero.zero import treepath

FILE_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
               "F64": np.dtype(np.float64)}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Buffers some checkpoints save that are not weights (GPT-2's causal mask, old rotary caches).
NOT_WEIGHTS = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")


class Rename(NamedTuple):
    """jzero leaf name (regex, full match) -> HF tensor name (``{i}``: layer; ``\\1``: the
    match's group, dots for slashes) and the layout change (`LAYOUTS`: read, shape and write)."""

    jzero: str
    hf: str
    layout: str = ""


RENAMES: dict[str, tuple[Rename, ...]] = {
    "llama": (
        Rename("embed_tokens/embedding", "model.embed_tokens.weight"),
        Rename("norm/weight", "model.norm.weight"),
        Rename("lm_head/kernel", "lm_head.weight", "T"),
        Rename("layers/stacked/(.+)/kernel", r"model.layers.{i}.\1.weight", "T"),
        Rename("layers/stacked/(.+)/(weight|bias)", r"model.layers.{i}.\1.\2"),
    ),
    "gpt": (
        Rename("wte/embedding", "transformer.wte.weight"),
        Rename("wpe", "transformer.wpe.weight"),
        Rename("ln_f/scale", "transformer.ln_f.weight"),
        Rename("ln_f/bias", "transformer.ln_f.bias"),
        Rename("blocks/stacked/ln(1|2)/scale", r"transformer.h.{i}.ln_\1.weight"),
        Rename("blocks/stacked/ln(1|2)/bias", r"transformer.h.{i}.ln_\1.bias"),
        Rename("blocks/stacked/qkv/kernel", "transformer.h.{i}.attn.c_attn.weight", "RESHAPE"),
        Rename("blocks/stacked/qkv/bias", "transformer.h.{i}.attn.c_attn.bias", "RESHAPE"),
        Rename("blocks/stacked/proj/kernel", "transformer.h.{i}.attn.c_proj.weight"),
        Rename("blocks/stacked/proj/bias", "transformer.h.{i}.attn.c_proj.bias"),
        Rename("blocks/stacked/fc/kernel", "transformer.h.{i}.mlp.c_fc.weight"),
        Rename("blocks/stacked/fc/bias", "transformer.h.{i}.mlp.c_fc.bias"),
        Rename("blocks/stacked/out/kernel", "transformer.h.{i}.mlp.c_proj.weight"),
        Rename("blocks/stacked/out/bias", "transformer.h.{i}.mlp.c_proj.bias"),
    ),
}
PREFIXES = {"llama": "model.", "gpt": "transformer."}  # base-model checkpoints save without them


def hf_name(family: str, name: str) -> tuple[str, str]:
    """(the HF tensor name pattern, with ``{i}`` for a stacked leaf's layer, and its layout) of
    jzero leaf ``name``; KeyError when no rename covers it."""
    for rename in RENAMES[family]:
        found = re.fullmatch(rename.jzero, name)
        if found:
            return found.expand(rename.hf).replace("/", "."), rename.layout
    raise KeyError(f"no Hugging Face name for the {family} param {name}")


def has_weights(directory: str | Path) -> bool:
    """Whether a Hugging Face directory holds weights (one safetensors file or an index)."""
    return (Path(directory) / INDEX).is_file() or (Path(directory) / SINGLE).is_file()


class Tensors:
    """The tensors of a directory's safetensors files (one, or shards with an index), each a
    read-only memory-mapped numpy view, opened when first asked for."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE).is_file():
            weight_map = {name: SINGLE for name in _header(self.directory / SINGLE)}
        else:
            raise ConfigError(f"jzero.model.hf: {self.directory} holds neither {SINGLE} nor {INDEX}")
        self.files = weight_map
        self._open: dict[str, dict[str, np.ndarray]] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __getitem__(self, name: str) -> np.ndarray:
        file = self.files[name]
        if file not in self._open:
            path = self.directory / file
            if not path.is_file():
                raise ConfigError(f"{INDEX}: shard {file} (holding {name}) is missing from {self.directory}")
            self._open[file] = _mapped(path)
        return self._open[file][name]


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _mapped(path: Path) -> dict[str, np.ndarray]:
    header = _header(path)
    start = 8 + struct.unpack("<Q", path.open("rb").read(8))[0]
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, entry in header.items():
        if entry["dtype"] not in FILE_DTYPES:
            raise ConfigError(f"{path.name}: tensor {name} has dtype {entry['dtype']}; supported: "
                              f"{', '.join(FILE_DTYPES)}")
        begin, end = entry["data_offsets"]
        raw = data[start + begin:start + end]
        out[name] = raw.view(FILE_DTYPES[entry["dtype"]]).reshape(entry["shape"])
    return out


class Layout(NamedTuple):
    """How a jzero leaf (one layer of it) and its HF tensor differ, both ways."""

    read: Callable[[np.ndarray, tuple, tuple], np.ndarray]  # (HF tensor, index, jzero shape) -> the slice
    hf_shape: Callable[[tuple], tuple]  # jzero shape -> HF shape
    to_hf: Callable[[np.ndarray], np.ndarray]  # jzero value -> HF tensor


def _fused(shape: tuple) -> tuple:
    return (shape[0], shape[1] * shape[2]) if len(shape) == 3 else (shape[0] * shape[1],)


LAYOUTS: dict[str, Layout] = {
    "": Layout(lambda t, index, shape: t[index], lambda shape: shape, lambda x: x),
    "T": Layout(lambda t, index, shape: t[tuple(reversed(index))].T, lambda shape: tuple(reversed(shape)),
                lambda x: x.T),
    "RESHAPE": Layout(lambda t, index, shape: np.asarray(t).reshape(shape)[index], _fused,
                      lambda x: x.reshape(_fused(x.shape))),
}


class Lazy:
    """A params leaf read on demand: ``leaf[index]`` reads just that block (per layer, for a
    stacked leaf) from the files, as fp32. ``shape`` is the leaf's."""

    def __init__(self, tensors: Tensors, names: list[str], layout: str, shape: tuple[int, ...], stacked: bool):
        self.tensors, self.names, self.layout, self.stacked = tensors, names, layout, stacked
        self.shape = tuple(shape)
        self.dtype = np.dtype(np.float32)

    def __getitem__(self, index: Any) -> np.ndarray:
        index = np.index_exp[index]
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (len(self.shape) - len(index) + 1) + index[at + 1:]
        index = index + (slice(None),) * (len(self.shape) - len(index))
        index = tuple(slice(*i.indices(n)) if isinstance(i, slice) else i
                      for i, n in zip(index, self.shape, strict=True))
        read = LAYOUTS[self.layout].read
        if not self.stacked:
            return np.asarray(read(self.tensors[self.names[0]], index, self.shape), np.float32)
        layers = range(*index[0].indices(self.shape[0]))
        return np.stack([np.asarray(read(self.tensors[self.names[i]], index[1:], self.shape[1:]), np.float32)
                         for i in layers])


def lazy_params(directory: str | Path, family: str, params_shape: Any) -> Any:
    """``params_shape`` (jzero's, e.g. ``jax.eval_shape`` of the init) as `Lazy` leaves reading
    ``directory``'s weights. ConfigError naming the tensor when one is missing, has another shape,
    or is left over (a weight jzero's model has no place for: a mapping would be wrong)."""
    tensors = Tensors(directory)
    prefix = PREFIXES[family]
    have = set(tensors.names())
    if not any(n.startswith(prefix) for n in have):  # a base model's checkpoint: names without the prefix
        tensors.files = {prefix + n: f for n, f in tensors.files.items()}
        have = set(tensors.names())
    used, out = set(), {}
    for name, leaf in treepath.named_leaves(params_shape).items():
        pattern, layout = hf_name(family, name)
        stacked = "{i}" in pattern
        names = [pattern.format(i=i) for i in range(leaf.shape[0])] if stacked else [pattern]
        per_layer = tuple(leaf.shape[1:] if stacked else leaf.shape)
        for hf in names:
            if hf not in have:
                raise ConfigError(f"jzero.model.hf: {directory}: tensor {hf} is missing (needed for {name})")
            want = LAYOUTS[layout].hf_shape(per_layer)
            if tuple(tensors[hf].shape) != want:
                raise ConfigError(f"jzero.model.hf: {directory}: tensor {hf} has shape {list(tensors[hf].shape)}, "
                                  f"config.json gives {list(want)}")
        used.update(names)
        out[name] = Lazy(tensors, names, layout, leaf.shape, stacked)
    left = sorted(n for n in have - used if not NOT_WEIGHTS.search(n) and n != "lm_head.weight")
    if left:
        raise ConfigError(f"jzero.model.hf: {directory}: tensor {left[0]} has no place in the model "
                          f"({len(left)} such; config.json and the weights disagree)")
    return treepath.nest(out)

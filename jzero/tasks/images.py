"""Image data for the vision tasks: the bundled digits, or the user's images, and deterministic
batches (the counterpart of `jzero.tasks.text` for tokens).

Bundled: scikit-learn's digits (1,797 8x8 grey images of 10 classes, shipped inside the
scikit-learn wheel: read from its files, nothing downloaded, scikit-learn itself not imported).
The user's: ``jzero.data.path`` = a folder with one sub-folder of images per class (its name is
the class name), or an ``.npz`` with ``images`` (N, H, W[, C]) and ``labels`` (N,), optionally
``class_names``. Pixels become float32 in [0, 1]. A fixed permutation (seed 0) then the last
``heldout_fraction`` is the held-out split. Captions for CLIP come from class names and
templates (`caption`).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from jzero.config import ConfigError, DataConfig
from jzero.tasks.text import SPLITS

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = ("a photo of the number {name}", "a handwritten {name}", "the digit {name}",
             "an image of a {name}", "{name}, written by hand")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


@dataclass(frozen=True)
class Images:
    """Train and held-out images (N, H, W, C) float32 in [0, 1] with int32 labels."""

    train: np.ndarray
    train_labels: np.ndarray
    heldout: np.ndarray
    heldout_labels: np.ndarray
    class_names: tuple[str, ...]
    source: str

    def split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        return (self.train, self.train_labels) if split == "train" else (self.heldout, self.heldout_labels)


def load_images(cfg: DataConfig) -> Images:
    """The configured images (``jzero.data.path``), or the bundled digits."""
    if cfg.path is None:
        images, labels, names, source = *_digits(), DIGIT_NAMES, "digits (scikit-learn's, bundled)"
    else:
        images, labels, names, source = _user_images(Path(cfg.path))
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    cut = int(round(len(images) * (1 - cfg.heldout_fraction)))
    if cut < 1 or cut >= len(images):
        raise ConfigError(f"jzero.data.heldout_fraction: {cfg.heldout_fraction} leaves an empty split of "
                          f"{len(images)} images")
    return Images(images[:cut], labels[:cut], images[cut:], labels[cut:], tuple(names), source)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ConfigError("jzero.data.path: the bundled digits come with scikit-learn; "
                          "pip install 'jzero[vision]' (or give a folder of images or an .npz)")
    table = np.loadtxt(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return (table[:, :-1] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32), table[:, -1].astype(np.int32)


def _user_images(path: Path) -> tuple[np.ndarray, np.ndarray, list[str], str]:
    if not path.exists():
        raise ConfigError(f"jzero.data.path: {path} does not exist (valid: a folder of class folders, or an .npz)")
    if path.suffix == ".npz":
        return (*_npz(path), str(path))
    if not path.is_dir():
        raise ConfigError(f"jzero.data.path: {path} is neither a folder of class folders nor an .npz")
    return (*_folder(path), str(path))


def _npz(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    with np.load(path, allow_pickle=False) as data:
        for key in ("images", "labels"):
            if key not in data:
                raise ConfigError(f"jzero.data.path: {path} has no '{key}' array (has: {', '.join(data.files)})")
        images, labels = data["images"], data["labels"].astype(np.int32)
        names = [str(n) for n in data["class_names"]] if "class_names" in data else None
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or labels.shape != (len(images),):
        raise ConfigError(f"jzero.data.path: {path}: images must be (N, H, W[, C]) and labels (N,), got "
                          f"{images.shape} and {labels.shape}")
    if labels.min() < 0:
        raise ConfigError(f"jzero.data.path: {path}: labels must be >= 0, found {labels.min()}")
    scale = 255.0 if np.issubdtype(images.dtype, np.integer) else 1.0
    return (images / scale).astype(np.float32), labels, names or [str(i) for i in range(int(labels.max()) + 1)]


def _folder(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from PIL import Image

    classes = sorted(p for p in path.iterdir() if p.is_dir())
    if not classes:
        raise ConfigError(f"jzero.data.path: {path} has no class folders (one folder of images per class)")
    images, labels, first = [], [], None
    for label, folder in enumerate(classes):
        for file in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            array = np.asarray(Image.open(file))
            first = first or (file, array.shape)
            if array.shape != first[1]:
                raise ConfigError(f"jzero.data.path: {file} is {array.shape}, but {first[0]} is {first[1]}: "
                                  "all images must have one size")
            images.append(array)
            labels.append(label)
    if not images:
        raise ConfigError(f"jzero.data.path: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {path}")
    stacked = np.stack(images)
    stacked = stacked[..., None] if stacked.ndim == 3 else stacked
    return (stacked / 255.0).astype(np.float32), np.asarray(labels, np.int32), [c.name for c in classes]


def caption(name: str, template: int) -> str:
    return TEMPLATES[template % len(TEMPLATES)].format(name=name)


def encode_text(text: str, length: int) -> np.ndarray:
    """Bytes of ``text`` as int32 tokens, padded with 0 (or cut) to ``length``."""
    raw = np.frombuffer(text.encode("utf-8")[:length], np.uint8).astype(np.int32)
    return np.pad(raw, (0, length - len(raw)))


def batch_indices(n: int, seed: int, split: str, step: int, rows: range) -> tuple[np.ndarray, np.ndarray]:
    """(example indices, caption template indices) of rows ``rows`` of the batch for ``(seed, split, step)``."""
    rng = np.random.default_rng([seed, SPLITS[split], step])
    index, template = rng.integers(0, n, size=rows.stop), rng.integers(0, len(TEMPLATES), size=rows.stop)
    return index[rows.start:], template[rows.start:]


def global_batch(data: Images, seed: int, split: str, step: int, batch_size: int, sharding: NamedSharding,
                 text_len: int | None = None) -> dict:
    """The global batch as sharded arrays (this process builds only its rows): images and labels,
    or (``text_len`` given) images and captions for CLIP."""
    images, labels = data.split(split)
    per = batch_size // jax.process_count()
    rows = range(jax.process_index() * per, (jax.process_index() + 1) * per)
    index, template = batch_indices(len(images), seed, split, step, rows)
    local = {"images": images[index]}
    if text_len is None:
        local["labels"] = labels[index]
    else:
        local["texts"] = np.stack([encode_text(caption(data.class_names[labels[i]], t), text_len)
                                   for i, t in zip(index, template, strict=True)])
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
            for k, v in local.items()}


def describe(data: Images) -> str:
    h, w, c = data.train.shape[1:]
    return (f"{data.source}: {len(data.train):,} train / {len(data.heldout):,} held-out images {h}x{w}x{c}, "
            f"{len(data.class_names)} classes")

"""Protein data for the Evoformer: chains with their 8-state secondary structure (DSSP) and
single-chain structures (Cβ coordinates), read offline from two packages on PyPI installed
without their dependencies, split by PDB id, cropped to a fixed length with a mask.

* sidechainnet 1.0.1 (BSD-3-Clause) ships ``sidechainnet/resources/full_protein_dssp_annotations.json``:
  159,026 PDB chains, ``"1ABC_1_A": {"Sequence": ..., "DSSP": ...}``.
* MDAnalysisTests 2.11.0 ships 50 single-chain X-ray structures, ``MDAnalysisTests/data/dssp/????C.pdb.gz``
  (coordinates from the PDB); read here with the standard library.

Both install with ``pip install --no-deps sidechainnet==1.0.1 MDAnalysisTests==2.11.0`` (their own
dependencies, torch and ProDy among them, are not needed). A folder with the same two things
(``dssp.json`` and ``structures/*.pdb.gz``) can stand in for them (``jzero.data.path``): the tests'
fixture is one.

The held-out split is by PDB id (``crc32(id) % 100 < heldout percent``), fixed across runs and
machines, so chains of one entry never straddle it. It is not a homology split: related proteins
under different ids (the sidechainnet file holds many lysozyme mutants) land on both sides and
make held-out accuracy optimistic.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from jzero.config import ConfigError, DataConfig
from jzero.tasks.text import SPLITS

INSTALL = "pip install --no-deps sidechainnet==1.0.1 MDAnalysisTests==2.11.0"
RESIDUES = "ARNDCQEGHILKMFPSTWYV"  # AlphaFold 2's order; index 20 is the unknown residue (X)
UNKNOWN = len(RESIDUES)
NUM_CLASSES = UNKNOWN + 1
THREE_LETTER = {"ALA": "A", "ARG": "R", "ASN": "N", "ASP": "D", "CYS": "C", "GLN": "Q", "GLU": "E", "GLY": "G",
                "HIS": "H", "ILE": "I", "LEU": "L", "LYS": "K", "MET": "M", "PHE": "F", "PRO": "P", "SER": "S",
                "THR": "T", "TRP": "W", "TYR": "Y", "VAL": "V", "MSE": "M", "UNK": "X"}
DSSP8 = "HGIEBTSC"  # the Q8 classes; DSSP's coil (L, -, blank, C) and its rare PPII (P) are C
_DSSP_CODE = {**{c: i for i, c in enumerate(DSSP8)}, "L": 7, "-": 7, " ": 7, "P": 7}
Q3_OF_Q8 = np.array([0, 0, 0, 1, 1, 2, 2, 2], np.int8)  # H G I -> H; E B -> E; T S C -> C
DISTOGRAM_EDGES = np.linspace(2.3125, 21.6875, 63, dtype=np.float32)  # AF2's 64 bins (Å)
PDB_FILE = re.compile(r"[0-9][0-9A-Za-z]{3}[0-9A-Za-z]\.pdb\.gz")  # PDB id + chain id
STRUCTURE_SHARE = 0.4  # of a batch's rows: crops of structures (distogram labels), the rest sequences (Q8)


@dataclass(frozen=True)
class Chain:
    """One chain: ``residues`` ``[L]`` int8 classes; ``ss8`` ``[L]`` Q8 classes (or None);
    ``coords`` ``[L, 3]`` Cβ (Cα for glycine) in Å with ``has_coords`` ``[L]`` (or None)."""

    name: str
    pdb: str
    residues: np.ndarray
    ss8: np.ndarray | None = None
    coords: np.ndarray | None = None
    has_coords: np.ndarray | None = None


def _table(codes: dict[str, int]) -> np.ndarray:
    lut = np.full(128, -1, np.int8)
    lut[[ord(c) for c in codes]] = list(codes.values())
    return lut


def _lookup(letters: str, codes: dict[str, int], lut: np.ndarray, where: str, what: str) -> np.ndarray:
    """``letters`` as ``codes`` through the ASCII table ``lut`` (vectorized: 159,026 chains load
    in seconds); an unknown letter is one line naming ``where``, the letter and its position."""
    raw = np.frombuffer(letters.encode("utf-32-le"), np.uint32)
    found = np.where(raw < 128, lut[np.minimum(raw, 127)], -1).astype(np.int8)
    bad = np.flatnonzero(found < 0)
    if bad.size:
        raise ConfigError(f"{where}: unknown {what} {letters[bad[0]]!r} at position {bad[0] + 1} "
                          f"(valid: {''.join(codes)})")
    return found


_RESIDUE_CODE = {c: i for i, c in enumerate(RESIDUES)} | {"X": UNKNOWN}
_RESIDUE_LUT, _DSSP_LUT = _table(_RESIDUE_CODE), _table(_DSSP_CODE)


def encode(sequence: str, where: str) -> np.ndarray:
    """Residue classes of a one-letter sequence; an unknown letter is one line naming ``where``."""
    return _lookup(sequence, _RESIDUE_CODE, _RESIDUE_LUT, where, "residue letter")


def secondary_structure(dssp: str, where: str) -> np.ndarray:
    """Q8 classes of a DSSP string."""
    return _lookup(dssp, _DSSP_CODE, _DSSP_LUT, where, "DSSP state")


def heldout(pdb: str, fraction: float) -> bool:
    """Whether PDB entry ``pdb`` is held out: a fixed hash of the id, the same everywhere."""
    return zlib.crc32(pdb.upper().encode()) % 10_000 < round(fraction * 10_000)


def _package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ConfigError(f"jzero.data: the protein task reads the {package} package, which is not "
                          f"installed; install its data with: {INSTALL}")
    return Path(spec.origin).parent / relative


def sequence_file(root: Path | None) -> Path:
    """The DSSP annotations: ``root/dssp.json``, or sidechainnet's."""
    path = root / "dssp.json" if root is not None else _package_file(
        "sidechainnet", "resources/full_protein_dssp_annotations.json")
    if not path.is_file():
        raise ConfigError(f"jzero.data.path: {path} not found (the protein task needs it; {INSTALL})")
    return path


def structure_files(root: Path | None) -> list[Path]:
    """The structures, files named for their PDB entry and chain (``1ahsA.pdb.gz``):
    ``root/structures/``, or MDAnalysisTests' DSSP test set (whose other files are not PDB entries)."""
    folder = root / "structures" if root is not None else _package_file("MDAnalysisTests", "data/dssp")
    files = sorted(f for f in folder.glob("*.pdb.gz") if PDB_FILE.fullmatch(f.name))
    if not files:
        raise ConfigError(f"jzero.data.path: no structures named like 1abcA.pdb.gz in {folder} ({INSTALL})")
    return files


def load_sequences(path: Path, limit: int | None = None) -> list[Chain]:
    """Chains with sequence and Q8 labels, in the file's order (``limit``: the first so many)."""
    with open(path) as f:
        entries = json.load(f)
    chains = []
    for name, entry in entries.items():
        where = f"{path}: chain {name}"
        seq, dssp = entry.get("Sequence"), entry.get("DSSP")
        if not isinstance(seq, str) or not isinstance(dssp, str) or len(seq) != len(dssp) or not seq:
            raise ConfigError(f"{where}: needs a Sequence and a DSSP string of the same nonzero length")
        chains.append(Chain(name, name.split("_")[0].upper(), encode(seq, where), ss8=secondary_structure(dssp, where)))
        if limit is not None and len(chains) == limit:
            break
    return chains


def load_structure(path: Path) -> Chain:
    """A single-chain PDB file (gzip): its first model's residues in order, each residue's Cβ
    (Cα for glycine; first alternate location) as its coordinate."""
    residues: dict[tuple[str, str], dict] = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            if line.startswith("ENDMDL"):
                break
            if not line.startswith("ATOM") or line[16] not in " A":
                continue
            key = (line[22:27], line[17:20])  # residue number + insertion code, name
            res = residues.setdefault(key, {"name": line[17:20], "atoms": {}})
            res["atoms"].setdefault(line[12:16].strip(), [float(line[30:38]), float(line[38:46]), float(line[46:54])])
    if not residues:
        raise ConfigError(f"{path}: no ATOM records (a structure needs coordinates)")
    letters, coords, has = [], [], []
    for res in residues.values():
        letters.append(THREE_LETTER.get(res["name"], "X"))
        atom = res["atoms"].get("CA" if res["name"] == "GLY" else "CB") or res["atoms"].get("CA")
        coords.append(atom or [0.0, 0.0, 0.0])
        has.append(atom is not None)
    name = path.name.removesuffix(".pdb.gz")
    return Chain(name, name[:4].upper(), encode("".join(letters), str(path)),
                 coords=np.asarray(coords, np.float32), has_coords=np.asarray(has))


def distogram_bins(coords: np.ndarray) -> np.ndarray:
    """AF2's distogram classes of every pair: 64 bins over 2.3125-21.6875 Å (the last: beyond)."""
    d = np.linalg.norm(coords[:, None] - coords[None], axis=-1)
    return np.searchsorted(DISTOGRAM_EDGES, d).astype(np.int8)


@dataclass(frozen=True)
class Crop:
    """A chain cut or padded to ``length``: residues, mask, labels (-1 where there are none)."""

    residues: np.ndarray  # [length] int8, UNKNOWN past the chain
    mask: np.ndarray  # [length] bool: a residue of the chain
    ss8: np.ndarray  # [length] int8, -1: none
    distogram: np.ndarray  # [length, length] int8, -1: none (no coordinates, or padding)


def crop(chain: Chain, length: int, start: int) -> Crop:
    """Up to ``length`` residues of ``chain`` from ``start`` (0 <= start < the chain's length),
    padded to ``length`` with a mask. A residue's pair with itself carries no distogram label (its
    distance is 0 by definition)."""
    stop = min(len(chain.residues), start + length)
    n = stop - start
    residues = np.full(length, UNKNOWN, np.int8)
    residues[:n] = chain.residues[start:stop]
    mask = np.arange(length) < n
    ss8 = np.full(length, -1, np.int8)
    if chain.ss8 is not None:
        ss8[:n] = chain.ss8[start:stop]
    dist = np.full((length, length), -1, np.int8)
    if chain.coords is not None:
        has = chain.has_coords[start:stop]
        bins = distogram_bins(chain.coords[start:stop])
        dist[:n, :n] = np.where(has[:, None] & has[None] & ~np.eye(n, dtype=bool), bins, -1)
    return Crop(residues, mask, ss8, dist)


def windows(chain: Chain, length: int) -> list[Crop]:
    """The chain in consecutive crops of ``length`` (the last one padded): how held-out chains
    are evaluated, every residue once."""
    return [crop(chain, length, start) for start in range(0, len(chain.residues), length)]


@dataclass(frozen=True)
class Proteins:
    """The task's chains by split: sequences with Q8 labels, structures with coordinates."""

    sequences: dict[str, list[Chain]]  # "train" / "heldout"
    structures: dict[str, list[Chain]]
    source: str


def load(cfg: DataConfig) -> Proteins:
    """The configured data (``jzero.data.path``: a folder with ``dssp.json`` and
    ``structures/*.pdb.gz``; none: the two packages), split by PDB id at
    ``jzero.data.heldout_fraction``; ConfigError when a split would be empty."""
    root = None if cfg.path is None else Path(cfg.path)
    if root is not None and not root.is_dir():
        raise ConfigError(f"jzero.data.path: {root} is not a folder (the protein task reads dssp.json and "
                          "structures/*.pdb.gz from one)")
    seq_path, files = sequence_file(root), structure_files(root)
    found = {"sequences": load_sequences(seq_path), "structures": [load_structure(f) for f in files]}
    split = {}
    for kind, chains in found.items():
        split[kind] = {"heldout": [c for c in chains if heldout(c.pdb, cfg.heldout_fraction)]}
        split[kind]["train"] = [c for c in chains if not heldout(c.pdb, cfg.heldout_fraction)]
        for name, part in split[kind].items():
            if not part:
                raise ConfigError(f"jzero.data.heldout_fraction: {cfg.heldout_fraction} leaves no {name} {kind} "
                                  f"of {len(chains)} (the split is by a hash of the PDB id)")
    source = f"{seq_path} + {files[0].parent}" if root is None else str(root)
    return Proteins(split["sequences"], split["structures"], source)


def batch_crops(data: Proteins, seed: int, split: str, step: int, length: int, rows: range) -> list[Crop]:
    """Rows ``rows`` of the batch for ``(seed, split, step)``: each a random crop of a random
    structure (`STRUCTURE_SHARE` of rows) or sequence of the split."""
    rng = np.random.default_rng([seed, SPLITS[split], step])
    n = rows.stop
    is_structure = rng.random(n) < STRUCTURE_SHARE
    pick, offset = rng.random(n), rng.integers(0, 1 << 30, n)
    out = []
    for i in rows:
        pool = (data.structures if is_structure[i] else data.sequences)[split]
        chain = pool[int(pick[i] * len(pool))]
        out.append(crop(chain, length, int(offset[i] % max(1, len(chain.residues) - length + 1))))
    return out


def separation_prior(train: Iterable[Chain], length: int) -> np.ndarray:
    """``[length, 64]`` log-probabilities of each distogram bin given the separation ``|i - j|``
    alone, counted over the training structures' pairs (add-one smoothed): the model's prior
    (`jzero.models.evoformer.Evoformer`) and the baseline its held-out distogram stands next to."""
    counts = np.ones((length, DISTOGRAM_EDGES.size + 1))
    for chain in train:
        bins = distogram_bins(chain.coords)
        has = chain.has_coords[:, None] & chain.has_coords[None]
        for sep in range(1, min(length, len(bins))):
            d = np.diagonal(bins, sep)[np.diagonal(has, sep)]
            counts[sep] += np.bincount(d, minlength=counts.shape[1])
    return np.log(counts / counts.sum(-1, keepdims=True)).astype(np.float32)


def stack(crops: list[Crop], prior: np.ndarray) -> dict[str, np.ndarray]:
    """Crops as the model's batch arrays (`jzero.models.evoformer.batch_spec`), each row with
    the separation prior ``prior`` (`separation_prior`)."""
    return {"residues": np.stack([c.residues for c in crops]).astype(np.int32),
            "mask": np.stack([c.mask for c in crops]).astype(np.float32),
            "separation_prior": np.repeat(prior[None], len(crops), 0),
            "ss8": np.stack([c.ss8 for c in crops]).astype(np.int32),
            "distogram": np.stack([c.distogram for c in crops]).astype(np.int32)}


def global_batch(data: Proteins, seed: int, split: str, step: int, batch_size: int, length: int,
                 prior: np.ndarray, sharding: NamedSharding) -> dict:
    """The global batch as sharded arrays (this process builds only its rows)."""
    per = batch_size // jax.process_count()
    rows = range(jax.process_index() * per, (jax.process_index() + 1) * per)
    local = stack(batch_crops(data, seed, split, step, length, rows), prior)
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
            for k, v in local.items()}


def describe(data: Proteins) -> str:
    seqs, structs = data.sequences, data.structures
    return (f"proteins from {data.source}: {len(seqs['train']):,} train / {len(seqs['heldout']):,} held-out "
            f"chains with DSSP, {len(structs['train'])} / {len(structs['heldout'])} structures")

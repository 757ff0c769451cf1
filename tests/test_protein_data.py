"""The protein task's data (`jzero.tasks.protein`) and metrics (`jzero.tasks.protein_metrics`) on
the committed fixture (derived from sidechainnet 1.0.1 and MDAnalysisTests 2.11.0;
tests/data/protein/ATTRIBUTION.md): residue and DSSP encodings, the fixed split by PDB id, Cβ
distograms, crops with masks, deterministic batches, metrics against hand-computed values, and
one-line errors."""
import gzip
import json

import numpy as np
import pytest

from jzero.config import ConfigError, DataConfig
from jzero.tasks import protein, protein_metrics

from helpers import ROOT

FIXTURE = ROOT / "tests" / "data" / "protein"


@pytest.fixture(scope="module")
def data():
    return protein.load(DataConfig(path=str(FIXTURE), heldout_fraction=0.1))


def test_sequences_and_labels_are_encoded_in_af2_order():
    chains = protein.load_sequences(protein.sequence_file(FIXTURE))
    raw = json.loads((FIXTURE / "dssp.json").read_text())
    assert len(chains) == len(raw) == 300
    for chain in chains[:20]:
        seq, dssp = raw[chain.name]["Sequence"], raw[chain.name]["DSSP"]
        assert "".join((protein.RESIDUES + "X")[i] for i in chain.residues) == seq
        assert "".join(protein.DSSP8[i] for i in chain.ss8) == dssp.replace("L", "C")
        assert (protein.Q3_OF_Q8[chain.ss8] == 0).sum() == sum(c in "HGI" for c in dssp)
        assert (protein.Q3_OF_Q8[chain.ss8] == 1).sum() == sum(c in "EB" for c in dssp)


def test_the_split_is_by_pdb_id_and_fixed(data):
    train, held = data.sequences["train"], data.sequences["heldout"]
    assert 0.04 * 300 < len(held) < 0.2 * 300 and len(train) + len(held) == 300
    assert not {c.pdb for c in train} & {c.pdb for c in held}
    assert protein.heldout("1ABC", 0.1) == protein.heldout("1abc", 0.1)
    assert [len(data.structures[k]) for k in ("train", "heldout")] == [2, 1]


def test_structures_give_cb_distograms(data):
    chain = data.structures["train"][0]
    assert chain.coords.shape == (len(chain.residues), 3) and chain.has_coords.all()
    bins = protein.distogram_bins(chain.coords)
    assert bins.shape == (len(chain.residues),) * 2 and (np.diag(bins) == 0).all()
    assert bins.max() == 63 and np.array_equal(bins, bins.T)
    d = np.linalg.norm(chain.coords[0] - chain.coords[1])  # neighbours: 3.8 to 7 Å apart
    assert protein.DISTOGRAM_EDGES[bins[0, 1] - 1] < d <= protein.DISTOGRAM_EDGES[bins[0, 1]]


def test_crops_pad_with_a_mask_and_no_labels(data):
    chain = data.sequences["train"][0]
    n = len(chain.residues)
    short = protein.crop(chain, n + 5, 0)
    assert short.mask.sum() == n and (short.residues[n:] == protein.UNKNOWN).all()
    assert (short.ss8[n:] == -1).all() and (short.distogram == -1).all()  # a sequence has no coordinates
    window = protein.crop(chain, 8, 3)
    assert window.mask.all() and np.array_equal(window.residues, chain.residues[3:11])
    structure = protein.crop(data.structures["train"][0], 32, 5)
    assert (np.diag(structure.distogram) == -1).all() and (structure.ss8 == -1).all()
    assert (structure.distogram[~np.eye(32, dtype=bool)] >= 0).all()
    assert sum(w.mask.sum() for w in protein.windows(chain, 16)) == n


def test_batches_are_a_function_of_seed_split_and_step(data):
    prior = protein.separation_prior(data.structures["train"], 32)

    def rows(seed, split, step):
        return protein.stack(protein.batch_crops(data, seed, split, step, 32, range(16)), prior)

    a, b = rows(0, "train", 3), rows(0, "train", 3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["separation_prior"].shape == (16, 32, 64) and (a["separation_prior"] == prior).all()
    assert not np.array_equal(a["residues"], rows(0, "train", 4)["residues"])
    assert not np.array_equal(a["residues"], rows(1, "train", 3)["residues"])
    structures = (a["distogram"] >= 0).any((1, 2))
    assert structures.any() and (~structures).any()  # both kinds of example in a batch
    assert ((a["ss8"] >= 0).any(1) == ~structures).all()
    held = rows(0, "heldout", 3)
    chains = [c.residues.tobytes() for c in data.sequences["heldout"] + data.structures["heldout"]]
    for residues, mask in zip(held["residues"], held["mask"], strict=True):
        window = residues[mask > 0].astype(np.int8).tobytes()
        assert any(window in chain for chain in chains)  # every held-out row is a held-out chain's


def test_secondary_structure_metrics_and_majority():
    ss8 = np.array([[0, 3, 7, -1], [5, 0, 1, 4]])  # H E C - / T H G B
    logits = np.full((2, 4, 8), -5.0)
    for (i, j), k in {(0, 0): 1, (0, 1): 3, (0, 2): 6, (1, 0): 0, (1, 1): 0, (1, 2): 3, (1, 3): 4}.items():
        logits[i, j, k] = 5.0  # Q8 right at (0, 1), (1, 1), (1, 3); Q3 also at (0, 0), (0, 2)
    out = protein_metrics.secondary_structure(logits, ss8)
    assert out["q8_accuracy"] == pytest.approx(3 / 7) and out["q3_accuracy"] == pytest.approx(5 / 7)
    train = [protein.Chain("x", "X", np.zeros(5, np.int8), ss8=np.array([7, 7, 6, 0, 3], np.int8))]
    base = protein_metrics.majority(train, ss8)  # Q8 majority C (1 of 7), Q3 majority C (2 of 7)
    assert base == {"q8_majority": pytest.approx(1 / 7), "q3_majority": pytest.approx(2 / 7)}


def test_distogram_metrics_against_hand_computed_values():
    length = 30
    labels = np.full((1, length, length), 40, np.int64)
    labels[0, 0, 29] = labels[0, 1, 27] = 3  # two long-range contacts (|i - j| >= 24)
    labels[0, 2, 2] = -1
    logits = np.zeros((1, length, length, 64))
    logits[0, 0, 29, 0] = logits[0, 2, 28, 0] = 20.0  # predicted contacts: one right, one wrong
    out = protein_metrics.distogram(logits, labels)
    want = (2 * np.log(63 + np.exp(20.0)) + (length * length - 3) * np.log(64)) / (length * length - 1)
    assert out["distogram_loss"] == pytest.approx(want, rel=1e-6)
    # 21 long-range pairs; top 30 // 5 = 6: (0, 29) and (2, 28), then four of the tied rest in
    # order, (0, 24)..(0, 27); only (0, 29) is a contact ((1, 27) is one, but not ranked).
    assert out["contact_precision_l5"] == pytest.approx(1 / 6)
    assert protein_metrics.CONTACT_BINS == 19 and protein.DISTOGRAM_EDGES[18] < 8.0 < protein.DISTOGRAM_EDGES[19]


def test_separation_baseline_reads_the_training_pairs():
    coords = np.zeros((6, 3), np.float32)
    coords[:, 0] = np.arange(6) * 3.8  # a straight chain: separation s is 3.8 s Å
    chain = protein.Chain("s", "S", np.zeros(6, np.int8), coords=coords, has_coords=np.ones(6, bool))
    table = protein.separation_prior([chain], 6)
    assert table.shape == (6, 64) and np.allclose(np.exp(table).sum(1), 1)
    for sep in range(1, 6):
        assert table[sep].argmax() == np.searchsorted(protein.DISTOGRAM_EDGES, 3.8 * sep)
    labels = protein.crop(chain, 6, 0).distogram[None].astype(np.int64)
    base = protein_metrics.separation_baseline(table, labels)
    assert base["distogram_loss_separation"] == pytest.approx(protein_metrics.distogram(
        np.broadcast_to(table[np.abs(np.arange(6)[:, None] - np.arange(6))], (1, 6, 6, 64)), labels,
        log_probs=True)["distogram_loss"])


def test_bad_data_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"chain 1ABC_1_A: unknown residue letter 'J' at position 3"):
        protein.encode("MKJ", "dssp.json: chain 1ABC_1_A")
    (tmp_path / "dssp.json").write_text(json.dumps({"1ABC_1_A": {"Sequence": "MKV", "DSSP": "HH"}}))
    with pytest.raises(ConfigError, match="the same nonzero length"):
        protein.load_sequences(tmp_path / "dssp.json")
    empty = tmp_path / "0xyzA.pdb.gz"
    with gzip.open(empty, "wt") as f:
        f.write("HEADER    nothing\nEND\n")
    with pytest.raises(ConfigError, match="no ATOM records"):
        protein.load_structure(empty)
    with pytest.raises(ConfigError, match=r"no structures named like 1abcA.pdb.gz"):
        protein.structure_files(tmp_path)
    with pytest.raises(ConfigError, match=r"heldout_fraction: 0.0 leaves no heldout sequences"):
        protein.load(DataConfig(path=str(FIXTURE), heldout_fraction=0.0))
    monkeypatch.setattr(protein.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"not installed; .*pip install --no-deps sidechainnet==1.0.1 "
                                          r"MDAnalysisTests==2.11.0"):
        protein.load(DataConfig())

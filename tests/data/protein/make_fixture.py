"""Writes the protein fixture the tests read (no extra install at test time): 300 chains of at
most 200 residues from sidechainnet 1.0.1's DSSP annotations (from every 200th entry of the file,
in file order) as ``dssp.json``, and from MDAnalysisTests 2.11.0's DSSP test structures the two
smallest the split trains on and the smallest it holds out (``heldout_fraction`` 0.1) under
``structures/``. Needs ``pip install --no-deps sidechainnet==1.0.1 MDAnalysisTests==2.11.0``; run
from the repository root:

    python tests/data/protein/make_fixture.py
"""
import json
import shutil
from pathlib import Path

from jzero.tasks import protein

OUT = Path(__file__).resolve().parent
CHAINS, EVERY, MAX_LEN, HELDOUT = 300, 200, 200, 0.1


def main() -> None:
    with open(protein.sequence_file(None)) as f:
        entries = json.load(f)
    picked = {}
    for i, (name, entry) in enumerate(entries.items()):
        if i % EVERY == 0 and len(entry["Sequence"]) <= MAX_LEN:
            picked[name] = entry
        if len(picked) == CHAINS:
            break
    (OUT / "dssp.json").write_text(json.dumps(picked, indent=0) + "\n")
    sizes = sorted((len(protein.load_structure(p).residues), p.name, p) for p in protein.structure_files(None))
    train = [p for _, _, p in sizes if not protein.heldout(p.name[:4], HELDOUT)][:2]
    held = [p for _, _, p in sizes if protein.heldout(p.name[:4], HELDOUT)][:1]
    target = OUT / "structures"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    for path in train + held:
        shutil.copy(path, target / path.name)
    print(f"{len(picked)} chains; structures: train {[p.name for p in train]}, held out {[p.name for p in held]}")


if __name__ == "__main__":
    main()

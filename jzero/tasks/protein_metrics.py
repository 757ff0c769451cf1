"""Held-out metrics of the protein task and the baselines they stand next to, in numpy on the
model's logits: Q3 / Q8 accuracy of the secondary structure, the distogram's cross entropy over
labelled pairs, and the precision of the top L/5 long-range contacts. Baselines from the training
chains alone: the majority class per residue, and a distogram from sequence separation alone.

Contacts (CASP's definition): residues ``|i - j| >= 24`` apart whose Cβ are within 8 Å, read from
the distogram labels (bins up to 7.94 Å); a prediction's contact probability is the mass of those
bins. Precision is over each evaluated crop's top ``n / 5`` pairs (``n`` its residues), averaged over
the crops that have a long-range labelled pair.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jzero.tasks import protein

LONG_RANGE = 24
CONTACT_BINS = int(np.searchsorted(protein.DISTOGRAM_EDGES, 8.0))  # bins 0..18: up to 7.94 Å


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def q3_classes(ss_logits: np.ndarray) -> np.ndarray:
    """H / E / C (0 / 1 / 2) of Q8 logits: the argmax of the Q8 probabilities summed into three."""
    return (_softmax(ss_logits) @ np.eye(3)[protein.Q3_OF_Q8]).argmax(-1)


def secondary_structure(ss_logits: np.ndarray, ss8: np.ndarray) -> dict[str, float]:
    """Q8 and Q3 accuracy over labelled residues (Q3: `q3_classes`)."""
    valid = ss8 >= 0
    q8, q3 = ss_logits.argmax(-1), q3_classes(ss_logits)
    return {"q8_accuracy": float(np.mean(q8[valid] == ss8[valid])),
            "q3_accuracy": float(np.mean(q3[valid] == protein.Q3_OF_Q8[ss8[valid]]))}


def majority(train: Iterable[protein.Chain], ss8: np.ndarray) -> dict[str, float]:
    """The held-out accuracy (labels ``ss8``, -1: none) of always predicting the training
    chains' most frequent Q8 and Q3 class."""
    counts = np.bincount(np.concatenate([c.ss8 for c in train]), minlength=8)
    labels = ss8[ss8 >= 0]
    return {"q8_majority": float(np.mean(labels == counts.argmax())),
            "q3_majority": float(np.mean(protein.Q3_OF_Q8[labels] == np.bincount(protein.Q3_OF_Q8, counts).argmax()))}


def distogram(dist_logits: np.ndarray, labels: np.ndarray, log_probs: bool = False) -> dict[str, float]:
    """Mean cross entropy over labelled pairs and top-L/5 long-range contact precision of
    ``dist_logits`` ``[n, L, L, 64]`` (or log-probabilities) against bins ``labels`` (-1: none)."""
    logp = dist_logits if log_probs else _log_softmax(dist_logits)
    valid = labels >= 0
    picked = np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
    contact = np.exp(logp[..., :CONTACT_BINS]).sum(-1)
    return {"distogram_loss": float(-picked[valid].mean()),
            "contact_precision_l5": _contact_precision(contact, labels)}


def _contact_precision(contact: np.ndarray, labels: np.ndarray) -> float:
    """Mean over crops of the top ``n // 5`` long-range labelled pairs' true-contact fraction."""
    length = labels.shape[-1]
    i, j = np.triu_indices(length, LONG_RANGE)
    scores = []
    for prob, label in zip(contact, labels, strict=True):
        ok = label[i, j] >= 0
        if not ok.any():
            continue
        n = int((label >= 0).any(-1).sum())  # residues with a labelled pair
        top = np.argsort(-prob[i, j][ok], kind="stable")[:max(1, n // 5)]
        scores.append(np.mean(label[i, j][ok][top] < CONTACT_BINS))
    return float(np.mean(scores)) if scores else float("nan")


def separation_baseline(table: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """`distogram` of the separation-only prediction ``table`` (`protein.separation_prior`) on
    crops ``labels`` ``[n, L, L]``."""
    length = labels.shape[-1]
    sep = np.abs(np.arange(length)[:, None] - np.arange(length)[None])
    logp = np.broadcast_to(table[sep], (*labels.shape, table.shape[-1]))
    out = distogram(logp, labels, log_probs=True)
    return {f"{k}_separation": v for k, v in out.items()}

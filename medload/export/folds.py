"""Cross-validation folds by patient: every case of a patient lands in one fold, the same seed gives the
same folds, and folds hold about equal numbers of cases.

The folds are written as nnU-Net v2's ``splits_final.json``: one ``{"train": [...], "val": [...]}`` per
fold, case identifiers without the channel suffix (nnU-Net's documentation, "manual data splits").

Example:
    >>> folds = patient_folds(["p1", "p1", "p2", "p3", "p4"], folds=2, seed=0)
    >>> folds[0] == folds[1]          # p1's two cases share a fold
    True
    >>> sorted(folds.count(f) for f in range(2))
    [2, 3]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from medload.errors import ConfigError

__all__ = ["patient_folds", "nnunet_splits"]


def patient_folds(patients: Sequence[str], folds: int, seed: int = 0) -> list[int]:
    """The fold (0 .. ``folds`` - 1) of each case, given each case's patient.

    Patients are drawn in an order from ``seed`` (over their sorted names, so the input order does not
    matter), the patients with most cases first, and each goes to the fold with the fewest cases so far
    (the lowest-numbered among equals). A patient is never in two folds.

    Raises:
        ConfigError: fewer than two folds, or fewer patients than folds (a fold would be empty).
    """
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ConfigError(f"folds must be an integer >= 2 (nnU-Net trains one model per fold), got {folds!r}")
    cases = Counter(patients)
    if len(cases) < folds:
        raise ConfigError(f"{len(cases)} patient(s) cannot fill {folds} folds without splitting a patient: "
                          f"lower --folds to at most {len(cases)}, or export more patients")
    drawn = np.random.default_rng(seed).permutation(sorted(cases)).tolist()
    drawn.sort(key=lambda p: -cases[p])  # stable: the seeded order among patients with as many cases
    load = [0] * folds
    fold_of: dict[str, int] = {}
    for patient in drawn:
        fold = load.index(min(load))
        fold_of[patient] = fold
        load[fold] += cases[patient]
    return [fold_of[p] for p in patients]


def nnunet_splits(case_ids: Sequence[str], folds_of_cases: Sequence[int]) -> list[dict[str, list[str]]]:
    """``splits_final.json`` content: fold f validates on its own cases and trains on all the others."""
    n = max(folds_of_cases) + 1
    return [{"train": sorted(c for c, g in zip(case_ids, folds_of_cases) if g != f),
             "val": sorted(c for c, g in zip(case_ids, folds_of_cases) if g == f)} for f in range(n)]

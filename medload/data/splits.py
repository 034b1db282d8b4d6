"""Patient-level train/validation splits of a dataset's series: no patient on both sides.

Examples:
    >>> import numpy as np
    >>> from medload.data.index import SampleIndex
    >>> index = SampleIndex(("a", "b", "c"), np.array([0, 1, 2]), np.zeros(3, np.int32), np.array([0, 0, 1]))
    >>> sorted(map(len, split_patients(index, val_fraction=0.5, seed=0)))   # patient 0 has series a and b
    [1, 2]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from medload.data.index import SampleIndex
from medload.data.loader_types import LoaderDataset
from medload.data.samplers import _rng
from medload.errors import ConfigError

__all__ = ["PatientSplit", "split_patients"]

_SPLIT_STREAM = 8  # rng stream of the validation patients (apart from the samplers' streams)


class PatientSplit(NamedTuple):
    """Series keys of the training and the validation set (each in the order of the dataset's index)."""

    train: tuple[str, ...]
    val: tuple[str, ...]


def split_patients(data: SampleIndex | LoaderDataset, val_fraction: float,
                   seed: int = 0) -> PatientSplit:
    """Split a dataset's (a SliceDataset, SlabDataset or its SampleIndex) series by patient: ``round(val_fraction * patients)`` patients (at least one where
    ``val_fraction > 0``), drawn from ``seed``, give the validation series, the others the training ones.

    A patient's series all land on one side; the same dataset and seed give the same split. The fraction
    is of patients, not samples. Series without samples are in neither set.

    Examples:
        >>> split = split_patients(SliceDataset(store), val_fraction=0.2, seed=1)  # doctest: +SKIP
        >>> train, val = SliceDataset(store, keys=split.train), SliceDataset(store, keys=split.val)  # doctest: +SKIP
    """
    index = getattr(data, "index", data)
    if not isinstance(index, SampleIndex):
        raise ConfigError(f"split_patients takes a SliceDataset, SlabDataset or SampleIndex, got {type(data).__name__}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction is a fraction of the patients in [0, 1), got {val_fraction!r}")
    patients = np.unique(index.patients)
    n_val = max(1, round(val_fraction * patients.size)) if val_fraction > 0 else 0
    if n_val >= patients.size and n_val:
        raise ConfigError(f"val_fraction={val_fraction} of {patients.size} patient(s) leaves none to train on: "
                          "a patient-level split needs at least two patients (or pass val_fraction=0)")
    val_patients = _rng(seed, 0, _SPLIT_STREAM).permutation(patients)[:n_val]
    first = np.unique(index.series, return_index=True)[1]  # a sample of each series that has one
    series, owner = index.series[first], index.patients[first]
    in_val = np.isin(owner, val_patients)
    return PatientSplit(tuple(index.keys[s] for s in series[~in_val].tolist()),
                        tuple(index.keys[s] for s in series[in_val].tolist()))

"""The sample index of a dataset: flat numpy arrays, never a list of Python objects.

DataLoader workers forked from the training process read the index on every item; Python objects
there would have their reference counts touched, their pages copied, and every worker's memory
would grow over an epoch (the "copy-on-read" problem). Numpy arrays are read without writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from medload.storage.records import SeriesRecord
from medload.storage.selection import _key_prefixes, select_series, slab_starts  # noqa: F401  (re-exported)

__all__ = ["SampleIndex", "select_series", "slice_index", "slab_index"]


@dataclass(frozen=True)
class SampleIndex:
    """Which samples a dataset has: sample ``i`` is slice (or first slice) ``z[i]`` of series
    ``keys[series[i]]``, of patient ``patients[i]`` (an integer id per patient pseudonym)."""

    keys: tuple[str, ...]
    series: np.ndarray    # int32 (N,)
    z: np.ndarray         # int32 (N,)
    patients: np.ndarray  # int32 (N,)

    def __len__(self) -> int:
        return len(self.series)


def _index(records: Sequence[SeriesRecord], counts: Sequence[int], starts: Sequence[np.ndarray]) -> SampleIndex:
    patient_ids = {p: i for i, p in enumerate(sorted({r.patient for r in records}))}
    series = np.repeat(np.arange(len(records), dtype=np.int32), counts)
    z = np.concatenate(starts).astype(np.int32) if starts else np.zeros(0, np.int32)
    patients = np.repeat(np.array([patient_ids[r.patient] for r in records], dtype=np.int32), counts)
    return SampleIndex(tuple(r.key for r in records), series, z, patients)


def slice_index(records: Sequence[SeriesRecord]) -> SampleIndex:
    """One sample per slice of every series (2.5D: the centre slice)."""
    counts = [r.shape[0] for r in records]
    return _index(records, counts, [np.arange(n) for n in counts])


def slab_index(records: Sequence[SeriesRecord], depth: int, stride: int) -> SampleIndex:
    """Slabs of ``depth`` consecutive slices every ``stride`` slices (where they start:
    :func:`~medload.storage.selection.slab_starts`)."""
    starts = slab_starts(records, depth, stride)
    return _index(records, [len(s) for s in starts], starts)

"""The sample index of a dataset: flat numpy arrays, never a list of Python objects.

DataLoader workers forked from the training process read the index on every item; Python objects
there would have their reference counts touched, their pages copied, and every worker's memory
would grow over an epoch (the "copy-on-read" problem). Numpy arrays are read without writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from medload.errors import ConfigError
from medload.storage.records import SeriesRecord

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


def select_series(records: Iterable[SeriesRecord], *, modality: str | Sequence[str] | None = None,
                  kernel: str | Sequence[str] | None = None, thickness: tuple[float, float] | None = None,
                  keys: str | Iterable[str] | None = None) -> list[SeriesRecord]:
    """Records matching every given filter: modality, convolution kernel (exact names), slice
    thickness range in mm (inclusive; series without SliceThickness are excluded), series keys or
    key prefixes (one string, any iterable of them such as a catalog's ``key`` column, or a catalog
    frame itself: its ``key`` column is used)."""
    def one_of(value: str | None, allowed) -> bool:
        return allowed is None or value in ({allowed} if isinstance(allowed, str) else set(allowed))

    if keys is not None:
        keys = _key_prefixes(keys)
    out = []
    for rec in records:
        if not one_of(rec.modality, modality) or not one_of(rec.kernel, kernel):
            continue
        if thickness is not None and (rec.slice_thickness is None
                                      or not thickness[0] <= rec.slice_thickness <= thickness[1]):
            continue
        if keys is not None and not rec.key.startswith(keys):
            continue
        out.append(rec)
    return out


def _key_prefixes(keys) -> tuple[str, ...]:
    """Key filter values as a tuple for ``str.startswith`` (a lone string is one key, not its letters)."""
    if hasattr(keys, "columns"):  # a DataFrame, e.g. a filtered Store.catalog(): iterating it gives column names
        if "key" not in keys.columns:
            raise ConfigError("a frame given as keys needs a 'key' column: pass store.catalog() rows or their .key")
        keys = keys["key"]
    if isinstance(keys, (str, bytes)):
        keys = [keys]
    return tuple(k.hex() if isinstance(k, bytes) else str(k).lower() for k in keys)


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
    """Slabs of ``depth`` consecutive slices every ``stride`` slices; the last slab of a series is moved
    back to end at its last slice, so every slice is covered. Series thinner than ``depth`` have none."""
    if depth < 1 or stride < 1:
        raise ConfigError(f"slab depth and stride must be >= 1, got depth={depth}, stride={stride}")
    starts = []
    for r in records:
        d = r.shape[0]
        if d < depth:
            starts.append(np.zeros(0, np.int64))
            continue
        s = np.arange(0, d - depth + 1, stride)
        if s[-1] != d - depth:
            s = np.append(s, d - depth)
        starts.append(s)
    return _index(records, [len(s) for s in starts], starts)

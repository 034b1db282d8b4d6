"""Which series a dataset (or :meth:`Store.items`) takes, and where its 3D slabs start.

The filters and the slab rule live here, below the data package, so that the datasets and the MONAI
route (:meth:`~medload.storage.store.Store.items`) list the same samples without the store importing
torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import numpy as np

from medload.errors import ConfigError
from medload.storage.records import SeriesRecord

__all__ = ["thick_enough", "select_series", "slab_starts"]


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


def slab_starts(records: Sequence[SeriesRecord], depth: int, stride: int) -> list[np.ndarray]:
    """Per series, the first slices of its slabs of ``depth`` slices every ``stride`` slices; the last
    slab is moved back to end at the series' last slice, so every slice is covered. A series thinner
    than ``depth`` has none."""
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
    return starts


def thick_enough(records: Sequence[SeriesRecord], depth: int) -> list[SeriesRecord]:
    """The series with at least ``depth`` slices (the others give no slab): a warning names how many were
    left out, and a ConfigError says when none is left."""
    thin = [r for r in records if r.shape[0] < depth]
    if records and len(thin) == len(records):
        raise ConfigError(f"every selected series has fewer than depth={depth} slices (the thickest has "
                          f"{max(r.shape[0] for r in records)}): lower depth")
    if thin:
        warnings.warn(f"{len(thin)} of {len(records)} series have fewer than depth={depth} slices and give no "
                      f"samples (thinnest: {min(r.shape[0] for r in thin)}): filter them out (keys=...) or "
                      "lower depth", UserWarning, stacklevel=3)
    return [r for r in records if r.shape[0] >= depth]


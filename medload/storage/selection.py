"""Which series a dataset (or :meth:`Store.items`) takes, and where its 3D slabs start.

The filters and the slab rule live here, below the data package, so that the datasets and the MONAI
route (:meth:`~medload.storage.store.Store.items`) list the same samples without the store importing
torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from medload.errors import ConfigError
from medload.storage.orientation import ORIENTATIONS, series_orientation
from medload.storage.records import SeriesRecord

#: a filter's value: one name, or several
Names = str | Iterable[str]

__all__ = ["thick_enough", "select_series", "require_series", "explain_filters", "slab_starts"]


def select_series(records: Iterable[SeriesRecord], *, modality: str | Sequence[str] | None = None,
                  kernel: str | Sequence[str] | None = None, thickness: tuple[float, float] | None = None,
                  keys: str | Iterable[str] | None = None,
                  orientation: str | Sequence[str] | None = None) -> list[SeriesRecord]:
    """Records matching every given filter: modality (any case: ``"ct"`` is ``"CT"``), convolution kernel
    (exact names), slice thickness range in mm (inclusive; series without SliceThickness are excluded),
    series keys or key prefixes (one string, any iterable of them such as a catalog's ``key`` column, or
    a catalog frame itself: its ``key`` column is used), orientation (``"axial"``, ``"coronal"``,
    ``"sagittal"``, ``"oblique"``: :mod:`medload.storage.orientation`)."""
    tests = [test for _, test in _filters(modality, kernel, thickness, keys, orientation)]
    return [rec for rec in records if all(test(rec) for test in tests)]


def require_series(records: Iterable[SeriesRecord], where: str, **filters: Any) -> list[SeriesRecord]:
    """:func:`select_series`, and where no series is left a ConfigError that says, filter by filter, how
    many series each one matched and what the store holds (``where``: the store, for the message)."""
    records = list(records)
    chosen = select_series(records, **filters)
    if not chosen:
        raise ConfigError(f"no series of {where} match the filters: {explain_filters(records, **filters)}; "
                          f"check them with `medload ls {where}` or store.catalog()")
    return chosen


def explain_filters(records: Sequence[SeriesRecord], *, modality: Names | None = None, kernel: Names | None = None,
                    thickness: Sequence[float] | None = None, keys: Any = None, orientation: Names | None = None) -> str:
    """What each given filter matches on its own, e.g. ``"modality='MR' matched 0 of 9 (stored modalities:
    CT); thickness=(0.5, 3.0) matched 0 of 9 (stored thicknesses: 5.0 mm)"``."""
    if not records:
        return "the store holds no series"
    stored = {"modality": lambda r: r.modality, "kernel": lambda r: r.kernel,
              "thickness": lambda r: r.slice_thickness, "orientation": series_orientation}
    given = {"modality": modality, "kernel": kernel, "thickness": thickness, "orientation": orientation}
    parts, each_matches = [], True
    for name, test in _filters(modality, kernel, thickness, keys, orientation):
        n = sum(test(r) for r in records)
        each_matches &= n > 0
        value = (f"keys ({len(_key_prefixes(keys))} key(s) or prefixes)" if name == "keys"
                 else f"{name}={given[name]!r}")
        held = "" if name == "keys" else f" (stored {_values([stored[name](r) for r in records], name)})"
        parts.append(f"{value} matched {n} of {len(records)}{held}")
    if not parts:
        return f"no filter given, and none of its {len(records)} series is left"
    if each_matches and len(parts) > 1:
        parts.append("each matches some series, but no series matches all of them")
    return "; ".join(parts)


def _values(values: list, name: str) -> str:
    """The distinct stored values of a field, for a message (the smallest and largest where there are many)."""
    known = sorted({v for v in values if v is not None})
    shown = ", ".join(map(str, known)) if len(known) <= 6 else f"{len(known)} values, {known[0]} to {known[-1]}"
    unit = " mm" if name == "thickness" and known else ""
    missing = " and none" if known and None in values else ""
    return f"{_PLURAL[name]}: {shown or 'none'}{unit}{missing}"


_PLURAL = {"modality": "modalities", "kernel": "kernels", "thickness": "thicknesses", "orientation": "orientations"}


def _filters(modality: Names | None, kernel: Names | None, thickness: Sequence[float] | None, keys: Any,
             orientation: Names | None) -> list[tuple[str, Callable[[SeriesRecord], bool]]]:
    """(name, predicate) of each filter given; the values checked once, here."""
    def names(value: Names) -> set[str]:
        return {value} if isinstance(value, str) else set(value)

    out: list[tuple[str, Callable[[SeriesRecord], bool]]] = []
    if modality is not None:
        wanted = {m.upper() for m in names(modality)}
        out.append(("modality", lambda r: (r.modality or "").upper() in wanted))
    if kernel is not None:
        kernels = names(kernel)
        out.append(("kernel", lambda r: r.kernel in kernels))
    if thickness is not None:
        if len(thickness) != 2 or not thickness[0] <= thickness[1]:
            raise ConfigError(f"thickness is a range (lowest, highest) in mm, got {thickness!r}")
        lo, hi = float(thickness[0]), float(thickness[1])
        out.append(("thickness", lambda r: r.slice_thickness is not None and lo <= r.slice_thickness <= hi))
    if keys is not None:
        prefixes = _key_prefixes(keys)
        out.append(("keys", lambda r: r.key.startswith(prefixes)))
    if orientation is not None:
        planes = {o.lower() for o in names(orientation)}
        if unknown := sorted(planes - set(ORIENTATIONS)):
            raise ConfigError(f"orientation {', '.join(map(repr, unknown))}: choose from {', '.join(ORIENTATIONS)}")
        out.append(("orientation", lambda r: series_orientation(r) in planes))
    return out


def _key_prefixes(keys: Any) -> tuple[str, ...]:  # keys: str, an iterable of str, or a frame with a 'key' column
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


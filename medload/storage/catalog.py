"""The series of a store as a pandas DataFrame (:meth:`medload.Store.catalog`), for filtering in notebooks.

One row per series, one column per field in :data:`COLUMNS`. Numbers are plain columns (``slices``,
``rows``, ``columns``, ``spacing_x/y/z`` in mm along column, row and slice), so ``DataFrame.query``
works on them; ``label_classes``, ``windows`` and ``flags`` are tuples of names. ``split``,
``time_series`` and ``time_point`` say which stack of a split series a row is (see
:class:`~medload.storage.records.SeriesRecord`): ``cat.query("time_series == @ts").sort_values("time_point")``
lists the time points of one time series in order. Filter names follow
the dataset filters (``modality``, ``kernel``, ``slice_thickness``), and a filtered frame's ``key``
column feeds a dataset directly.

Examples:
    >>> cat = store.catalog()
    >>> thick = cat.query("kernel == 'UB' and slice_thickness >= 5")
    >>> len(SliceDataset(store, context=1, keys=thick.key))   # only those series: the sample's 28 slices
    28
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

    from medload.storage.store import Store

__all__ = ["COLUMNS", "catalog"]

COLUMNS = ("key", "patient", "study", "modality", "body_part", "manufacturer", "model", "kernel", "slice_thickness",
           "slices", "rows", "columns", "spacing_x", "spacing_y", "spacing_z", "dtype", "labelled", "label_classes",
           "windows", "flags", "split", "time_series", "time_point", "shard")
"""Catalog columns, in order. ``patient`` and ``study`` are keyed pseudonyms, never DICOM identifiers."""


def catalog(store: Store) -> pd.DataFrame:
    """One row per series of ``store`` (see :data:`COLUMNS`), sorted by key."""
    import pandas as pd

    rows = []
    for rec in store.series():
        label = store.labels(rec.key_bytes)
        classes = () if label is None else tuple(label.classes[c] for c in sorted(label.classes, key=int))
        rows.append((rec.key, rec.patient, rec.study, rec.modality, rec.body_part, rec.manufacturer, rec.model,
                     rec.kernel, rec.slice_thickness, *rec.shape, *rec.spacing, rec.dtype, label is not None,
                     classes, rec.windows, rec.flags, rec.split, rec.time_series, rec.time_point, rec.shard))
    frame = pd.DataFrame.from_records(rows, columns=list(COLUMNS))
    return frame.astype({"slices": "int64", "rows": "int64", "columns": "int64", "slice_thickness": "float64",
                         "spacing_x": "float64", "spacing_y": "float64", "spacing_z": "float64", "labelled": "bool",
                         "time_point": "int64"})

"""The series of a store as a pandas DataFrame (:meth:`medload.Store.catalog`), for filtering in notebooks.

One row per series, one column per field in :data:`COLUMNS`. Numbers are plain columns (``slices``,
``rows``, ``columns``, ``spacing_x/y/z`` in mm along column, row and slice), so ``DataFrame.query``
works on them; ``label_classes``, ``windows`` and ``flags`` are tuples of names; ``label_kept`` is the
fraction of the label's foreground that lies inside the series (below 1.0: the label was cut by the
series' extent, see ``LabelRecord.kept``; missing without a label, or for a label stored before medload
measured it), so ``cat.query("label_kept < 1")`` lists the cut labels. ``orientation`` is the
plane the slices were cut in, ``axial``, ``coronal``, ``sagittal`` or ``oblique`` (the slice normal more
than 10 degrees off every patient axis: :mod:`medload.storage.orientation`). ``split``,
``time_series`` and ``time_point`` say which stack of a split series a row is (see
:class:`~medload.storage.records.SeriesRecord`): ``cat.query("time_series == @ts").sort_values("time_point")``
lists the time points of one time series in order. Filter names follow
the dataset filters (``modality``, ``kernel``, ``slice_thickness``, ``orientation``), and a filtered frame's ``key``
column feeds a dataset directly. A series in a shard that cannot be read has a row with its key, its
shard and, in ``unavailable``, why (empty otherwise); its other fields are missing (``<NA>``).

Examples:
    >>> cat = store.catalog()
    >>> thick = cat.query("kernel == 'UB' and slice_thickness >= 5")
    >>> len(SliceDataset(store, context=1, keys=thick.key))   # only those series: the sample's 28 slices
    28
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from medload.extras import require
from medload.storage.orientation import series_orientation

if TYPE_CHECKING:
    import pandas as pd

    from medload.storage.store import Store

__all__ = ["COLUMNS", "catalog"]

COLUMNS = ("key", "patient", "study", "modality", "body_part", "manufacturer", "model", "kernel", "slice_thickness",
           "slices", "rows", "columns", "spacing_x", "spacing_y", "spacing_z", "orientation", "dtype", "labelled",
           "label_classes", "label_kept", "windows", "flags", "split", "time_series", "time_point", "shard",
           "unavailable")
"""Catalog columns, in order. ``patient`` and ``study`` are keyed pseudonyms, never DICOM identifiers."""


def catalog(store: Store) -> pd.DataFrame:
    """One row per series of ``store`` (see :data:`COLUMNS`), sorted by key."""
    require("pandas", "viz", "Store.catalog() (a pandas DataFrame)")
    import pandas as pd

    rows: list[tuple[object, ...]] = []  # a lost series' row has None for what only its record knows
    down = store.unavailable()
    lost_labels = {key: u for u in down for key in u.labels or ()}
    for rec in store.series():
        label = store.labels(rec.key_bytes) if rec.key not in lost_labels else None
        classes = () if label is None else tuple(label.classes[c] for c in sorted(label.classes, key=int))
        why = f"its labels are in shard {lost_labels[rec.key].shard}, which cannot be read" if rec.key in lost_labels else ""
        rows.append((rec.key, rec.patient, rec.study, rec.modality, rec.body_part, rec.manufacturer, rec.model,
                     rec.kernel, rec.slice_thickness, *rec.shape, *rec.spacing, series_orientation(rec), rec.dtype,
                     label is not None or rec.key in lost_labels, classes, None if label is None else label.kept,
                     rec.windows, rec.flags, rec.split,
                     rec.time_series, rec.time_point, rec.shard, why))
    lost = [(key, u) for u in down for key in u.series or ()]
    for key, u in lost:
        rows.append((key, *[None] * (len(COLUMNS) - 3), u.shard, f"shard {u.shard} cannot be read: {u.reason}"))
    frame = pd.DataFrame.from_records(rows, columns=list(COLUMNS)).sort_values("key", ignore_index=True)
    whole, real = ("int64", "float64") if not lost else ("Int64", "Float64")  # nullable where rows lack values
    return frame.astype({"slices": whole, "rows": whole, "columns": whole, "slice_thickness": real, "spacing_x": real,
                         "spacing_y": real, "spacing_z": real, "label_kept": real, "labelled": "bool" if not lost else "boolean",
                         "time_point": whole})

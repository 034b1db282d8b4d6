"""A small real store with labels, for tests of samplers and training: several patients (the first with two
series, so a split has a patient to keep together), a non-square matrix, an RTSTRUCT square on some slices."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from medload.config import IngestConfig
from medload.ingest import ingest
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

ROWS, COLS = 32, 40
SQUARE = np.array([[9.5, 7.5], [20.5, 7.5], [20.5, 15.5], [9.5, 15.5]])  # (column, row) index corners


def make_labelled_store(root: Path, patients: int = 5, slices: int = 6) -> Path:
    """Ingest ``patients`` synthetic patients of ``slices`` slices (ROWS x COLS) with labels into ``root/store``;
    patient p's label covers slices ``1 + p % 3`` to ``slices - 2``, so some slices have no foreground."""
    for p in range(patients):
        for s in range(1 + (p == 0)):
            folder = root / "src" / f"p{p}s{s}"
            gen = make_series(folder, SeriesSpec(n_slices=slices, rows=ROWS, cols=COLS), seed=40 + 10 * p + s,
                              patient_id=f"LIT-{p}", series_number=s + 1)
            make_rtstruct(gen, {"Liver": [(z, [SQUARE]) for z in range(1 + p % 3, slices - 1)]},
                          folder / "rtstruct.dcm")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


SPLEEN = np.array([[24.5, 18.5], [34.5, 18.5], [34.5, 27.5], [24.5, 27.5]])  # apart from SQUARE
LIVER_ONLY, LIVER_AND_SPLEEN, UNLABELLED = range(4), range(4, 6), range(6, 9)


def make_partly_labelled_store(root: Path, slices: int = 6) -> Path:
    """A store as a hospital's: 9 patients of one series each, 6 labelled. Patients 0-3 have an RTSTRUCT with
    'Liver' (label value 1, SQUARE on slices 1 to ``slices - 2``); 4 and 5 one with 'Spleen' first (value 1,
    SPLEEN on slices 2 to ``slices - 2``) and 'Liver' second (value 2), so value 1 means two classes; 6-8
    have no labels."""
    for p in range(9):
        folder = root / "src" / f"p{p}"
        gen = make_series(folder, SeriesSpec(n_slices=slices, rows=ROWS, cols=COLS), seed=70 + p,
                          patient_id=f"PART-{p}")
        liver = [(z, [SQUARE]) for z in range(1, slices - 1)]
        if p in LIVER_ONLY:
            make_rtstruct(gen, {"Liver": liver}, folder / "rtstruct.dcm")
        elif p in LIVER_AND_SPLEEN:
            make_rtstruct(gen, {"Spleen": [(z, [SPLEEN]) for z in range(2, slices - 1)], "Liver": liver},
                          folder / "rtstruct.dcm")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"

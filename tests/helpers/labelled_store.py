"""A small real store with labels, for tests of samplers and training: several patients (the first with two
series, so a split has a patient to keep together), a non-square matrix, an RTSTRUCT square on some slices."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from medload.config import IngestConfig
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

PHILIPS_DICOM = Path(__file__).resolve().parents[2] / "sample_data" / "philips_ct_head" / "dicom"

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


def add_bone_mask(store: Path, masks: Path, dicom: Path = PHILIPS_DICOM) -> None:
    """Label the series of ``dicom`` in ``store`` with a bone mask (voxels above 300 HU, the demo target) as a
    NIfTI named by its key prefix in ``masks``, ingested with ``--labels``."""
    ingest(dicom, store, config=IngestConfig(workers=1))
    (rec,) = [r for r in open_store(store).series() if r.manufacturer == "Philips"]
    bone = (open_store(store).read(rec.key) > 300).astype(np.uint8)
    masks.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(bone.transpose(2, 1, 0), np.asarray(rec.affine)), masks / f"{rec.key[:12]}.nii.gz")
    ingest(dicom, store, config=IngestConfig(workers=1), labels=[masks])


def make_liver_bone_store(root: Path) -> Path:
    """The store of docs/nnunet.md's worked example, ``root/store``: six synthetic series of five patients with
    an RTSTRUCT "Liver" (the first patient has two), a sheared series with one too, an unlabelled series, and
    the sample study with a bone mask (> 300 HU) as NIfTI."""
    path = make_labelled_store(root)
    tilted = make_series(root / "more" / "tilted", SeriesSpec(n_slices=6, rows=32, cols=40, tilt_deg=12), seed=90,
                         patient_id="LIT-TILT")
    make_rtstruct(tilted, {"Liver": [(z, [SQUARE]) for z in range(1, 5)]}, root / "more" / "tilted" / "rt.dcm")
    make_series(root / "more" / "plain", SeriesSpec(n_slices=6, rows=32, cols=40), seed=91, patient_id="LIT-NOLABEL")
    ingest(root / "more", path, config=IngestConfig(workers=1, tilt_policy="shear"))
    add_bone_mask(path, root / "masks")
    return path


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

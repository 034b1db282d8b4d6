"""Stores for the 3D patch tests: series whose geometry a patch has to undo -- oblique, anisotropic,
feet-first, sagittal, gantry-tilted (kept sheared) -- each with a two-class label from its own HU."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np

from medload.config import IngestConfig
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

#: name: (spec, seed). Pixel spacings (row, column) and slice spacings all differ, so no grid is another's.
SERIES = {
    "oblique": (SeriesSpec(n_slices=14, rows=40, cols=36, pixel_spacing=(0.7, 0.8), slice_spacing=2.5,
                           orientation="oblique"), 11),
    "feet-first": (SeriesSpec(n_slices=12, rows=36, cols=40, pixel_spacing=(0.9, 0.6), slice_spacing=3.0,
                              orientation=(-1.0, 0.0, 0.0, 0.0, 1.0, 0.0)), 12),
    "sagittal": (SeriesSpec(n_slices=16, rows=40, cols=32, pixel_spacing=(0.75, 0.85), slice_spacing=1.9,
                            orientation=(0.0, 1.0, 0.0, 0.0, 0.0, -1.0)), 13),
    "tilted": (SeriesSpec(n_slices=12, rows=32, cols=40, pixel_spacing=(0.65, 0.95), slice_spacing=2.2,
                          tilt_deg=14.0), 14),
}
SPINE, LUNG = 1, 2


def two_classes(hu: np.ndarray) -> np.ndarray:
    """The label of a phantom: 1 (spine) above 300 HU, 2 (lung) between -950 and -700 HU, else 0."""
    return np.where(hu > 300, SPINE, np.where((hu > -950) & (hu < -700), LUNG, 0)).astype(np.uint8)


def label_from_image(store: Path, masks: Path, src: Path, rule=two_classes) -> None:
    """Label every series of ``store`` with ``rule`` of its stored HU (a NIfTI on its grid, named by its
    key prefix) and ingest ``src`` again with those labels."""
    masks.mkdir(parents=True, exist_ok=True)
    opened = open_store(store)
    for rec in opened.series():
        label = rule(opened.read(rec.key))
        nib.save(nib.Nifti1Image(label.transpose(2, 1, 0), np.asarray(rec.affine)), masks / f"{rec.key[:12]}.nii.gz")
    ingest(src, store, config=IngestConfig(workers=1, tilt_policy="shear"), labels=[masks])


def make_patch_store(root: Path) -> Path:
    """``root/store`` holding :data:`SERIES` (one patient each), labelled by :func:`two_classes`."""
    for p, (name, (spec, seed)) in enumerate(SERIES.items()):
        make_series(root / "src" / name, spec, seed=seed, patient_id=f"PATCH-{p}")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, tilt_policy="shear"))
    label_from_image(root / "store", root / "masks", root / "src")
    return root / "store"

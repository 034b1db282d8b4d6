"""Three patients' series and NIfTI masks that fit them wholly, hardly, or in part, for tests of the
label fit rule (``IngestConfig.label_min_kept``) and of label source names.

Patient 5's series lies 8 slices further along z than patient 4's. Patient 4's mask (a block on its slices
1-8) fits patient 4's series whole; mapped to patient 5's series by mistake (a copy-paste slip in a map.csv),
only its slice 8 -- 1 of its 8 foreground slices, 12.5% -- lies inside. Patient 6's mask is its own but one
slice too low: 4 of its 5 foreground slices (80%) lie inside, and its slice 0 is cut off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from medload.synthetic import GeneratedSeries, SeriesSpec, make_series

SLICES, ROWS, COLS = 10, 24, 32
BLOCK = (slice(8, 13), slice(10, 18))  # rows 8..12, columns 10..17: 40 voxels a slice
SPACING = 2.5  # mm between slices
ORIGIN = {4: (-20.0, -15.0, 30.0), 5: (-20.0, -15.0, 30.0 + 8 * SPACING), 6: (50.0, 40.0, -100.0)}


@dataclass
class Misfits:
    """The sources (``src``, one folder per patient) and each patient's series."""

    src: Path
    series: dict[int, GeneratedSeries]

    def own_mask(self, patient: int) -> tuple[np.ndarray, np.ndarray]:
        """``(labels (z, y, x), RAS affine)`` of the mask drawn for ``patient``: patient 4's on slices 1-8
        of its grid, patient 6's on slices 0-4 of a grid one slice below its series."""
        gen = self.series[patient]
        data = np.zeros((SLICES, ROWS, COLS), np.uint8)
        affine = np.asarray(gen.affine_ras, float)
        if patient == 6:
            data[(slice(0, 5), *BLOCK)] = 1
            affine = affine @ _slice_shift(-1)
        else:
            data[(slice(1, 9), *BLOCK)] = 1
        return data, affine

    def expected_on(self, patient: int) -> np.ndarray:
        """The label map the mask kept for ``patient`` gives on its series (patient 6: slices 0-3)."""
        out = np.zeros((SLICES, ROWS, COLS), np.uint8)
        out[(slice(0, 4) if patient == 6 else slice(1, 9), *BLOCK)] = 1
        return out

    def write_mask(self, patient: int, path: Path) -> Path:
        """Write the mask drawn for ``patient`` as NIfTI at ``path``."""
        data, affine = self.own_mask(patient)
        path.parent.mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image(data.transpose(2, 1, 0), affine), path)
        return path


def _slice_shift(dz: int) -> np.ndarray:
    shift = np.eye(4)
    shift[2, 3] = dz
    return shift


def make_misfits(root: Path) -> Misfits:
    """Sources of patients 4, 5 and 6 (one axial series of SLICES x ROWS x COLS each) under ``root/src``."""
    series = {p: make_series(root / "src" / f"p{p}", SeriesSpec(n_slices=SLICES, rows=ROWS, cols=COLS,
                                                                  slice_spacing=SPACING, origin=ORIGIN[p]),
                             seed=p, patient_id=f"FIT-{p}")
              for p in ORIGIN}
    return Misfits(root / "src", series)

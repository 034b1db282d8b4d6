"""The voxel grid of a stored series, and a label volume placed on it.

Every label source (NIfTI/NRRD masks, DICOM SEG, RTSTRUCT) is brought onto the grid of the series it
annotates, so that label voxel ``[z, i, j]`` is image voxel ``[z, i, j]`` of :meth:`medload.Store.read`.
The grid is the series' affine in LPS (DICOM patient space) over voxel index ``(column j, row i,
slice z)``: ``lps = affine_lps @ (j, i, z, 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from medload.errors import InputProblem
from medload.storage.records import SeriesRecord, kept_fraction, percent

if TYPE_CHECKING:
    import SimpleITK as sitk

__all__ = ["SeriesGrid", "LabelVolume", "LabelProblem", "RAS_TO_LPS", "cut_note"]

RAS_TO_LPS = np.diag([-1.0, -1.0, 1.0, 1.0])


def cut_note(what: str, unit: str, inside: int, total: int) -> str:
    """The note of a label partly outside its series: how much of its foreground was kept."""
    return (f"{inside} of the {what}'s {total} foreground {unit} ({percent(kept_fraction(inside, total))}) lie "
            "inside the series grid; the rest lies outside it and was cut off")


class LabelProblem(InputProblem):
    """A label input that cannot be placed on its series (stage ``labels``)."""

    def __init__(self, reason: str) -> None:
        super().__init__("labels", reason)


@dataclass(frozen=True)
class SeriesGrid:
    """Shape ``(D, H, W)`` and LPS affine of a stored series; ``instances`` are the pseudonymised
    SOPInstanceUIDs of its slices in z order (for label objects that reference slices by UID)."""

    shape: tuple[int, int, int]
    affine_lps: np.ndarray
    instances: tuple[str, ...] = ()

    @classmethod
    def from_record(cls, rec: SeriesRecord, instances: tuple[str, ...] = ()) -> SeriesGrid:
        d, h, w = rec.shape
        return cls((d, h, w), RAS_TO_LPS @ np.asarray(rec.affine, dtype=np.float64), instances)

    @property
    def normal(self) -> np.ndarray:
        """Unit vector of increasing slice index."""
        step = self.affine_lps[:3, 2]
        return step / np.linalg.norm(step)

    def to_index(self, points_lps: np.ndarray) -> np.ndarray:
        """Continuous voxel indices ``(column, row, slice)`` of LPS points ``(N, 3)``."""
        pts = np.c_[np.asarray(points_lps, dtype=np.float64), np.ones(len(points_lps))]
        return (np.linalg.inv(self.affine_lps) @ pts.T).T[:, :3]

    def to_world(self, index: np.ndarray) -> np.ndarray:
        """LPS points of continuous voxel indices ``(N, 3)`` in ``(column, row, slice)`` order."""
        idx = np.c_[np.asarray(index, dtype=np.float64), np.ones(len(index))]
        return (self.affine_lps @ idx.T).T[:, :3]

    def sitk_reference(self) -> sitk.Image:
        """An empty SimpleITK image with this grid (origin, spacing, direction), for resampling onto it."""
        import SimpleITK as sitk

        d, h, w = self.shape
        columns = self.affine_lps[:3, :3]
        spacing = np.linalg.norm(columns, axis=0)
        image = sitk.Image([w, h, d], sitk.sitkUInt8)
        image.SetOrigin(tuple(self.affine_lps[:3, 3]))
        image.SetSpacing(tuple(float(s) for s in spacing))
        image.SetDirection(tuple((columns / spacing).ravel()))
        return image


@dataclass
class LabelVolume:
    """A label map on a series grid: ``data`` is ``(D, H, W)`` uint8 (or uint16 beyond 255 classes),
    0 is background, ``classes`` names each id. ``notes`` say what was done to place it (resampled,
    contours outside the grid...).

    ``coverage`` is ``(inside, total)``: of the source's foreground, placed by its physical position,
    how much lands inside the series grid's field of view (voxel centres within the grid's extent) and
    how much there is -- mask voxels, SEG frame pixels, or voxel centres inside RTSTRUCT contours on
    the grid's in-plane raster (contours beyond the series' first and last slices count whole). What
    lies outside is cut off; :attr:`kept` is the fraction kept.
    """

    data: np.ndarray
    classes: dict[int, str]
    kind: str
    source: str
    resampled: bool = False
    notes: list[str] = field(default_factory=list)
    coverage: tuple[int, int] = (0, 0)

    @property
    def kept(self) -> float:
        """Fraction of the source's foreground that lies inside the series grid (see ``coverage``)."""
        return kept_fraction(*self.coverage)

    def foreground_counts(self) -> np.ndarray:
        """``(D, n_classes)`` voxels of each class (in ``sorted(classes)`` order) on each slice."""
        ids = sorted(self.classes)
        return np.stack([(self.data == c).sum(axis=(1, 2)) for c in ids], axis=1).astype(np.int64) if ids \
            else np.zeros((self.data.shape[0], 0), dtype=np.int64)

"""NIfTI / NRRD label masks placed onto the voxel grid of their series.

SimpleITK reads both formats into one physical convention (LPS mm, whatever the file's own space: a
NIfTI's RAS sform/qform and a NRRD's ``space`` field are converted on read), so a mask is placed by
the physical position of its voxels, never by its array order. A mask on the series grid (same size,
origin and spacing within :data:`GRID_TOLERANCE_MM`, direction within :data:`DIRECTION_TOLERANCE`) is
taken as is; any other overlapping grid (shifted, other spacing, flipped or permuted axes, another
orientation) is resampled onto the series grid with nearest neighbour (``resampled=True``, with a
note saying whether the two grids share voxel centres, in which case nothing is lost).

Values are class ids: integer masks, or float masks whose values are whole numbers (0/1). Fractional
floats (probabilities) are refused rather than silently thresholded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

from medload.labels.grid import LabelProblem, LabelVolume, SeriesGrid

__all__ = ["mask_to_grid", "image_affine_lps", "GRID_TOLERANCE_MM", "DIRECTION_TOLERANCE"]

GRID_TOLERANCE_MM = 1e-3
DIRECTION_TOLERANCE = 1e-4
_MAX_CLASS = np.iinfo(np.uint16).max


def image_affine_lps(image: sitk.Image) -> np.ndarray:
    """4x4 affine of a 3-D SimpleITK image: voxel index ``(x, y, z, 1)`` to LPS mm."""
    direction = np.asarray(image.GetDirection(), float).reshape(3, 3)
    affine = np.eye(4)
    affine[:3, :3] = direction * np.asarray(image.GetSpacing(), float)
    affine[:3, 3] = image.GetOrigin()
    return affine


def _read(path: Path) -> sitk.Image:
    if not path.is_file():
        raise LabelProblem(f"mask {path} does not exist")
    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as err:
        first = str(err).strip().splitlines()[-1] if str(err).strip() else "unknown error"
        raise LabelProblem(f"cannot read mask {path.name} with SimpleITK: {first}") from None
    if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
        raise LabelProblem(f"mask {path.name} is {image.GetDimension()}-D with "
                           f"{image.GetNumberOfComponentsPerPixel()} components per voxel: expected a 3-D "
                           "scalar label image (split 4-D / one-hot masks into one label map first)")
    return image


def _labels(image: sitk.Image, name: str) -> np.ndarray:
    """The mask's voxels as non-negative integer class ids ``(z, y, x)``."""
    arr = sitk.GetArrayViewFromImage(image)
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or (arr != np.round(arr)).any():
            raise LabelProblem(f"mask {name} holds non-integer values (a probability map?): threshold it to "
                               "class ids (0/1 or 0..N) before placing it")
    elif arr.dtype.kind not in "iub":
        raise LabelProblem(f"mask {name} has pixel type {image.GetPixelIDTypeAsString()}: expected integers")
    if arr.size and (arr.min() < 0 or arr.max() > _MAX_CLASS):
        raise LabelProblem(f"mask {name} has values from {arr.min()} to {arr.max()}: class ids must be in "
                           f"0..{_MAX_CLASS}")
    top = arr.max() if arr.size else 0
    return np.asarray(arr, dtype=np.uint8 if top <= 255 else np.uint16)


def _same_grid(image: sitk.Image, reference: sitk.Image) -> bool:
    return (tuple(image.GetSize()) == tuple(reference.GetSize())
            and np.allclose(image.GetOrigin(), reference.GetOrigin(), rtol=0, atol=GRID_TOLERANCE_MM)
            and np.allclose(image.GetSpacing(), reference.GetSpacing(), rtol=0, atol=GRID_TOLERANCE_MM)
            and np.allclose(image.GetDirection(), reference.GetDirection(), rtol=0, atol=DIRECTION_TOLERANCE))


def _box_in_grid(image: sitk.Image, grid: SeriesGrid) -> tuple[np.ndarray, np.ndarray]:
    """Bounds, in grid voxel indices ``(column, row, slice)``, of the mask's extent (voxel edges)."""
    size = np.asarray(image.GetSize(), float)
    corners = np.array(np.meshgrid(*[[-0.5, s - 0.5] for s in size], indexing="ij")).reshape(3, -1).T
    world = (image_affine_lps(image) @ np.c_[corners, np.ones(len(corners))].T).T[:, :3]
    idx = grid.to_index(world)
    return idx.min(axis=0), idx.max(axis=0)


def _shares_centres(image: sitk.Image, grid: SeriesGrid) -> bool:
    """Whether every grid voxel centre is a mask voxel centre (axes permuted/flipped, whole-voxel shifts)."""
    m = np.linalg.inv(image_affine_lps(image)) @ grid.affine_lps
    rot = m[:3, :3]
    perm = np.abs(np.round(rot))
    return (np.abs(rot - np.round(rot)).max() < DIRECTION_TOLERANCE and (perm.sum(axis=0) == 1).all()
            and (perm.sum(axis=1) == 1).all() and np.abs(m[:3, 3] - np.round(m[:3, 3])).max() < 1e-3)


def _counts(arr: np.ndarray) -> dict[int, int]:
    counts = np.bincount(arr.ravel())
    return {int(v): int(counts[v]) for v in np.flatnonzero(counts) if v}


def mask_to_grid(path: str | Path, grid: SeriesGrid, *, class_names: dict[int, str] | None = None) -> LabelVolume:
    """Place a NIfTI (``.nii``, ``.nii.gz``) or NRRD (``.nrrd``, ``.nhdr``) label mask on ``grid``.

    Args:
        path: the mask file; voxel values are class ids (0 = background).
        grid: the series the mask annotates.
        class_names: names of class ids; ids present in the mask but not named become ``class_<id>``
            (with a note). Without it every non-zero value present is ``class_<id>``.

    Returns:
        ``(D, H, W)`` uint8 label map (uint16 when a class id exceeds 255) on the grid.

    Raises:
        LabelProblem: unreadable file, not a 3-D scalar image, non-integer or negative values, no
            overlap with the series, or labels that all vanish when resampled onto the series.
    """
    path = Path(path)
    image = _read(path)
    labels = _labels(image, path.name)
    before = _counts(labels)
    reference = grid.sitk_reference()
    notes: list[str] = []
    resampled = False
    if _same_grid(image, reference):
        data = np.array(labels, copy=True)
    else:
        lo, hi = _box_in_grid(image, grid)
        top = np.asarray(grid.shape[::-1], float) - 0.5
        if (hi < -0.5).any() or (lo > top).any():
            raise LabelProblem(
                f"mask {path.name} does not overlap the series: its extent covers grid indices (column, row, "
                f"slice) {np.round(lo, 1).tolist()} to {np.round(hi, 1).tolist()}, the series "
                f"[0, 0, 0] to {(top - 0.5).astype(int).tolist()}; is it the mask of another series?")
        source = sitk.GetImageFromArray(labels)
        source.CopyInformation(image)
        out = sitk.Resample(source, reference, sitk.Transform(), sitk.sitkNearestNeighbor, 0,
                            source.GetPixelID())
        data = sitk.GetArrayFromImage(out)
        resampled = True
        how = ("the grids share voxel centres, nothing interpolated" if _shares_centres(image, grid)
               else "voxel centres differ, labels interpolated")
        notes.append(f"resampled by nearest neighbour from a {list(image.GetSize())} grid (origin "
                     f"{np.round(image.GetOrigin(), 3).tolist()}, spacing {np.round(image.GetSpacing(), 4).tolist()}, "
                     f"direction {np.round(image.GetDirection(), 4).tolist()}, LPS): {how}")
    after = _counts(data)
    if before and not after:
        raise LabelProblem(f"mask {path.name}: all {sum(before.values())} labelled voxels fall outside the series "
                           "grid once placed by their physical position: is it the mask of another series?")
    notes += [f"class {v}: {n} voxels in the mask, none on the series grid" for v, n in before.items()
              if v not in after]
    if not before:
        notes.append(f"mask {path.name} is empty (all zeros)")
    if class_names is not None:
        classes = {int(v): str(n) for v, n in class_names.items() if int(v) != 0}
        unnamed = sorted(set(before) - set(classes))
        classes.update({v: f"class_{v}" for v in unnamed})
        if unnamed:
            notes.append(f"values {unnamed} are not in class_names: named class_<id>")
    else:
        classes = {v: f"class_{v}" for v in sorted(before)}
    dtype = np.uint16 if data.max(initial=0) > 255 else np.uint8
    return LabelVolume(data=np.ascontiguousarray(data, dtype=dtype), classes=dict(sorted(classes.items())),
                       kind="mask", source=path.name, resampled=resampled, notes=notes)

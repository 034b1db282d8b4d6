"""NIfTI / NRRD label masks placed onto the voxel grid of their series.

NIfTI is read with nibabel, with MONAI ``NibabelReader``'s rule for its geometry (:func:`nifti_affine`):
the sform when sform_code is not 0, else the qform when qform_code is not 0, else the pixdim scaling --
unless that transform's voxel sizes disagree with pixdim and the other one agrees -- and voxel values as
``img.dataobj`` gives them (scl_slope/scl_inter applied).
Its RAS affine is turned to LPS, so any affine works, sheared or with non-orthonormal axes too. NRRD
(and MetaImage) is read with SimpleITK, which converts a NRRD's ``space`` field to LPS. Either way a
mask is placed by the physical position of its voxels, never by its array order. A mask on the series
grid (same size, origin and spacing within :data:`GRID_TOLERANCE_MM`, direction within
:data:`DIRECTION_TOLERANCE`) is taken as is; any other overlapping grid (shifted, other spacing, flipped
or permuted axes, another orientation) is resampled onto the series grid with nearest neighbour
(``resampled=True``, with a note saying whether the two grids share voxel centres, in which case
nothing is lost): with SimpleITK where the mask's axes are orthonormal, else by mapping every series
voxel centre through the mask's affine. Mask voxels whose centres lie outside the series' extent are
cut off: the result's ``coverage`` counts them, for the ingest to refuse a mask that mostly lies
elsewhere (another patient's, another series') and to flag one that was cut.

Values are class ids: integer masks, or float masks whose values are whole numbers (0/1). Fractional
floats (probabilities) are refused rather than silently thresholded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from medload.labels.grid import RAS_TO_LPS, LabelProblem, LabelVolume, SeriesGrid, cut_note

if TYPE_CHECKING:  # both are imported where a mask is read: an ingest without masks never loads them
    import nibabel as nib
    import SimpleITK as sitk

__all__ = ["mask_to_grid", "image_affine_lps", "nifti_affine", "GRID_TOLERANCE_MM", "DIRECTION_TOLERANCE"]

GRID_TOLERANCE_MM = 1e-3
DIRECTION_TOLERANCE = 1e-4
_MAX_CLASS = np.iinfo(np.uint16).max
_NIFTI = (".nii", ".nii.gz")


def image_affine_lps(image: sitk.Image) -> np.ndarray:
    """4x4 affine of a 3-D SimpleITK image: voxel index ``(x, y, z, 1)`` to LPS mm."""
    direction = np.asarray(image.GetDirection(), float).reshape(3, 3)
    affine = np.eye(4)
    affine[:3, :3] = direction * np.asarray(image.GetSpacing(), float)
    affine[:3, 3] = image.GetOrigin()
    return affine


def _not_3d(name: str, dims: int, components: int) -> LabelProblem:
    return LabelProblem(f"mask {name} is {dims}-D with {components} components per voxel: expected a 3-D scalar "
                        "label image (split 4-D / one-hot masks into one label map first)")


def nifti_affine(image: nib.Nifti1Image) -> np.ndarray:
    """The RAS affine MONAI's ``NibabelReader`` gives a NIfTI: nibabel's best affine (sform, qform, pixdim
    by their codes), replaced by the other transform when its voxel sizes disagree with pixdim and the
    other's agree (``monai.data.utils.correct_nifti_header_if_necessary``)."""
    header = image.header
    dims = int(header["dim"][0])
    best = np.asarray(image.affine, dtype=np.float64)
    if dims >= 5:
        return best
    pixdim = np.asarray(header.get_zooms())[:dims]

    def agrees(affine: np.ndarray) -> bool:
        return bool(np.allclose(np.sqrt(np.sum(affine[:-1, :dims] ** 2, axis=0)), pixdim))

    if agrees(best):
        return best
    sform, qform = image.get_sform(), image.get_qform()
    for code, own, other in (("sform_code", sform, qform), ("qform_code", qform, sform)):
        if header[code] != 0:
            if agrees(own):
                return best
            if agrees(other):
                return np.asarray(other, dtype=np.float64)
    return best


def _read_nifti(path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values (z, y, x), affine of voxel (x, y, z) in LPS)`` of a NIfTI, as MONAI's NibabelReader reads it."""
    import nibabel as nib

    try:
        image = nib.load(path)
        if not isinstance(image, nib.Nifti1Image):  # a NIfTI-2 image is one too
            raise TypeError(f"it reads as a {type(image).__name__}, not a NIfTI image")
        values = np.asanyarray(image.dataobj)
    except Exception as err:  # nibabel raises many types on damaged files
        raise LabelProblem(f"cannot read mask {name} with nibabel: {type(err).__name__}: "
                           f"{_named(str(err), path, name)}") from None
    if values.ndim == 4 and values.shape[3] == 1:
        values = values[..., 0]
    if values.ndim != 3:
        raise _not_3d(name, values.ndim, 1)
    return values.transpose(2, 1, 0), RAS_TO_LPS @ nifti_affine(image)


def _read_sitk(path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values (z, y, x), affine of voxel (x, y, z) in LPS)`` of a NRRD or MetaImage, read with SimpleITK."""
    import SimpleITK as sitk

    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as err:
        first = str(err).strip().splitlines()[-1] if str(err).strip() else "unknown error"
        raise LabelProblem(f"cannot read mask {name} with SimpleITK: {_named(first, path, name)}") from None
    if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
        raise _not_3d(name, image.GetDimension(), image.GetNumberOfComponentsPerPixel())
    return sitk.GetArrayFromImage(image), image_affine_lps(image)


def _read(path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise LabelProblem(f"mask {name} does not exist")
    return _read_nifti(path, name) if path.name.lower().endswith(_NIFTI) else _read_sitk(path, name)


def _named(text: str, path: Path, name: str) -> str:
    """A reader's message with the mask's path (which may hold a UID) replaced by the name it goes by."""
    return text.replace(str(path), name).replace(path.name, name)


def _labels(arr: np.ndarray, name: str) -> np.ndarray:
    """The mask's voxels as non-negative integer class ids ``(z, y, x)``."""
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or (arr != np.round(arr)).any():
            raise LabelProblem(f"mask {name} holds non-integer values (a probability map?): threshold it to "
                               "class ids (0/1 or 0..N) before placing it")
    elif arr.dtype.kind not in "iub":
        raise LabelProblem(f"mask {name} has pixel type {arr.dtype}: expected integers")
    if arr.size and (arr.min() < 0 or arr.max() > _MAX_CLASS):
        raise LabelProblem(f"mask {name} has values from {arr.min()} to {arr.max()}: class ids must be in "
                           f"0..{_MAX_CLASS}")
    top = arr.max() if arr.size else 0
    return np.asarray(arr, dtype=np.uint8 if top <= 255 else np.uint16)


def _same_grid(shape: tuple[int, ...], affine: np.ndarray, grid: SeriesGrid) -> bool:
    return (tuple(shape) == tuple(grid.shape)
            and np.allclose(affine[:3, 3], grid.affine_lps[:3, 3], rtol=0, atol=GRID_TOLERANCE_MM)
            and np.allclose(np.linalg.norm(affine[:3, :3], axis=0), np.linalg.norm(grid.affine_lps[:3, :3], axis=0),
                            rtol=0, atol=GRID_TOLERANCE_MM)
            and np.allclose(_directions(affine), _directions(grid.affine_lps), rtol=0, atol=DIRECTION_TOLERANCE))


def _directions(affine: np.ndarray) -> np.ndarray:
    return affine[:3, :3] / np.linalg.norm(affine[:3, :3], axis=0)


def _box_in_grid(size_xyz: np.ndarray, affine: np.ndarray, grid: SeriesGrid) -> tuple[np.ndarray, np.ndarray]:
    """Bounds, in grid voxel indices ``(column, row, slice)``, of the mask's extent (voxel edges)."""
    corners = np.array(np.meshgrid(*[[-0.5, s - 0.5] for s in size_xyz], indexing="ij")).reshape(3, -1).T
    world = (affine @ np.c_[corners, np.ones(len(corners))].T).T[:, :3]
    idx = grid.to_index(world)
    return idx.min(axis=0), idx.max(axis=0)


def _shares_centres(affine: np.ndarray, grid: SeriesGrid) -> bool:
    """Whether every grid voxel centre is a mask voxel centre (axes permuted/flipped, whole-voxel shifts,
    whole-voxel shears): the map from grid to mask indices is integral."""
    m = np.linalg.inv(affine) @ grid.affine_lps
    rot = m[:3, :3]
    return bool(np.abs(rot - np.round(rot)).max() < DIRECTION_TOLERANCE
                and np.abs(m[:3, 3] - np.round(m[:3, 3])).max() < 1e-3)


def _orthonormal(affine: np.ndarray) -> bool:
    d = _directions(affine)
    return bool(np.allclose(d.T @ d, np.eye(3), rtol=0, atol=DIRECTION_TOLERANCE))


def _resample(labels: np.ndarray, affine: np.ndarray, grid: SeriesGrid) -> np.ndarray:
    """Nearest-neighbour values of ``labels`` (z, y, x) at the grid's voxel centres: SimpleITK for a mask
    with orthonormal axes, else every grid centre mapped through the mask's inverse affine."""
    if _orthonormal(affine):
        import SimpleITK as sitk

        spacing = np.linalg.norm(affine[:3, :3], axis=0)
        source = sitk.GetImageFromArray(labels)
        source.SetOrigin(tuple(float(v) for v in affine[:3, 3]))
        source.SetSpacing(tuple(float(v) for v in spacing))
        source.SetDirection(tuple(float(v) for v in _directions(affine).ravel()))
        resampled = sitk.Resample(source, grid.sitk_reference(), sitk.Transform(), sitk.sitkNearestNeighbor, 0,
                                  source.GetPixelID())
        return sitk.GetArrayFromImage(resampled)
    d, h, w = grid.shape
    k, i, j = np.indices((d, h, w)).reshape(3, -1)
    to_mask = np.linalg.inv(affine) @ grid.affine_lps
    x, y, z = np.floor((to_mask @ np.stack([j, i, k, np.ones_like(k)]))[:3] + 0.5).astype(np.int64)
    inside = (x >= 0) & (x < labels.shape[2]) & (y >= 0) & (y < labels.shape[1]) & (z >= 0) & (z < labels.shape[0])
    out = np.zeros(d * h * w, dtype=labels.dtype)
    out[inside] = labels[z[inside], y[inside], x[inside]]
    return out.reshape(d, h, w)


def _coverage(labels: np.ndarray, affine: np.ndarray, grid: SeriesGrid) -> tuple[int, int]:
    """``(inside, total)``: the mask's foreground voxels, and those whose centres, placed by ``affine``,
    lie within the grid's extent (continuous indices in ``[-0.5, n - 0.5)`` on every axis). The grid
    index is affine in the mask's column x, so on each mask row the inside voxels are one run of
    columns: its ends come from the bounds, its foreground count from the row's cumulative sum (one mask
    slice at a time: no per-voxel coordinates)."""
    to_grid = np.linalg.inv(grid.affine_lps) @ affine
    sizes = grid.shape[::-1]  # along grid column, row, slice
    height, width = labels.shape[1:]
    rows = np.arange(height, dtype=np.float64)
    inside = total = 0
    for z, plane in enumerate(labels):
        counts = np.zeros((height, width + 1), np.int64)
        np.cumsum(plane != 0, axis=1, out=counts[:, 1:])
        if not counts[:, -1].any():
            continue
        total += int(counts[:, -1].sum())
        lo, hi = np.zeros(height), np.full(height, float(width))  # inside columns: lo <= x < hi
        for a in range(3):
            step = to_grid[a, 0]
            at_0 = to_grid[a, 1] * rows + to_grid[a, 2] * z + to_grid[a, 3]  # grid index a of column 0
            first, past = (-0.5 - at_0), (sizes[a] - 0.5 - at_0)  # step * x must lie in [first, past)
            if abs(step) < 1e-12:
                hi = np.where((first <= 0) & (past > 0), hi, lo)
            elif step > 0:
                lo, hi = np.maximum(lo, np.ceil(first / step)), np.minimum(hi, np.ceil(past / step))
            else:
                lo, hi = np.maximum(lo, np.floor(past / step) + 1), np.minimum(hi, np.floor(first / step) + 1)
        lo = np.clip(lo, 0, width).astype(np.int64)
        hi = np.clip(hi, lo, width).astype(np.int64)
        inside += int((counts[np.arange(height), hi] - counts[np.arange(height), lo]).sum())
    return inside, total


def _counts(arr: np.ndarray) -> dict[int, int]:
    counts = np.bincount(arr.ravel())
    return {int(v): int(counts[v]) for v in np.flatnonzero(counts) if v}


def mask_to_grid(path: str | Path, grid: SeriesGrid, *, class_names: dict[int, str] | None = None,
                 source: str | None = None) -> LabelVolume:
    """Place a NIfTI (``.nii``, ``.nii.gz``) or NRRD (``.nrrd``, ``.nhdr``) label mask on ``grid``.

    Args:
        path: the mask file; voxel values are class ids (0 = background).
        grid: the series the mask annotates.
        class_names: names of class ids; ids present in the mask but not named become ``class_<id>``
            (with a note). Without it every non-zero value present is ``class_<id>``.
        source: what to call the mask in messages, notes and the result (default: its file name);
            the ingest passes a name without raw UIDs.

    Returns:
        ``(D, H, W)`` uint8 label map (uint16 when a class id exceeds 255) on the grid; its ``coverage``
        counts the mask's foreground voxels and those whose centres lie inside the grid (the others
        are cut off, and noted).

    Raises:
        LabelProblem: unreadable file, not a 3-D scalar image, non-integer or negative values, no
            overlap with the series, or labels that all vanish when resampled onto the series.
    """
    path = Path(path)
    name = source or path.name
    values, affine = _read(path, name)
    labels = _labels(values, name)
    before = _counts(labels)
    notes: list[str] = []
    resampled = False
    if _same_grid(labels.shape, affine, grid):
        data = np.array(labels, copy=True)
        total = sum(before.values())
        coverage = (total, total)
    else:
        lo, hi = _box_in_grid(np.asarray(labels.shape[::-1], float), affine, grid)
        top = np.asarray(grid.shape[::-1], float) - 0.5
        if (hi < -0.5).any() or (lo > top).any():
            raise LabelProblem(
                f"mask {name} does not overlap the series: its extent covers grid indices (column, row, "
                f"slice) {np.round(lo, 1).tolist()} to {np.round(hi, 1).tolist()}, the series "
                f"[0, 0, 0] to {(top - 0.5).astype(int).tolist()}; is it the mask of another series?")
        data = _resample(labels, affine, grid)
        coverage = _coverage(labels, affine, grid)
        resampled = True
        how = ("the grids share voxel centres, nothing interpolated" if _shares_centres(affine, grid)
               else "voxel centres differ, labels interpolated")
        notes.append(f"resampled by nearest neighbour from a {list(labels.shape[::-1])} grid (origin "
                     f"{np.round(affine[:3, 3], 3).tolist()}, spacing "
                     f"{np.round(np.linalg.norm(affine[:3, :3], axis=0), 4).tolist()}, direction "
                     f"{np.round(_directions(affine).ravel(), 4).tolist()}, LPS): {how}")
    after = _counts(data)
    if before and not after:
        raise LabelProblem(f"mask {name}: all {sum(before.values())} labelled voxels fall outside the series "
                           "grid once placed by their physical position: is it the mask of another series?")
    if coverage[0] < coverage[1]:
        notes.append(cut_note("mask", "voxels", *coverage))
    notes += [f"class {v}: {n} voxels in the mask, none on the series grid" for v, n in before.items()
              if v not in after]
    if not before:
        notes.append(f"mask {name} is empty (all zeros)")
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
                       kind="mask", source=name, resampled=resampled, notes=notes, coverage=coverage)

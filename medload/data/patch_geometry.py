"""Geometry of a 3D training patch: its grid, its affine, and where its voxels lie in the stored series.

Pure functions on 4x4 matrices, no pixels. Conventions:

- World coordinates are RAS+ mm (NIfTI's sform/qform space: x to the patient's Right, y Anterior,
  z Superior), as a series' ``SeriesRecord.affine``, which maps NIfTI voxel ``(column, row, slice)``.
- A stored series is the array ``(slices, rows, columns)``; its *index affine*
  (:func:`series_index_affine`) maps ``(slice, row, column)`` to RAS, as :mod:`medload.data.layout`'s
  3D samples do.
- A patch is the array ``(D, H, W)`` in the same order; its affine maps ``(d, h, w)`` to RAS. An
  orientation code names, nibabel's ``aff2axcodes`` way, where the patch's ``w``, ``h`` and ``d``
  axes point -- the NIfTI ``i, j, k`` of the patch written as medload exports a series (the array
  transposed to ``(w, h, d)``): ``"RAS"`` is MONAI's ``Orientationd(axcodes="RAS")`` and nibabel's
  closest-canonical, ``"LPS"`` ITK's (and so nnU-Net's) identity direction.
- A spacing ``(z, y, x)`` is nnU-Net's order: the mm between samples along ``d``, ``h`` and ``w``.
- Index coordinates are voxel *centres* (NIfTI, ITK and MONAI alike): index 0 is the centre of the first
  voxel. A patch of n voxels has its centre on voxel ``n // 2`` (the middle one for odd n, the one after
  the middle for even n, where MONAI's ``SpatialCrop(roi_center=...)`` puts it), so a patch at the
  series' own spacing and orientation centred on a voxel lies on the series' own voxel grid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from medload.data.layout import sample_affine
from medload.errors import ConfigError

__all__ = ["axcode_directions", "series_index_affine", "native_directions", "native_spacing", "patch_affine",
           "voxel_to_voxel", "source_box", "covering_grid", "AXIS_SNAP"]

_LETTERS = {"R": (0, 1.0), "L": (0, -1.0), "A": (1, 1.0), "P": (1, -1.0), "S": (2, 1.0), "I": (2, -1.0)}


def axcode_directions(orientation: str) -> np.ndarray:
    """Unit RAS directions of the patch axes ``(w, h, d)`` as the columns of a 3x3 matrix, for a code such
    as ``"RAS"`` or ``"LPS"`` (nibabel ``aff2axcodes`` letters, one of R/L, A/P and S/I each).

    >>> axcode_directions("LPS")
    array([[-1.,  0.,  0.],
           [ 0., -1.,  0.],
           [ 0.,  0.,  1.]])
    """
    code = str(orientation).upper()
    axes = [_LETTERS.get(c) for c in code]
    if len(code) != 3 or None in axes or sorted(a[0] for a in axes if a) != [0, 1, 2]:
        raise ConfigError(f"orientation {orientation!r}: give three letters, one of R/L, A/P and S/I each "
                          "(e.g. 'RAS', 'LPS'), or None for each series' own")
    out = np.zeros((3, 3))
    for column, (axis, sign) in enumerate(a for a in axes if a):
        out[axis, column] = sign
    return out


def series_index_affine(series_affine: npt.ArrayLike) -> np.ndarray:
    """The affine of a stored series' array: ``(slice, row, column)`` to RAS mm."""
    return sample_affine(series_affine, 0, 3)


def native_directions(series_affine: npt.ArrayLike) -> np.ndarray:
    """The series' own unit directions of increasing column, row and slice (the columns of its affine,
    normalised): the ``(w, h, d)`` directions of a patch in the series' orientation. A gantry-tilted
    (sheared) series keeps its non-orthogonal slice direction."""
    a = np.asarray(series_affine, dtype=np.float64)[:3, :3]
    return a / np.linalg.norm(a, axis=0)


def native_spacing(series_affine: npt.ArrayLike, directions: np.ndarray | None = None) -> tuple[float, float, float]:
    """The series' own spacing ``(z, y, x)`` in mm for a patch along ``directions`` (columns: ``w, h, d``;
    None: the series' own): each patch axis takes the spacing of the series axis closest to it in
    direction (largest ``|cos|``), as a reorientation permutes axes."""
    a = np.asarray(series_affine, dtype=np.float64)[:3, :3]
    sizes = np.linalg.norm(a, axis=0)  # column, row, slice spacing
    if directions is None:
        return float(sizes[2]), float(sizes[1]), float(sizes[0])
    closest = np.abs(np.asarray(directions).T @ (a / sizes)).argmax(axis=1)  # per patch axis w, h, d
    return float(sizes[closest[2]]), float(sizes[closest[1]]), float(sizes[closest[0]])


def _steps(spacing: Sequence[float], directions: np.ndarray) -> np.ndarray:
    """3x3: the RAS step of one patch voxel along ``d``, ``h`` and ``w`` (columns)."""
    z, y, x = (float(s) for s in spacing)
    if min(z, y, x) <= 0:
        raise ConfigError(f"spacing must be positive mm (z, y, x), got {tuple(spacing)}")
    return np.asarray(directions, dtype=np.float64)[:, ::-1] * np.array([z, y, x])


def patch_affine(centre: npt.ArrayLike, shape: Sequence[int], spacing: Sequence[float], directions: np.ndarray) -> np.ndarray:
    """The affine of a patch ``(D, H, W)`` centred at RAS point ``centre``: ``(d, h, w)`` to RAS mm, with
    ``spacing`` ``(z, y, x)`` along ``directions`` (columns ``w, h, d``; see :func:`axcode_directions`).

    >>> a = patch_affine([10.0, 20.0, 30.0], (3, 4, 5), (2.0, 1.0, 0.5), axcode_directions("RAS"))
    >>> a @ [1, 2, 2, 1]                                 # the centre voxel n // 2 of each axis
    array([10., 20., 30.,  1.])
    """
    steps = _steps(spacing, directions)
    return _affine(steps, np.asarray(centre, dtype=np.float64) - steps @ (np.asarray(shape) // 2))


def _affine(steps: np.ndarray, origin: np.ndarray) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = steps
    out[:3, 3] = origin
    return out


AXIS_SNAP = 1e-12
"""Relative size below which a term of :func:`voxel_to_voxel`'s rotation block is float rounding."""


def voxel_to_voxel(patch: np.ndarray, series_affine: npt.ArrayLike) -> np.ndarray:
    """4x4: patch index ``(d, h, w)`` to the stored series' index ``(slice, row, column)`` (continuous),
    ``inv(series index affine) @ patch affine`` -- ITK's and MONAI's resampling transform. Terms of its 3x3
    block below :data:`AXIS_SNAP` of their row's largest are rounding left by the solve (direction cosines
    of 0 and 1 composed) and are set to exactly 0, so that grids along the series' axes are recognised
    as such (:mod:`medload.data.separable`); they move no point by more than that fraction of a voxel
    per voxel of the patch."""
    m = np.linalg.solve(series_index_affine(series_affine), np.asarray(patch, dtype=np.float64))
    block = m[:3, :3]
    block[np.abs(block) < AXIS_SNAP * np.abs(block).max(axis=1, keepdims=True)] = 0.0
    return m


def source_box(v2v: np.ndarray, shape: Sequence[int],
               source_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The stored voxels ``lo <= index < hi`` (per axis slice, row, column) that resampling the patch
    ``shape`` through ``v2v`` can touch, trilinear or nearest: the box of its corners (an affine map's
    extremes) widened to the voxels either side, clipped to the series. None when the patch lies wholly
    outside."""
    corners = np.array(np.meshgrid(*[[0, n - 1] for n in shape], indexing="ij")).reshape(3, -1)
    src = v2v[:3, :3] @ corners + v2v[:3, 3:]
    lo = np.maximum(np.floor(src.min(axis=1)).astype(np.int64), 0)
    hi = np.minimum(np.floor(src.max(axis=1)).astype(np.int64) + 2, np.asarray(source_shape))
    return None if (hi <= lo).any() else (lo, hi)


def covering_grid(series_affine: npt.ArrayLike, source_shape: Sequence[int], spacing: Sequence[float], directions: np.ndarray,
                  least: Sequence[int] = (1, 1, 1)) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The affine and shape ``(D, H, W)`` of the smallest grid at ``spacing`` along ``directions`` holding
    every voxel centre of the series (grown, about the same centre, to at least ``least``): what a
    whole series is resampled onto for sliding-window inference."""
    steps = _steps(spacing, directions)
    corners = np.array(np.meshgrid(*[[0, n - 1] for n in source_shape], indexing="ij")).reshape(3, -1)
    ras = series_index_affine(series_affine)[:3] @ np.vstack([corners, np.ones(corners.shape[1])])
    grid = np.linalg.solve(steps, ras)  # corners in patch-index units, origin at RAS 0
    lo, hi = grid.min(axis=1), grid.max(axis=1)
    shape = np.maximum(np.ceil(hi - lo - 1e-6).astype(np.int64) + 1, np.asarray(least, dtype=np.int64))
    origin = steps @ ((lo + hi) / 2 - (shape - 1) / 2)  # the series' extent in the middle of the grid
    return _affine(steps, origin), (int(shape[0]), int(shape[1]), int(shape[2]))

"""Patient-space geometry of a synthetic series: orientation, slice positions and the RAS affine.

Every number written to a DS tag goes through :func:`ds_values`, and the ground truth is computed from
the written (decimal string) values, so that the ground truth equals what a reader sees.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydicom.valuerep import format_number_as_ds

from medload.errors import ConfigError
from medload.synthetic.spec import SeriesSpec

__all__ = ["ds_values", "orientation_cosines", "slice_offsets", "slice_positions", "affine_ras"]

LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


def ds_values(values: Sequence[float] | np.ndarray) -> list[str]:
    """Format numbers as DICOM decimal strings (at most 16 characters each)."""
    return [format_number_as_ds(float(v)) for v in np.ravel(values)]


def _as_written(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.array([float(s) for s in ds_values(values)]).reshape(np.shape(values))


def _rotation(rng: np.random.Generator) -> np.ndarray:
    """A rotation of 10-30 degrees (random sign) about each of x, y and z, applied in that order."""
    angles = np.radians(rng.uniform(10.0, 30.0, 3) * rng.choice([-1.0, 1.0], 3))
    (cx, cy, cz), (sx, sy, sz) = np.cos(angles), np.sin(angles)
    rx = np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    ry = np.array([[cy, 0, sy], [0, 1, 0], [-sy, 0, cy]])
    rz = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]])
    return rz @ ry @ rx


def orientation_cosines(orientation: str | Sequence[float], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Return (row cosine, column cosine) as written to ImageOrientationPatient (0020,0037).

    The row cosine is the direction of increasing column index, the column cosine that of increasing
    row index (LPS).
    """
    if isinstance(orientation, str):
        if orientation == "axial":
            cosines = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
        elif orientation == "oblique":
            rot = _rotation(rng)
            cosines = np.concatenate([rot[:, 0], rot[:, 1]])
        else:
            raise ConfigError(f"orientation must be 'axial', 'oblique' or 6 direction cosines, got {orientation!r}")
    else:
        cosines = np.asarray(orientation, dtype=float)
        if cosines.shape != (6,):
            raise ConfigError(f"orientation needs 6 direction cosines (ImageOrientationPatient), got {orientation!r}")
    row, col = cosines[:3], cosines[3:]
    if not (np.isclose(np.linalg.norm(row), 1, atol=1e-4) and np.isclose(np.linalg.norm(col), 1, atol=1e-4)):
        raise ConfigError(f"direction cosines {tuple(cosines)} are not unit vectors")
    if abs(float(row @ col)) > 1e-4:
        raise ConfigError(f"direction cosines {tuple(cosines)} are not orthogonal")
    written = _as_written(cosines)
    return written[:3], written[3:]


def slice_offsets(spec: SeriesSpec) -> np.ndarray:
    """Offsets (mm) of the slices along the normal, ascending."""
    if spec.positions_mm is not None:
        offsets = np.sort(np.asarray(spec.positions_mm, dtype=float))
        if offsets.size < 1 or offsets.ndim != 1:
            raise ConfigError("positions_mm must list at least one offset")
        if np.any(np.diff(offsets) <= 0):
            raise ConfigError(f"positions_mm has duplicate offsets: {spec.positions_mm}")
        return offsets
    if spec.n_slices < 1:
        raise ConfigError(f"n_slices must be at least 1, got {spec.n_slices}")
    return np.arange(spec.n_slices) * float(spec.slice_spacing)


def slice_positions(
    origin: np.ndarray, row_cos: np.ndarray, col_cos: np.ndarray, offsets: np.ndarray, tilt_deg: float
) -> np.ndarray:
    """ImagePositionPatient (0020,0032) of each slice, as written: origin + offset * normal + shear.

    The gantry tilt shears positions along the column cosine by tan(tilt) * offset.
    """
    if not abs(tilt_deg) < 60.0:
        raise ConfigError(f"tilt_deg must lie in (-60, 60) degrees, got {tilt_deg}")
    step = np.cross(row_cos, col_cos) + np.tan(np.radians(tilt_deg)) * col_cos
    return _as_written(origin[None, :] + offsets[:, None] * step[None, :])


def affine_ras(
    row_cos: np.ndarray,
    col_cos: np.ndarray,
    pixel_spacing: tuple[float, float],
    ipp: np.ndarray,
    slice_spacing: float,
) -> np.ndarray:
    """4x4 affine from (column j, row i, slice k, 1) to RAS mm.

    The slice step is (IPP_last - IPP_first) / (D - 1), or normal * slice_spacing for one slice.
    """
    if len(ipp) > 1:
        step = (ipp[-1] - ipp[0]) / (len(ipp) - 1)
    else:
        step = np.cross(row_cos, col_cos) * slice_spacing
    lps = np.eye(4)
    lps[:3, 0] = row_cos * pixel_spacing[1]
    lps[:3, 1] = col_cos * pixel_spacing[0]
    lps[:3, 2] = step
    lps[:3, 3] = ipp[0]
    return LPS_TO_RAS @ lps

"""Slice order, spacing checks, gantry tilt and the affine of one candidate volume.

Conventions (DICOM PS3.3 C.7.6.2.1.1): ImageOrientationPatient holds the row cosine ``r`` (direction
of increasing column index) and the column cosine ``c`` (direction of increasing row index); the
centre of pixel (row i, column j) of a slice is ``IPP + j * PixelSpacing[1] * r + i * PixelSpacing[0] * c``
in LPS millimetres. Slices are ordered by IPP projected on the normal ``n = r x c`` -- never by
InstanceNumber or file name -- and the affine maps voxel ``(column, row, slice)`` to millimetres.

Spacing comes from the positions, not from SliceThickness/SpacingBetweenSlices: every slice k must
sit within ``max(tol_mm, tol_rel * spacing)`` of ``affine @ (0, 0, k, 1)``. Gantry tilt (a stack whose
positions drift in-plane, so the slice step is not along the normal) is detected from the positions,
not from GantryDetectorTilt (0018,1120).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from medload.config import IngestConfig
from medload.errors import InputProblem
from medload.ingest.headers import SliceHeader

__all__ = ["Geometry", "plan_geometry", "LPS_TO_RAS"]

LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


@dataclass
class Geometry:
    """Where every slot of a volume lies. ``slots[k]`` lists the planes found at position k
    (more than one only for duplicates, which the decode step resolves)."""

    slots: list[list[SliceHeader]]
    affine_lps: np.ndarray
    spacing: tuple[float, float, float]          # (column, row, slice) mm
    positions: np.ndarray                        # (D, 3) IPP of each slot, LPS mm
    flags: list[str] = field(default_factory=list)

    @property
    def affine_ras(self) -> np.ndarray:
        return LPS_TO_RAS @ self.affine_lps


def _unit(v: np.ndarray, what: str) -> np.ndarray:
    norm = float(np.linalg.norm(v))
    if not 0.9 < norm < 1.1:
        raise InputProblem("geometry", f"ImageOrientationPatient {what} cosine has length {norm:.3f}, not 1")
    return v / norm


def plan_geometry(headers: list[SliceHeader], cfg: IngestConfig) -> Geometry:
    """Order the planes of one candidate along the normal, check spacing and tilt, build the affine.

    Raises :class:`InputProblem` (stage ``geometry``) naming the problem when the planes do not form a
    regular grid under ``cfg``'s policies.
    """
    first = headers[0]
    iop = np.asarray(first.orientation, dtype=np.float64)
    r, c = _unit(iop[:3], "row"), _unit(iop[3:], "column")
    if abs(float(r @ c)) > 1e-3:
        raise InputProblem("geometry", f"ImageOrientationPatient cosines are not orthogonal (r·c = {r @ c:.4f})")
    n = np.cross(r, c)
    n /= np.linalg.norm(n)
    row_spacing, col_spacing = first.pixel_spacing
    if row_spacing <= 0 or col_spacing <= 0:
        raise InputProblem("geometry", f"PixelSpacing {first.pixel_spacing} is not positive")

    ordered = sorted(headers, key=lambda h: (float(np.dot(h.position, n)), h.instance, h.frame or 0))
    slots = _group_positions(ordered, n, cfg)
    positions = np.array([s[0].position for s in slots], dtype=np.float64)
    flags: list[str] = []
    depth = len(slots)
    if depth == 1:
        step, spacing = _single_slice_step(first, n, flags)
    else:
        step = (positions[-1] - positions[0]) / (depth - 1)
        spacing = float(step @ n)
        _check_regular(positions, n, spacing, cfg)
        _check_tilt(positions, n, spacing, cfg, flags)
        _check_grid(positions, step, spacing, cfg)
    if any(len(s) > 1 for s in slots):
        flags.append("duplicates_collapsed")

    affine = np.eye(4)
    affine[:3, 0] = r * col_spacing
    affine[:3, 1] = c * row_spacing
    affine[:3, 2] = step
    affine[:3, 3] = positions[0]
    return Geometry(slots, affine, (float(col_spacing), float(row_spacing), spacing), positions, flags)


def _group_positions(ordered: list[SliceHeader], n: np.ndarray, cfg: IngestConfig) -> list[list[SliceHeader]]:
    """Planes at the same depth (within the duplicate tolerance) share a slot; they must coincide in 3-D."""
    slots: list[list[SliceHeader]] = []
    last_depth = -math.inf
    for h in ordered:
        depth = float(np.dot(h.position, n))
        if slots and depth - last_depth <= cfg.duplicate_tolerance_mm:
            offset = float(np.linalg.norm(np.subtract(h.position, slots[-1][0].position)))
            if offset > cfg.spacing_tolerance_mm:
                raise InputProblem("geometry", f"two planes at depth {depth:.3f} mm lie {offset:.2f} mm apart "
                                               "in-plane: overlapping stacks cannot form one volume")
            slots[-1].append(h)
        else:
            slots.append([h])
            last_depth = depth
    return slots


def _single_slice_step(first: SliceHeader, n: np.ndarray, flags: list[str]) -> tuple[np.ndarray, float]:
    """A 1-slice volume is valid; its z spacing comes from SpacingBetweenSlices or SliceThickness."""
    flags.append("single_slice")
    for value, name in ((first.spacing_between_slices, "spacing_between_slices"),
                        (first.slice_thickness, "slice_thickness")):
        if value is not None and value > 0:
            flags.append(f"z_spacing_from_{name}")
            return n * value, float(value)
    flags.append("z_spacing_assumed_1mm")
    return n.copy(), 1.0


def _check_regular(positions: np.ndarray, n: np.ndarray, spacing: float, cfg: IngestConfig) -> None:
    """Every slice must sit where the affine puts it; otherwise name the gap or the irregularity."""
    depths = positions @ n
    gaps = np.diff(depths)
    tol = max(cfg.spacing_tolerance_mm, cfg.spacing_tolerance_rel * spacing)
    along = depths - depths[0] - spacing * np.arange(len(depths))
    if np.max(np.abs(along)) <= tol:
        return
    for typical in (float(np.median(gaps)), float(gaps.min())):  # the usual step, else the smallest
        multiples = np.round(gaps / typical)
        if np.all(multiples >= 1) and np.all(np.abs(gaps - multiples * typical) <= tol) and np.any(multiples >= 2):
            missing = int(np.sum(multiples - 1))
            k = int(np.argmax(multiples))
            raise InputProblem(
                "geometry",
                f"irregular spacing (gap): {missing} slice(s) missing; spacing is {typical:.3f} mm but "
                f"{gaps[k]:.3f} mm between depths {depths[k]:.2f} and {depths[k + 1]:.2f} mm; policy: reject",
            )
    raise InputProblem(
        "geometry",
        f"irregular spacing: slice gaps range from {gaps.min():.3f} to {gaps.max():.3f} mm "
        f"(tolerance {tol:.3f} mm); policy: reject",
    )


def _check_tilt(positions: np.ndarray, n: np.ndarray, spacing: float, cfg: IngestConfig, flags: list[str]) -> None:
    """A stack whose positions drift in-plane is sheared (gantry tilt): reject, or keep if allowed."""
    total = positions[-1] - positions[0]
    drift = total - (total @ n) * n
    drift_mm = float(np.linalg.norm(drift))
    tol = max(cfg.spacing_tolerance_mm, cfg.spacing_tolerance_rel * abs(spacing))
    if drift_mm <= tol:
        return
    angle = math.degrees(math.atan2(drift_mm, abs(float(total @ n))))
    if cfg.tilt_policy == "shear":
        flags.append(f"sheared_{angle:.2f}deg")
        return
    raise InputProblem(
        "geometry",
        f"gantry tilt: slice positions drift {drift_mm:.2f} mm in-plane over the stack ({angle:.2f} degrees "
        "from the slice normal); policy: reject (use --tilt-policy shear to keep the sheared affine)",
    )


def _check_grid(positions: np.ndarray, step: np.ndarray, spacing: float, cfg: IngestConfig) -> None:
    """Every IPP must equal ``affine @ (0, 0, k, 1)`` in 3-D, not only along the normal."""
    predicted = positions[0] + np.outer(np.arange(len(positions)), step)
    error = np.linalg.norm(positions - predicted, axis=1)
    tol = max(cfg.spacing_tolerance_mm, cfg.spacing_tolerance_rel * abs(spacing))
    k = int(np.argmax(error))
    if error[k] > tol:
        raise InputProblem("geometry", f"slice {k} lies {error[k]:.2f} mm from its place on a regular grid "
                                       f"(in-plane shift; tolerance {tol:.3f} mm); policy: reject")

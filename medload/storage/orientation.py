"""The plane a series was cut in -- axial, coronal, sagittal or oblique -- from its direction cosines.

The slice normal is the cross product of the row and column directions (DICOM PS3.3 C.7.6.2.1.1:
ImageOrientationPatient (0020,0037) holds them; the stored affine's first two columns are the same
directions in RAS, which flips the signs of x and y only). A series is named after the patient axis its
normal is nearest to -- left-right: sagittal, posterior-anterior: coronal, inferior-superior: axial --
when the angle between them is at most :data:`TOLERANCE_DEGREES`, and is oblique otherwise.

The tolerance is 10 degrees: scanners write the cosines of a plane at 0 degrees exactly (or to the
rounding of a decimal string), so any tolerance above that separates them; viewers label a plane much
more loosely -- GDCM's ``gdcm::Orientation`` and PixelMed's ``DescriptionFactory`` accept a direction
cosine down to 0.8, 36.9 degrees off the axis -- which would call a CT with a 30 degree gantry tilt, or a
double-oblique MR slab, axial. For training input those differ from their neighbours in what a slice
shows, which is what this column is for; 10 degrees keeps a few degrees of patient-aligned positioning
inside its plane.

Examples:
    >>> series_orientation(store.series()[0])
    'axial'
    >>> plane_of(((0.0, 0.0, 1.0, 0.0), (1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0, 0, 0, 1)))  # in-plane y and z
    'sagittal'
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from medload.storage.records import SeriesRecord

__all__ = ["ORIENTATIONS", "TOLERANCE_DEGREES", "plane_of", "series_orientation"]

#: The planes a series can be in, as the catalog's ``orientation`` column and the datasets' ``orientation=``
#: filter name them.
ORIENTATIONS = ("axial", "coronal", "sagittal", "oblique")

#: Largest angle, in degrees, between the slice normal and a patient axis for the series to be in that
#: axis' plane (see the module docstring for why 10).
TOLERANCE_DEGREES = 10.0

_PLANE_OF_AXIS = ("sagittal", "coronal", "axial")  # normal along x (left-right), y (front-back), z (foot-head)


def plane_of(affine: Sequence[Sequence[float]]) -> str:
    """The plane of the slices of a grid whose affine maps ``(column, row, slice)`` to patient mm."""
    axes = np.asarray(affine, dtype=np.float64)[:3, :2]
    normal = np.cross(axes[:, 0], axes[:, 1])
    length = float(np.linalg.norm(normal))
    if not length:
        return "oblique"  # degenerate (parallel rows and columns): no plane to name
    normal = np.abs(normal) / length
    axis = int(np.argmax(normal))
    off_axis = math.degrees(math.acos(min(1.0, float(normal[axis]))))
    return _PLANE_OF_AXIS[axis] if off_axis <= TOLERANCE_DEGREES else "oblique"


def series_orientation(record: SeriesRecord) -> str:
    """The plane of a stored series (:func:`plane_of` its affine)."""
    return plane_of(record.affine)

"""What to generate (:class:`SeriesSpec`) and what was generated (:class:`GeneratedSeries`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydicom.uid import (
    UID,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLSLossless,
    RLELossless,
)

__all__ = ["SeriesSpec", "GeneratedSeries", "NATIVE_SYNTAXES", "COMPRESSED_SYNTAXES", "PADDING_HU"]

NATIVE_SYNTAXES: tuple[UID, ...] = (ExplicitVRLittleEndian, ImplicitVRLittleEndian, ExplicitVRBigEndian)
"""Uncompressed transfer syntaxes the generator writes."""

COMPRESSED_SYNTAXES: tuple[UID, ...] = (RLELossless, JPEG2000Lossless, JPEGLSLossless)
"""Lossless compressed transfer syntaxes, written through pydicom's ``Dataset.compress``."""

PADDING_HU = -1024
"""Ground-truth HU of a padding pixel (stored value == PixelPaddingValue): air, as an ingester should give."""


@dataclass(frozen=True)
class SeriesSpec:
    """Parameters of one synthetic CT series; each field names the DICOM tag it drives.

    ``pixel_spacing`` is in PixelSpacing (0028,0030) order: (row spacing, column spacing) in mm.
    ``orientation`` is ``"axial"``, ``"oblique"`` (a rotation drawn from the seed) or the six direction
    cosines of ImageOrientationPatient (0020,0037). ``positions_mm`` (offsets along the slice normal)
    overrides ``n_slices``/``slice_spacing``. ``tilt_deg`` shears slice positions along the column
    direction by tan(tilt) * offset and sets GantryDetectorTilt (0018,1120). ``multiframe`` writes one
    Enhanced CT Image Storage file instead of one CT Image Storage file per slice.
    """

    n_slices: int = 12
    rows: int = 48
    cols: int = 40
    pixel_spacing: tuple[float, float] = (0.7, 0.8)
    slice_spacing: float = 2.5
    orientation: str | tuple[float, ...] = "axial"
    origin: tuple[float, float, float] | None = None
    signed: bool = False
    bits_stored: int = 12
    rescale_slope: float = 1.0
    rescale_intercept: float = -1024.0
    per_slice_intercept: bool = False
    transfer_syntax: str = ExplicitVRLittleEndian
    modality: str = "CT"
    tilt_deg: float = 0.0
    positions_mm: tuple[float, ...] | None = None
    pixel_padding_value: int | None = None
    multiframe: bool = False
    image_type: tuple[str, ...] = ("ORIGINAL", "PRIMARY", "AXIAL")
    series_description: str = "synthetic"


@dataclass
class GeneratedSeries:
    """Files written for one series and their ground truth.

    ``paths`` lists the files in slice order (``paths[k]`` holds ``hu[k]``); a multi-frame series has
    one path. ``hu`` is int16 HU of shape (slices along the normal, Rows, Columns); pixels whose stored
    value equals PixelPaddingValue have ``PADDING_HU`` (-1024), the value an ingester should produce.
    ``ipp`` holds ImagePositionPatient (LPS mm) per slice in the same order. ``affine_ras`` maps
    (column j, row i, slice k, 1) to RAS mm: the NIfTI affine of ``hu.transpose(2, 1, 0)``.
    """

    spec: SeriesSpec
    paths: list[Path]
    hu: np.ndarray
    ipp: np.ndarray
    affine_ras: np.ndarray
    series_uid: str
    study_uid: str
    patient_id: str
    patient_name: str

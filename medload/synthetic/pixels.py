"""Stored pixel values derived from ground-truth HU, and their encoding in a transfer syntax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydicom.dataset import Dataset
from pydicom.pixels import get_encoder
from pydicom.uid import UID, ExplicitVRBigEndian, JPEG2000Lossless

from medload.errors import ConfigError
from medload.synthetic.spec import COMPRESSED_SYNTAXES, NATIVE_SYNTAXES, PADDING_HU, SeriesSpec

__all__ = ["PixelValues", "pixel_values", "set_pixel_data", "stored_range"]


@dataclass(frozen=True)
class PixelValues:
    """Stored values (slices, rows, columns), the HU they mean, and RescaleIntercept per slice."""

    stored: np.ndarray
    hu: np.ndarray
    intercepts: np.ndarray


def stored_range(bits_stored: int, signed: bool) -> tuple[int, int]:
    """Smallest and largest stored value for BitsStored (0028,0101) and PixelRepresentation (0028,0103)."""
    if not 1 <= bits_stored <= 16:
        raise ConfigError(f"bits_stored must lie in 1..16 (BitsAllocated is 16), got {bits_stored}")
    if signed:
        return -(1 << (bits_stored - 1)), (1 << (bits_stored - 1)) - 1
    return 0, (1 << bits_stored) - 1


def _stored_step(slope: float) -> int:
    """Smallest stored-value step q for which q * RescaleSlope is a whole number of HU."""
    if not (np.isfinite(slope) and slope > 0):
        raise ConfigError(f"rescale_slope must be a positive number, got {slope}")
    for q in range(1, 1001):
        if abs(q * slope - round(q * slope)) < 1e-9 and round(q * slope) >= 1:
            return q
    raise ConfigError(f"rescale_slope {slope} cannot give whole-number HU; use e.g. 1, 2 or 0.5")


def _outside_fov(rows: int, cols: int) -> np.ndarray:
    """Pixels outside the circular field of view inscribed in the image."""
    i = np.arange(rows)[:, None] + 0.5 - rows / 2.0
    j = np.arange(cols)[None, :] + 0.5 - cols / 2.0
    return i**2 + j**2 > (min(rows, cols) / 2.0) ** 2


def pixel_values(phantom: np.ndarray, spec: SeriesSpec, rng: np.random.Generator) -> PixelValues:
    """Quantise ``phantom`` to HU the rescale can represent and derive stored values exactly.

    stored = (HU - RescaleIntercept) / RescaleSlope is a whole number in the BitsStored /
    PixelRepresentation range. With ``per_slice_intercept`` each slice's RescaleIntercept (0028,1052)
    is lowered by a random whole number of HU steps, so the stored values change and the HU do not.
    With a PixelPaddingValue (0028,0120), pixels outside a circular FOV store it and have HU
    ``PADDING_HU``; a pixel inside the FOV that would store it is moved one step away.
    """
    lo, hi = stored_range(spec.bits_stored, spec.signed)
    intercept = float(spec.rescale_intercept)
    if not (np.isfinite(intercept) and intercept == round(intercept)):
        raise ConfigError(f"rescale_intercept must be a whole number of HU, got {intercept}")
    q = _stored_step(spec.rescale_slope)
    hu_step = round(q * spec.rescale_slope)
    depth = phantom.shape[0]
    deltas = -rng.integers(0, 65, depth) if spec.per_slice_intercept else np.zeros(depth, dtype=np.int64)
    intercepts = intercept + hu_step * deltas.astype(float)

    hu = intercept + hu_step * np.rint((phantom - intercept) / hu_step)
    stored = np.rint((hu - intercepts[:, None, None]) / spec.rescale_slope).astype(np.int64)
    if stored.min() < lo or stored.max() > hi:
        kind = "signed" if spec.signed else "unsigned"
        raise ConfigError(
            f"HU {int(hu.min())}..{int(hu.max())} need stored values {stored.min()}..{stored.max()}, but "
            f"{kind} BitsStored={spec.bits_stored} holds {lo}..{hi}: change rescale_intercept/slope, "
            "signed or bits_stored"
        )
    pad = spec.pixel_padding_value
    if pad is not None:
        if not lo <= pad <= hi:
            raise ConfigError(f"pixel_padding_value {pad} is outside the stored range {lo}..{hi}")
        clash = stored == pad
        stored[clash] += q if pad + q <= hi else -q
        outside = np.broadcast_to(_outside_fov(*phantom.shape[1:]), stored.shape)
        stored[outside] = pad
    hu = stored * spec.rescale_slope + intercepts[:, None, None]
    if pad is not None:
        hu[outside] = PADDING_HU
    return PixelValues(stored=stored, hu=np.rint(hu).astype(np.int16), intercepts=intercepts)


def set_pixel_data(ds: Dataset, stored: np.ndarray, transfer_syntax: str) -> None:
    """Set PixelData (7FE0,0010) from stored values and TransferSyntaxUID (0002,0010).

    ``stored`` has one frame (rows, columns) or several (frames, rows, columns). Signed values are
    written as 16-bit two's complement, so the bits above HighBit are a sign extension.
    """
    uid = UID(transfer_syntax)
    dtype = np.dtype(np.int16 if ds.PixelRepresentation else np.uint16)
    if uid in NATIVE_SYNTAXES:
        order: Literal[">", "<"] = ">" if uid == ExplicitVRBigEndian else "<"
        ds.file_meta.TransferSyntaxUID = uid
        ds.PixelData = stored.astype(dtype.newbyteorder(order)).tobytes()
        return
    if uid not in COMPRESSED_SYNTAXES:
        names = ", ".join(u.name for u in NATIVE_SYNTAXES + COMPRESSED_SYNTAXES)
        raise ConfigError(f"transfer syntax {uid} is not supported by the generator; use one of: {names}")
    encoder = get_encoder(uid)
    if not encoder.is_available:
        missing = "; ".join(encoder.missing_dependencies) or "an encoder plugin"
        raise ConfigError(f"cannot write {uid.name}: no encoder installed (missing: {missing})")
    if uid == JPEG2000Lossless and min(ds.Rows, ds.Columns) < 32:
        raise ConfigError("the openjpeg encoder uses 6 wavelet levels: JPEG 2000 needs Rows and Columns >= 32")
    ds.compress(uid, stored.astype(dtype), generate_instance_uid=False)

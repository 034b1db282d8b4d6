"""Pixel decoding: stored values to modality values (HU for CT), exactly.

Steps, per plane, following DICOM PS3.3 C.7.6.3 (Image Pixel) and C.11.1 (Modality LUT):

1. Stored values. Native syntaxes are read straight from the file (from its inflated dataset for
   the deflated syntax, :mod:`medload.ingest.deflated`) at the offset the header pass recorded (byte
   order normalised; big endian swapped). Compressed syntaxes (RLE, JPEG, JPEG-LS, JPEG 2000) decode
   through pydicom's plugins, each frame checked complete first (:mod:`medload.ingest.codestreams`).
2. Bits: values are shifted down to HighBit (0028,0102), masked to BitsStored (0028,0101) and, when
   PixelRepresentation (0028,0103) is 1, sign-extended from bit BitsStored-1.
3. PixelPaddingValue (0028,0120) [.. PixelPaddingRangeLimit (0028,0121)] marks pixels outside the
   reconstructed field of view. They become -1024 HU (air) for CT and 0 otherwise, and are counted.
4. MONOCHROME1 (0028,0004) means "low values display white". It changes values only where no Modality
   LUT gives them physical meaning (no RescaleSlope/Intercept, e.g. MR): stored values are inverted
   within their range so that high means bright. CT HU and PET values are never inverted -- the
   rescale defines them, and photometric interpretation applies after it, at display.
5. Modality LUT: value = stored * RescaleSlope + RescaleIntercept, per plane (slopes and intercepts
   may differ between slices). Integral rescales stay integers (int16 HU, checked to fit); others
   become float32 -- never rounded. A Modality LUT Sequence (0028,3000) replaces the rescale, applied
   as pydicom's ``apply_modality_lut`` does (:mod:`medload.ingest.modality_lut`).
"""

from __future__ import annotations

import io

import numpy as np
import pydicom
from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRBigEndian

from medload.errors import InputProblem
from medload.ingest.codestreams import decode_frame
from medload.ingest.deflated import inflate_pixels
from medload.ingest.headers import SliceHeader
from medload.ingest.modality_lut import apply_modality_lut, lut_range

__all__ = ["LoadedFile", "decode_plane", "fits_int16", "PADDING_FILL"]

#: value given to padding pixels, by modality
PADDING_FILL = {"CT": -1024}
_INT16 = np.iinfo(np.int16)


def _stored_range(h: SliceHeader) -> tuple[int, int]:
    if h.pixel_representation == 1:
        return -(1 << (h.bits_stored - 1)), (1 << (h.bits_stored - 1)) - 1
    return 0, (1 << h.bits_stored) - 1


def _bits(values: np.ndarray, h: SliceHeader, *, shift: bool) -> np.ndarray:
    """Exact stored values: shift down to HighBit, mask to BitsStored, sign-extend when signed.

    Works in the array's own width (no widening), so the common 16-bit cases cost one pass or none.
    """
    width = values.dtype.itemsize * 8
    raw = values.view(np.dtype(f"u{values.dtype.itemsize}"))
    if shift and h.high_bit + 1 != h.bits_stored:
        raw = raw >> (h.high_bit + 1 - h.bits_stored)
    spare = width - h.bits_stored
    if h.pixel_representation == 1:
        signed = np.dtype(f"i{values.dtype.itemsize}")
        return raw.view(signed) if spare == 0 else (raw << spare).view(signed) >> spare
    return raw if spare == 0 else raw & ((1 << h.bits_stored) - 1)


def _native(data: memoryview, h: SliceHeader, pixel_offset: int) -> np.ndarray:
    """The plane of a native (uncompressed) file whose pixel values start at ``pixel_offset``."""
    item = h.bits_allocated // 8
    offset = pixel_offset + (h.frame or 0) * h.frame_bytes
    raw = np.frombuffer(data, dtype=f"<u{item}", count=h.rows * h.cols, offset=offset)
    if h.transfer_syntax == ExplicitVRBigEndian and item > 1:
        raw = raw.byteswap()
    return _bits(raw, h, shift=True).reshape(h.rows, h.cols)


class LoadedFile:
    """The bytes of one source file, parsed at most once (frames of a compressed multi-frame object
    share one parse)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._dataset: pydicom.Dataset | None = None
        self._inflated: bytes | None = None

    def native(self, h: SliceHeader) -> memoryview:
        """The bytes ``h.pixel_offset`` counts in: the file's, or its inflated dataset's for the deflated
        syntax (inflated no further than its last plane, see :mod:`medload.ingest.deflated`)."""
        if h.transfer_syntax != DeflatedExplicitVRLittleEndian:
            return memoryview(self.data)
        if self._inflated is None:
            self._inflated = inflate_pixels(self.data, (h.pixel_offset or 0) + h.number_of_frames * h.frame_bytes)
        return memoryview(self._inflated)

    @property
    def dataset(self) -> pydicom.Dataset:
        if self._dataset is None:
            try:
                self._dataset = pydicom.dcmread(io.BytesIO(self.data))
            except Exception as exc:
                raise InputProblem("decode", f"cannot parse the file for decoding: {type(exc).__name__}: {exc}") from None
        return self._dataset


def _compressed(file: LoadedFile, h: SliceHeader) -> np.ndarray:
    pixel_data = file.dataset.get("PixelData")
    if not isinstance(pixel_data, bytes):
        raise InputProblem("decode", "no Pixel Data (7FE0,0010) to decode")
    arr = decode_frame(pixel_data, h.frame or 0, h.number_of_frames, h.transfer_syntax, rows=h.rows, columns=h.cols,
                       samples_per_pixel=h.samples_per_pixel, bits_allocated=h.bits_allocated,
                       bits_stored=h.bits_stored, pixel_representation=h.pixel_representation,
                       photometric_interpretation=h.photometric)
    if arr.shape != (h.rows, h.cols):
        raise InputProblem("decode", f"decoded frame has shape {arr.shape}, header says {h.rows} x {h.cols}")
    return _bits(arr, h, shift=False)


def _stored_scalar(value: int, h: SliceHeader) -> int:
    """A header value in stored-pixel units (PixelPaddingValue may be read as US for signed data)."""
    width = 16 if h.bits_stored <= 16 else 32
    return int(_bits(np.array([value & ((1 << width) - 1)], dtype=f"u{width // 8}"), h, shift=False)[0])


def fits_int16(h: SliceHeader, modality: str) -> bool:
    """Whether every possible stored value, rescaled (and padding fill), fits int16: no range scan needed."""
    lo, hi = lut_range(h.modality_lut) if h.modality_lut is not None else _stored_range(h)
    ends = (lo * h.slope + h.intercept, hi * h.slope + h.intercept, PADDING_FILL.get(modality, 0))
    return _INT16.min <= min(ends) and max(ends) <= _INT16.max


def _rescale_int(stored: np.ndarray, h: SliceHeader, modality: str) -> np.ndarray:
    """Integral rescale. When every stored value and every result fits int16 (known from the header),
    compute in int16 in one pass -- wrap-around in an intermediate product is harmless, since the
    final value is known to fit; otherwise widen and let the caller check the range."""
    lo, hi = _stored_range(h)
    if fits_int16(h, modality) and _INT16.min <= lo and hi <= _INT16.max:
        s16 = stored.view(np.int16) if stored.dtype.itemsize == 2 else stored.astype(np.int16)
        values = np.empty(stored.shape, dtype=np.int16)
        if h.slope == 1:
            np.add(s16, np.int16(h.intercept), out=values)
        else:
            np.multiply(s16, np.int16(h.slope), out=values)
            values += np.int16(h.intercept)
        return values
    values = stored.astype(np.int64 if stored.dtype.itemsize > 2 else np.int32)
    if h.slope != 1:
        values *= int(h.slope)
    if h.intercept:
        values += int(h.intercept)
    return values


def decode_plane(file: LoadedFile, h: SliceHeader, modality: str, dtype: str) -> tuple[np.ndarray, int]:
    """Decode one plane of a loaded file to modality values.

    Returns ``(values, padding_pixels)``: a (rows, columns) array of ``dtype`` (``int16`` or
    ``float32``) and how many pixels were padding. Raises :class:`InputProblem` (stage ``decode``).
    """
    pixel_offset = h.pixel_offset  # set for native syntaxes only (see medload.ingest.headers)
    stored = _native(file.native(h), h, pixel_offset) if pixel_offset is not None else _compressed(file, h)
    padding = None
    if h.padding_value is not None:
        pad, limit = (_stored_scalar(v, h) for v in (h.padding_value, h.padding_limit or h.padding_value))
        padding = (stored >= min(pad, limit)) & (stored <= max(pad, limit))
    if h.photometric == "MONOCHROME1" and not h.has_rescale:
        lo, hi = _stored_range(h)
        stored = (lo + hi) - stored
    if h.modality_lut is not None:
        values = apply_modality_lut(stored, h.modality_lut).astype(np.int16 if dtype == "int16" else np.float64)
    elif dtype == "int16":
        values = _rescale_int(stored, h, modality)
    else:
        values = stored * np.float64(h.slope) + np.float64(h.intercept)
    n_padding = 0
    if padding is not None:
        n_padding = int(padding.sum())
        values[padding] = PADDING_FILL.get(modality, 0)
    if dtype != "int16":
        return values.astype(np.float32), n_padding
    if values.dtype != np.int16:
        lo_v, hi_v = int(values.min()), int(values.max())
        if lo_v < _INT16.min or hi_v > _INT16.max:
            raise InputProblem("decode", f"values {lo_v}..{hi_v} do not fit int16 (RescaleSlope {h.slope}, "
                                         f"RescaleIntercept {h.intercept}): implausible for {modality or 'this modality'}")
        values = values.astype(np.int16)
    return values, n_padding

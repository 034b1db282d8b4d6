"""Test-only: synthetic CT slices re-encoded in every compressed transfer syntax medload decodes.

pydicom's encoders write RLE, JPEG-LS (CharLS) and JPEG 2000 (OpenJPEG); baseline JPEG comes from
Pillow (libjpeg-turbo), 8-bit, with and without restart intervals, and "extended" is the same
codestream labelled SOF1 (an 8-bit extended-process frame, T.81 B.2.2). Lossless JPEG (process 14)
has no encoder here: its cases are the real files of tests/scans/transfer_syntaxes.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.encaps import encapsulate
from pydicom.uid import (
    JPEG2000,
    DeflatedExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)

from medload.synthetic import SeriesSpec, make_series

#: kind -> (transfer syntax, lossless, end marker of its codestream)
KINDS = {
    "jpeg_baseline": (JPEGBaseline8Bit, False, b"\xff\xd9"),
    "jpeg_baseline_restarts": (JPEGBaseline8Bit, False, b"\xff\xd9"),
    "jpeg_extended": (JPEGExtended12Bit, False, b"\xff\xd9"),
    "jpegls_lossless": (JPEGLSLossless, True, b"\xff\xd9"),
    "jpegls_near_lossless": (JPEGLSNearLossless, False, b"\xff\xd9"),
    "j2k_lossless": (JPEG2000Lossless, True, b"\xff\xd9"),
    "j2k": (JPEG2000, False, b"\xff\xd9"),
    "rle": (RLELossless, True, b""),
    "deflated": (DeflatedExplicitVRLittleEndian, True, b""),
}


def _jpeg(values: np.ndarray, *, restarts: bool, extended: bool) -> bytes:
    out = io.BytesIO()
    options = {"restart_marker_blocks": 5} if restarts else {}
    Image.fromarray(values).save(out, format="JPEG", quality=90, **options)
    data = out.getvalue()
    if extended:
        at = data.find(b"\xff\xc0")
        data = data[:at] + b"\xff\xc1" + data[at + 2 :]
    return data


def encode(ds: pydicom.Dataset, kind: str) -> None:
    """Re-encode the native single-frame ``ds`` in place as ``kind`` (one of :data:`KINDS`)."""
    syntax = KINDS[kind][0]
    stored = ds.pixel_array
    if kind.startswith("jpeg_"):
        values = (stored >> 4).astype(np.uint8)
        ds.BitsAllocated = ds.BitsStored = 8
        ds.HighBit, ds.PixelRepresentation = 7, 0
        ds.PixelData = encapsulate([_jpeg(values, restarts=kind.endswith("restarts"), extended=kind.endswith("extended"))])
        ds["PixelData"].VR = "OB"
        ds.file_meta.TransferSyntaxUID = syntax
    elif kind == "deflated":
        ds.file_meta.TransferSyntaxUID = syntax
    elif kind == "jpegls_near_lossless":
        ds.compress(syntax, stored, jls_error=3, generate_instance_uid=False)
    elif kind == "j2k":
        ds.compress(syntax, stored, j2k_cr=[20], generate_instance_uid=False)
    else:
        ds.compress(syntax, stored, generate_instance_uid=False)


def to_bytes(ds: pydicom.Dataset) -> bytes:
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


def write_series(folder: Path, kind: str, *, n_slices: int = 12, seed: int = 0) -> list[Path]:
    """A 64 x 64 CT series of ``n_slices`` files in ``folder``, encoded as ``kind``."""
    gen = make_series(folder, SeriesSpec(n_slices=n_slices, rows=64, cols=64), seed=seed)
    for path in gen.paths:
        ds = pydicom.dcmread(path)
        encode(ds, kind)
        path.write_bytes(to_bytes(ds))
    return gen.paths

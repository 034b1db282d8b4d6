"""The header pass: parse each file up to Pixel Data, keep what grouping, geometry and decoding need.

One :class:`SliceHeader` per image plane (one per frame of an Enhanced multi-frame object, see
:mod:`medload.ingest.multiframe`). Identifiers are pseudonymised here, in the worker, so raw UIDs and
patient IDs never leave this function. For native (uncompressed) transfer syntaxes the header records
where the pixel values start, so the decode pass reads them with one ``read`` and no second parse.
A file's first :data:`_HEAD` bytes are read at once and the header is parsed from them, in memory, when
they hold it (all of a small file; the header of most others); otherwise from the whole file, read no
further than its size: a damaged element's declared length never makes it allocate more.
Declared sizes are checked before any pixel is decoded: Rows x Columns x
NumberOfFrames against the caps, native Pixel Data against its declared length and the file size,
and encapsulated Pixel Data item by item (:mod:`medload.ingest.encapsulated`).
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Callable
from typing import BinaryIO, NamedTuple, cast

import pydicom
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.errors import InvalidDicomError
from pydicom.filereader import read_dataset
from pydicom.uid import (
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
)

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest import tags
from medload.ingest.deflated import may_be_deflated, read_deflated
from medload.ingest.discover import SourceRef, open_source, read_source
from medload.ingest.encapsulated import check_encapsulated
from medload.ingest.labels import LABEL_SOP_CLASSES, LabelInput, label_input_from_dataset
from medload.ingest.modality_lut import read_modality_lut
from medload.ingest.planes import frame_plane_fields, has_functional_groups, plane_fields

__all__ = ["SliceHeader", "read_headers", "VOLUME_SOP_CLASSES", "NATIVE_SYNTAXES"]

#: SOP classes whose images stack into volumes; everything else is skipped with its name as reason.
VOLUME_SOP_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.2": "CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.2.1": "Enhanced CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.2.2": "Legacy Converted Enhanced CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.4": "MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.4.1": "Enhanced MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.4.4": "Legacy Converted Enhanced MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.128": "Positron Emission Tomography Image Storage",
    "1.2.840.10008.5.1.4.1.1.128.1": "Legacy Converted Enhanced PET Image Storage",
    "1.2.840.10008.5.1.4.1.1.130": "Enhanced PET Image Storage",
}
#: Syntaxes whose pixel values are read straight from the (inflated) dataset, at ``pixel_offset``
NATIVE_SYNTAXES = {ExplicitVRLittleEndian, ImplicitVRLittleEndian, ExplicitVRBigEndian, DeflatedExplicitVRLittleEndian}
_PIXEL_DATA_TAG = (0x7FE0, 0x0010)
_PIXEL_LE, _PIXEL_BE = b"\xe0\x7f\x10\x00", b"\x7f\xe0\x00\x10"
#: Bytes of a file read at once: its header is parsed from them, in memory, when they hold it all (CT
#: headers take a few KB; reading 64 KB instead of 32 KB costs ~2 % of the header pass)
_HEAD = 1 << 15
_LONG_LENGTH_VRS = {b"OB", b"OW", b"OF", b"OD", b"OL", b"OV", b"SQ", b"UN", b"UC", b"UR", b"UT"}


class SliceHeader(NamedTuple):
    """What the ingest needs to know about one image plane, with identities already pseudonymised.

    A named tuple, not a frozen dataclass: the ingest process receives every plane's header from the
    header processes, and a frozen dataclass's constructor (one ``object.__setattr__`` per field) was 5 of
    the 7 us it took to unpickle one; a tuple is built in one call. The ingest process's CPU in the header
    pass fell from 0.020-0.022 to 0.013-0.015 ms per file (``benchmarks/ingest_serial.py``, 2 workers).
    """

    ref: SourceRef
    frame: int | None            # frame index in a multi-frame object, None for a single-frame file
    sop_class: str
    instance: str                # pseudonym of SOPInstanceUID
    series: str                  # pseudonym of SeriesInstanceUID
    frame_of_reference: str      # pseudonym of FrameOfReferenceUID ("" if absent)
    study: str
    patient: str
    modality: str
    image_type: tuple[str, ...]
    rows: int
    cols: int
    samples_per_pixel: int
    photometric: str
    bits_allocated: int
    bits_stored: int
    high_bit: int
    pixel_representation: int
    slope: float
    intercept: float
    has_rescale: bool            # a Modality LUT rescale (0028,1052/1053) is present
    padding_value: int | None    # PixelPaddingValue (0028,0120)
    padding_limit: int | None    # PixelPaddingRangeLimit (0028,0121)
    orientation: tuple[float, ...]       # ImageOrientationPatient (0020,0037), 6 cosines, LPS
    position: tuple[float, float, float]  # ImagePositionPatient (0020,0032), LPS mm
    pixel_spacing: tuple[float, float]   # PixelSpacing (0028,0030): (row spacing, column spacing)
    slice_thickness: float | None
    spacing_between_slices: float | None
    transfer_syntax: str
    pixel_offset: int | None     # file offset of the first pixel value (native syntaxes), else None
    number_of_frames: int
    echo: str                    # EchoNumbers (0018,0086), "" if absent
    stack: str                   # StackID (0020,9056) of an Enhanced object, "" if absent
    file_size: int
    manufacturer: str | None = None
    model: str | None = None
    kernel: str | None = None
    body_part: str | None = None
    window: tuple[tuple[float, float], ...] = ()   # scanner WindowCenter/WindowWidth pairs
    frame_type: tuple[str, ...] = ()  # FrameType + ComplexImageComponent of an Enhanced frame
    echo_time: str = ""               # EffectiveEchoTime / EchoTime as written
    diffusion: str = ""               # "b-value|gradient direction" ("" when neither is present)
    times: tuple[str, ...] = ()       # values of planes.TIME_ATTRIBUTES ("" absent; clock times as seconds from 0001-01-01, or of the day)
    modality_lut: tuple[int, bytes] | None = None  # Modality LUT Sequence: (first mapped value, uint16 entries)
    instance_number: int | None = None  # InstanceNumber (0020,0013): the last resort to order time points
    gradient_frame: str = ""          # frame of the direction in ``diffusion``: "patient" (LPS) or "image"
    vendor_time: str = ""             # a vendor's private timer (medload.ingest.vendor), seconds
    dimensions: tuple[tuple[str, str], ...] = ()  # (dimension, index) of DimensionIndexValues not read otherwise

    @property
    def frame_bytes(self) -> int:
        return self.rows * self.cols * self.samples_per_pixel * (self.bits_allocated // 8)

    def __reduce__(self) -> tuple[Callable[..., SliceHeader], tuple[object, ...]]:
        """Pickled as its values, rebuilt by ``tuple.__new__`` (a named tuple's own ``__new__`` is a Python
        function of 48 arguments)."""
        return tuple.__new__, (SliceHeader, tuple(self))


def read_headers(ref: SourceRef, pseudo: Pseudonymizer, cfg: IngestConfig) -> list[SliceHeader] | LabelInput:
    """Parse one file's header: one SliceHeader per image plane, or the LabelInput of a SEG/RTSTRUCT.
    Raises :class:`InputProblem`."""
    with _open(ref) as fp:
        ds, body, size, pixel_pos = _dataset(fp, ref)
        sop_class = str(ds.get("SOPClassUID", "") or getattr(ds.file_meta, "MediaStorageSOPClassUID", "") or "")
        if not sop_class:
            raise InputProblem("header", "no SOPClassUID (0008,0016): not a DICOM image")
        if sop_class in LABEL_SOP_CLASSES:
            return label_input_from_dataset(ds, ref, sop_class, pseudo)
        if sop_class not in VOLUME_SOP_CLASSES:
            raise InputProblem("header", f"{UID(sop_class).name} ({sop_class}) is not a CT/MR/PET volume image",
                               skipped=True)
        syntax = _transfer_syntax(ds)
        length, value_offset = _pixel_element(body, pixel_pos, syntax)
        if length is None:
            raise InputProblem("header", "no Pixel Data (7FE0,0010) in an image object")
        base = _base_fields(ds, ref, pseudo, sop_class, syntax)
        frames = tags.integer(ds, "NumberOfFrames", default=1)
        _check_sizes(base, frames, length, value_offset, size, syntax, cfg)
        if syntax not in NATIVE_SYNTAXES:
            end = ref.size if length == 0xFFFFFFFF else value_offset + length
            check_encapsulated(fp, value_offset, end, ref.size, syntax, base["rows"], base["cols"],
                               base["samples_per_pixel"], base["bits_allocated"] // 8, frames)
    base["pixel_offset"] = value_offset if syntax in NATIVE_SYNTAXES else None
    base["number_of_frames"] = frames
    if has_functional_groups(ds):
        if "ModalityLUTSequence" in ds:
            raise InputProblem("header", "Modality LUT Sequence (0028,3000) at the top of an Enhanced object (its "
                                         "frames take PixelValueTransformationSequence): not applied, so refused")
        return [SliceHeader(frame=i, **base, **plane) for i, plane in enumerate(frame_plane_fields(ds, frames))]
    plane = plane_fields(ds)
    lut = read_modality_lut(ds)
    if lut is not None:  # the LUT replaces the rescale (pydicom's apply_modality_lut)
        plane.update(slope=1.0, intercept=0.0, has_rescale=True)
    return [SliceHeader(frame=None, **base, **plane, modality_lut=lut)]


class _Bounded:
    """A file whose ``read(n)`` never asks for more than is left. pydicom reads a damaged element's
    declared length at once, and a buffered file allocates the whole request first (up to 4 GB).
    ``head``: its first :data:`_HEAD` bytes (None if they could not be read)."""

    def __init__(self, file: BinaryIO, size: int, head: bytes | None) -> None:
        self._file, self._size, self._pos, self.head = file, size, 0, head

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._size - self._pos)
        data = self._file.read(left if n is None or n < 0 or n > left else n)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = self._file.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __enter__(self) -> _Bounded:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _open(ref: SourceRef) -> BinaryIO:
    """The file, read no further than its size: in memory if its first :data:`_HEAD` bytes are all of it (an
    archive member: always), else a :class:`_Bounded` file."""
    if ref.member is not None:
        return io.BytesIO(read_source(ref))
    file = open_source(ref)
    try:
        head: bytes | None = os.pread(file.fileno(), min(ref.size, _HEAD), 0)
    except OSError:
        head = None  # the parse of the whole file meets the error, and reports it
    if head is not None and len(head) == ref.size:
        file.close()
        return io.BytesIO(head)
    return cast(BinaryIO, _Bounded(file, ref.size, head))


def _dataset(fp: BinaryIO, ref: SourceRef) -> tuple[Dataset, BinaryIO, int, int]:
    """The dataset up to Pixel Data, the file or inflated dataset (:mod:`medload.ingest.deflated`) its
    positions are in, the size of that, and where Pixel Data starts."""
    parsed = _parse_head(fp.head) if isinstance(fp, _Bounded) else None
    if parsed is not None:
        ds, head = parsed
        return ds, head, ref.size, head.tell()
    deflated = read_deflated(fp, ref.display)
    if deflated is not None:
        inflated, data, pixel_pos = deflated
        _check_complete(inflated)
        return inflated, io.BytesIO(data), len(data), pixel_pos
    ds = _parse(fp)
    return ds, fp, ref.size, fp.tell()


def _parse_head(head: bytes | None) -> tuple[Dataset, io.BytesIO] | None:
    """The dataset parsed from the first bytes of a longer file, with those bytes positioned at Pixel Data,
    when they hold the whole header: pydicom read them in order, without error, up to an element that stops
    it whose tag, VR and length lie inside them -- the very bytes it reads in the whole file. None
    otherwise, and for a file that may be deflated: the whole file is parsed then (as any file was before)."""
    if head is None or may_be_deflated(head) or not (_PIXEL_LE in head or _PIXEL_BE in head):
        return None  # (the last: the header goes on past them)
    fp = io.BytesIO(head)
    try:
        ds = pydicom.dcmread(fp, stop_before_pixels=True)
        _check_complete(ds)
    except Exception:  # noqa: BLE001 -- the parse of the whole file reports it
        return None
    return (ds, fp) if fp.tell() + 12 <= len(head) else None


def _parse(fp: BinaryIO) -> Dataset:
    ds: Dataset
    try:
        ds = pydicom.dcmread(fp, stop_before_pixels=True)
    except InvalidDicomError:
        ds = _parse_without_preamble(fp)
    except Exception as exc:  # pydicom raises many types on damaged headers
        if _starts_with_dataset(fp):
            return _parse_without_preamble(fp, dicm_inside=True)
        raise InputProblem("header", f"unreadable DICOM header: {type(exc).__name__}: {exc}") from None
    try:
        _check_complete(ds)
    except InputProblem:
        if _starts_with_dataset(fp):
            return _parse_without_preamble(fp, dicm_inside=True)
        raise
    return ds


def _starts_with_dataset(fp: BinaryIO) -> bool:
    """Whether the file starts with an element of group 0002 or 0008 (little endian) where a preamble would
    be: a dataset without preamble whose bytes 128..132 happen to read "DICM" (PS3.10 7.1)."""
    fp.seek(0)
    head = fp.read(4)
    return len(head) == 4 and int.from_bytes(head[:2], "little") in (0x0002, 0x0008) and head[2:] != b"\0\0"


def _parse_without_preamble(fp: BinaryIO, *, dicm_inside: bool = False) -> Dataset:
    """Some old exports lack the "DICM" preamble: accept such a file only if it parses as an image.
    ``dicm_inside``: the file has "DICM" at byte 128, but as part of a dataset that starts at byte 0."""
    fp.seek(0)
    try:
        ds = _read_bare_dataset(fp) if dicm_inside else pydicom.dcmread(fp, stop_before_pixels=True, force=True)
        if "SOPClassUID" not in ds or "Rows" not in ds:
            raise ValueError
        str(ds.SOPClassUID)
        _check_complete(ds)
    except Exception:
        if dicm_inside:
            raise InputProblem("header", 'no DICOM preamble: the file starts with a dataset and its "DICM" at byte '
                                         "128 is part of that data, not the Part 10 marker; that dataset cannot be "
                                         "parsed as an image") from None
        raise InputProblem("header", "not a DICOM file (no DICM preamble and no parsable image header)") from None
    return ds


def _read_bare_dataset(fp: BinaryIO) -> Dataset:
    """The dataset from byte 0 up to Pixel Data, read without looking for a preamble (pydicom would take
    the "DICM" at 128 for one); explicit VR when the first element carries a VR of two capitals."""
    head = fp.read(6)
    fp.seek(0)
    implicit = not (len(head) == 6 and head[4:6].isalpha() and head[4:6].isupper())
    ds = read_dataset(fp, implicit, True, stop_when=lambda tag, vr, length: tag >= 0x7FE00010)
    ds.file_meta = FileMetaDataset()
    ds.set_original_encoding(implicit, True)
    return ds


def _check_complete(ds: Dataset) -> None:
    """Raise if the file ends inside its last element (of the dataset, or of the file meta information if
    the dataset is empty): pydicom keeps the shorter value without a word."""
    group = ds if len(ds) else getattr(ds, "file_meta", None)
    if not group:
        return
    last = group.get_item(list(group.keys())[-1])  # keys() is typed as a set: no reversed()
    if isinstance(last, RawDataElement) and last.length != 0xFFFFFFFF and len(last.value or b"") < last.length:
        raise InputProblem("header", f"truncated file: element ({last.tag.group:04X},{last.tag.element:04X}) "
                                     f"declares {last.length} bytes, the file holds {len(last.value or b'')}")


def _transfer_syntax(ds: Dataset) -> str:
    syntax = getattr(ds.file_meta, "TransferSyntaxUID", None) if hasattr(ds, "file_meta") else None
    if syntax:
        return str(syntax)
    implicit, little = ds.original_encoding
    if implicit:
        return ImplicitVRLittleEndian
    return ExplicitVRLittleEndian if little else ExplicitVRBigEndian


def _pixel_element(fp: BinaryIO, pos: int, syntax: str) -> tuple[int | None, int]:
    """(value length, value offset) of the Pixel Data element at ``pos``; (None, pos) if there is none."""
    fp.seek(pos)
    head = fp.read(12)
    if len(head) < 8:
        return None, pos
    endian = ">" if syntax == ExplicitVRBigEndian else "<"
    if struct.unpack(endian + "HH", head[:4]) != _PIXEL_DATA_TAG:
        return None, pos
    if syntax == ImplicitVRLittleEndian:
        return struct.unpack("<I", head[4:8])[0], pos + 8
    if head[4:6] in _LONG_LENGTH_VRS:
        if len(head) < 12:
            return None, pos
        return struct.unpack(endian + "I", head[8:12])[0], pos + 12
    return struct.unpack(endian + "H", head[6:8])[0], pos + 8


def _check_sizes(base: dict, frames: int, length: int, value_offset: int, file_size: int, syntax: str,
                 cfg: IngestConfig) -> None:
    rows, cols = base["rows"], base["cols"]
    if rows < 1 or cols < 1:
        raise InputProblem("header", f"Rows x Columns is {rows} x {cols}")
    if rows * cols > cfg.max_frame_pixels or not 1 <= frames <= cfg.max_frames:
        raise InputProblem("header", f"{rows} x {cols} x {frames} frames is above the caps "
                                     f"({cfg.max_frame_pixels} pixels per frame, {cfg.max_frames} frames)")
    if base["bits_allocated"] not in (8, 16, 32) or not 1 <= base["bits_stored"] <= base["bits_allocated"]:
        raise InputProblem("header", f"BitsAllocated {base['bits_allocated']} / BitsStored {base['bits_stored']} "
                                     "is not a supported integer pixel format")
    if base["samples_per_pixel"] != 1 or base["photometric"] not in ("MONOCHROME1", "MONOCHROME2"):
        raise InputProblem("header", f"colour image ({base['photometric']}, {base['samples_per_pixel']} samples) "
                                     "is not a CT/MR/PET volume", skipped=True)
    if length != 0xFFFFFFFF and value_offset + length > file_size:
        raise InputProblem("header", f"Pixel Data (7FE0,0010) declares {length} bytes from offset {value_offset} "
                                     f"but the file has {file_size} bytes: truncated file or damaged length")
    if syntax not in NATIVE_SYNTAXES:
        return  # encapsulated: see medload.ingest.encapsulated
    if length == 0xFFFFFFFF:
        raise InputProblem("header", "Pixel Data (7FE0,0010) has undefined length in a native (uncompressed) "
                                     "transfer syntax: damaged")
    needed = rows * cols * frames * (base["bits_allocated"] // 8)
    if length < needed:
        raise InputProblem("header", f"Pixel Data holds {length} bytes; {rows} x {cols} x {frames} frames "
                                     f"of {base['bits_allocated']} bits need {needed}")


def _base_fields(ds: Dataset, ref: SourceRef, pseudo: Pseudonymizer, sop_class: str, syntax: str) -> dict:
    """Fields shared by every frame of the object."""
    series_uid = tags.text(ds, "SeriesInstanceUID")
    if not series_uid:
        raise InputProblem("header", "no SeriesInstanceUID (0020,000E): cannot group it into a series")
    bits_allocated = tags.integer(ds, "BitsAllocated", default=16)
    bits_stored = tags.integer(ds, "BitsStored", default=bits_allocated)
    return dict(
        ref=ref,
        sop_class=sop_class,
        instance=pseudo.uid("instance", tags.text(ds, "SOPInstanceUID") or ref.display),
        series=pseudo.uid("series", series_uid),
        frame_of_reference=_pseudonym_or_empty(pseudo, "frame_of_reference", tags.text(ds, "FrameOfReferenceUID")),
        study=pseudo.uid("study", tags.text(ds, "StudyInstanceUID") or ""),
        patient=pseudo.patient(tags.text(ds, "PatientID") or "", tags.text(ds, "IssuerOfPatientID") or ""),
        modality=(tags.text(ds, "Modality") or "").upper(),
        image_type=tags.strings(ds, "ImageType"),
        rows=tags.integer(ds, "Rows", default=0),
        cols=tags.integer(ds, "Columns", default=0),
        samples_per_pixel=tags.integer(ds, "SamplesPerPixel", default=1),
        photometric=(tags.text(ds, "PhotometricInterpretation") or "MONOCHROME2").upper(),
        bits_allocated=bits_allocated,
        bits_stored=bits_stored,
        high_bit=tags.integer(ds, "HighBit", default=bits_stored - 1),
        pixel_representation=tags.integer(ds, "PixelRepresentation", default=0),
        padding_value=tags.integer(ds, "PixelPaddingValue", default=None),
        padding_limit=tags.integer(ds, "PixelPaddingRangeLimit", default=None),
        transfer_syntax=syntax,
        echo=tags.text(ds, "EchoNumbers") or "",
        file_size=ref.size,
        manufacturer=tags.text(ds, "Manufacturer"),
        model=tags.text(ds, "ManufacturerModelName"),
        kernel=tags.text(ds, "ConvolutionKernel"),  # case kept: Siemens kernels differ by case (B30f)
        body_part=tags.text(ds, "BodyPartExamined"),
        window=tags.window_pairs(ds),
    )



def _pseudonym_or_empty(pseudo: Pseudonymizer, kind: str, uid: str | None) -> str:
    return pseudo.uid(kind, uid) if uid else ""

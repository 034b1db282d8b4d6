"""Broken variants of one valid DICOM file, byte for byte: what damaged disks, interrupted copies,
buggy exporters and hostile senders produce.

Every function takes the bytes of a valid single-frame file (explicit VR little endian, or
encapsulated for :func:`codestream_size`, :func:`rle_segments`, :func:`fragment_overrun`,
:func:`bad_item`, :func:`cut_codestream`) and returns broken bytes an ingester must quarantine: the damage is chosen where it
is certain to be detectable (a flipped bit in a person's name is harmless and is not made here;
:func:`random_flips` makes such damage on purpose, with no promise). :func:`deflate_bomb` writes a
Deflated Explicit VR Little Endian file whose dataset inflates to gigabytes.
"""

from __future__ import annotations

import copy
import io
import struct
import zlib

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate, generate_frames
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset, write_file_meta_info
from pydicom.uid import DeflatedExplicitVRLittleEndian

from medload.errors import ConfigError

__all__ = ["HEADER_TARGETS", "WRONG_VRS", "with_uids", "element_offset", "truncate", "flip_header", "flip_sign_bits",
           "set_pixel_data_length", "wrong_vr", "codestream_size", "rle_segments", "fragment_overrun", "bad_item",
           "random_flips", "cut_codestream", "deflate_bomb"]

_PIXEL_DATA = 0x7FE00010
_ITEM = b"\xfe\xff\x00\xe0"

#: Header bytes whose damage is always detectable, by name; see :func:`flip_header`.
HEADER_TARGETS = ("preamble magic", "Pixel Data tag", "Pixel Data VR", "Pixel Data length", "Rows high byte",
                  "Columns high byte", "BitsAllocated")

#: (tag, VR in the file, wrong VR, value) -- values no reader can take for that attribute.
WRONG_VRS = (
    (0x00280010, b"US", b"DS", b"abc "),                     # Rows as text that is no number
    (0x00280011, b"US", b"US", b"\x10\x00\x00"),             # Columns with 3 bytes
    (0x00280100, b"US", b"CS", b"SIXTEEN "),                 # BitsAllocated as a word
    (0x00200032, b"DS", b"US", b"\x01\x00\x02\x00"),         # ImagePositionPatient: 2 binary values
    (0x00200037, b"DS", b"FL", struct.pack("<2f", 1, 0)),    # ImageOrientationPatient: 2 floats
    (0x00280030, b"DS", b"SS", b"\x01\x00\x01\x00\x01\x00"),  # PixelSpacing: 3 binary values
    (0x00281053, b"DS", b"UL", b"\x01\x00"),                 # RescaleSlope: 2 bytes of a 4-byte UL
)


def _renamed(template: Dataset, key: str) -> Dataset:
    """A copy of ``template`` with its own Series and SOP Instance UIDs, derived from ``key``."""
    ds = copy.deepcopy(template)
    ds.SeriesInstanceUID = pydicom.uid.generate_uid(entropy_srcs=["medload-broken-series", key])
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid(
        entropy_srcs=["medload-broken-instance", key])
    return ds


def with_uids(template: Dataset, key: str) -> bytes:
    """``template`` as a Part 10 file with its own Series and SOP Instance UIDs, derived from ``key``."""
    out = io.BytesIO()
    _renamed(template, key).save_as(out, enforce_file_format=True)
    return out.getvalue()


def element_offset(data: bytes, tag: int, vr: bytes) -> int:
    """Offset of the explicit-VR little-endian element ``tag`` with ``vr`` in the dataset of ``data``."""
    at = data.find(struct.pack("<HH", tag >> 16, tag & 0xFFFF) + vr, 132)
    if at < 0:
        raise ConfigError(f"no element ({tag >> 16:04X},{tag & 0xFFFF:04X}) with VR {vr.decode()} in the template")
    return at


def _pixel_data(data: bytes) -> int:
    for vr in (b"OW", b"OB"):
        try:
            return element_offset(data, _PIXEL_DATA, vr)
        except ConfigError:
            continue
    raise ConfigError("the template has no Pixel Data element")


def truncate(data: bytes, size: int) -> bytes:
    """The first ``size`` bytes (0 < size < len(data))."""
    if not 0 < size < len(data):
        raise ConfigError(f"cut at {size} is not inside the {len(data)}-byte file")
    return data[:size]


def _flip(data: bytes, offset: int, bit: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 1 << bit
    return bytes(out)


def flip_header(data: bytes, target: str, bit: int) -> bytes:
    """Flip bit ``bit`` (0-7) of a byte of ``target`` (one of :data:`HEADER_TARGETS`).

    Each is detectable whatever the bit: "DICM" no longer marks a Part 10 file; Pixel Data (7FE0,0010)
    loses its tag, its VR (first letter: no VR starts with the results) or its length (shorter than
    the pixels, or past the end of the file); Rows (0028,0010) and Columns (0028,0011) grow by 256 or
    more beyond the pixel data; BitsAllocated (0028,0100) leaves 8/16/32.
    """
    pixel = _pixel_data(data)
    offsets = {
        "preamble magic": 128 + bit % 4,
        "Pixel Data tag": pixel + bit % 4,
        "Pixel Data VR": pixel + 4,
        "Pixel Data length": pixel + 8 + bit % 4,
        "Rows high byte": element_offset(data, 0x00280010, b"US") + 9,
        "Columns high byte": element_offset(data, 0x00280011, b"US") + 9,
        "BitsAllocated": element_offset(data, 0x00280100, b"US") + 8 + bit % 2,
    }
    if target not in offsets:
        raise ConfigError(f"unknown header target {target!r}; use one of {', '.join(HEADER_TARGETS)}")
    return _flip(data, offsets[target], bit)


def flip_sign_bits(data: bytes, pixels: np.ndarray) -> bytes:
    """Flip the top bit of the 16-bit native pixels at flat indices ``pixels``: ~32768 HU off each."""
    out = bytearray(data)
    first = _pixel_data(data) + 12
    for i in pixels:
        out[first + 2 * int(i) + 1] ^= 0x80
    return bytes(out)


def set_pixel_data_length(data: bytes, length: int) -> bytes:
    """Native Pixel Data (7FE0,0010) declaring ``length`` bytes (0xFFFFFFFF: undefined length)."""
    at = _pixel_data(data) + 8
    return data[:at] + struct.pack("<I", length) + data[at + 4 :]


def wrong_vr(data: bytes, tag: int, vr: bytes, new_vr: bytes, value: bytes) -> bytes:
    """The short-VR element ``tag`` rewritten with VR ``new_vr`` and raw ``value`` (see :data:`WRONG_VRS`)."""
    at = element_offset(data, tag, vr)
    length = struct.unpack("<H", data[at + 6 : at + 8])[0]
    return data[:at + 4] + new_vr + struct.pack("<H", len(value)) + value + data[at + 8 + length :]


def codestream_size(data: bytes, width: int, height: int) -> bytes:
    """A JPEG 2000 (SIZ) or JPEG-LS (SOF55) codestream declaring ``width`` x ``height`` pixels."""
    out = bytearray(data)
    siz = data.find(b"\xff\x4f\xff\x51")
    if siz >= 0:
        xo, yo = struct.unpack(">II", data[siz + 16 : siz + 24])
        out[siz + 8 : siz + 16] = struct.pack(">II", width + xo, height + yo)
        return bytes(out)
    sof = data.find(b"\xff\xf7")
    if sof < 0:
        raise ConfigError("no JPEG 2000 SIZ or JPEG-LS SOF55 segment in the template")
    out[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(out)


def _first_fragment(data: bytes) -> int:
    """Offset of the first fragment item (the one after the Basic Offset Table)."""
    bot = data.find(_ITEM, _pixel_data(data))
    if bot < 0:
        raise ConfigError("the template has no encapsulated Pixel Data")
    return bot + 8 + struct.unpack("<I", data[bot + 4 : bot + 8])[0]


def rle_segments(data: bytes, count: int) -> bytes:
    """An RLE frame whose header lists ``count`` segments."""
    at = _first_fragment(data) + 8
    return data[:at] + struct.pack("<I", count) + data[at + 4 :]


def fragment_overrun(data: bytes, extra: int) -> bytes:
    """The first fragment declaring ``extra`` bytes more than the file holds after it."""
    at = _first_fragment(data)
    return data[:at + 4] + struct.pack("<I", len(data) - at - 8 + extra) + data[at + 8 :]


def bad_item(data: bytes) -> bytes:
    """The first fragment's item tag (FFFE,E000) damaged to (FFFE,E00D)."""
    at = _first_fragment(data)
    return data[:at] + b"\xfe\xff\x0d\xe0" + data[at + 4 :]


def random_flips(data: bytes, rng: np.random.Generator, count: int) -> bytes:
    """``count`` random bits flipped anywhere: the file may stay valid, or not."""
    out = data
    for offset, bit in zip(rng.integers(0, len(data), count), rng.integers(0, 8, count)):
        out = _flip(out, int(offset), int(bit))
    return out


def cut_codestream(data: bytes, fraction: float, end: bytes = b"") -> bytes:
    """A single-frame encapsulated file whose codestream keeps its first ``fraction`` (0 < fraction < 1),
    then ``end`` (an EOI marker ``b"\\xff\\xd9"``, say): the items stay well formed, only the frame is short."""
    ds = pydicom.dcmread(io.BytesIO(data))
    (frame,) = generate_frames(ds.PixelData, number_of_frames=1)
    if not 0 < fraction < 1:
        raise ConfigError(f"cut at {fraction} is not inside the codestream")
    ds.PixelData = encapsulate([frame[: int(len(frame) * fraction)] + end])
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


def deflate_bomb(template: Dataset, key: str, inflated: int, *, trailing: bool = False) -> bytes:
    """A Deflated Explicit VR Little Endian file whose dataset inflates to ``inflated`` bytes (< 4 GiB):
    ``template``'s header, then a native Pixel Data element of zeros -- or, when ``trailing``, the
    template's own Pixel Data and then zeros in a Data Set Trailing Padding (FFFC,FFFC) element. About
    1 kB per inflated MB."""
    ds = _renamed(template, key)
    if not trailing:
        del ds.PixelData
    ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    meta = DicomBytesIO()
    meta.write(bytes(128) + b"DICM")
    write_file_meta_info(meta, ds.file_meta, enforce_standard=True)
    dataset = DicomBytesIO()
    dataset.is_little_endian, dataset.is_implicit_VR = True, False
    write_dataset(dataset, ds)
    chunk = 1 << 20
    zeros = (inflated - dataset.tell() - 12) // chunk
    tag = (0xFFFC, 0xFFFC) if trailing else (0x7FE0, 0x0010)
    element = struct.pack("<HH2sHI", *tag, b"OB" if trailing else b"OW", 0, zeros * chunk)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    stream = deflate.compress(dataset.getvalue() + element) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(bytes(chunk)) + deflate.flush(zlib.Z_FULL_FLUSH)  # the same for every chunk
    return meta.getvalue() + stream + block * zeros + deflate.flush()

"""Deflated Explicit VR Little Endian (1.2.840.10008.1.2.1.99) inflated within a bound set by the file
itself: a 2 MB file never costs 2 GB.

In such a file everything after the File Meta Information is one raw deflate stream (RFC 1951) of an
Explicit VR Little Endian dataset (PS3.5 A.5). pydicom inflates the whole stream at once, however
large, so here it is inflated piece by piece (``zlib.decompressobj`` with ``max_length``): first at
most :data:`ALLOWANCE` bytes, enough to reach Pixel Data (7FE0,0010) and read Rows, Columns,
NumberOfFrames, SamplesPerPixel and BitsAllocated; then no more than those declare -- Rows x
Columns x NumberOfFrames x SamplesPerPixel x BitsAllocated / 8 bytes of pixels, plus the allowance
for the elements before and after them. A Pixel Data element declaring more, a stream inflating past
the bound, and a stream that ends before its end (a cut file) are refused with what they declare.
"""

from __future__ import annotations

import io
import zlib
from typing import BinaryIO

from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.filereader import read_dataset
from pydicom.uid import DeflatedExplicitVRLittleEndian

from medload.config import format_size
from medload.errors import InputProblem
from medload.ingest import tags

__all__ = ["ALLOWANCE", "read_deflated", "inflate_pixels", "may_be_deflated"]

#: Bytes of dataset allowed besides the pixels: the elements before Pixel Data, and those after it.
ALLOWANCE = 16 << 20
_FIRST = 1 << 16                        # the first piece inflated while looking for Pixel Data
_PIXEL_TAG = b"\xe0\x7f\x10\x00"
_UID = DeflatedExplicitVRLittleEndian.encode()


class _Inflater:
    """A raw deflate stream inflated on demand, never past what is asked for."""

    def __init__(self, compressed: bytes) -> None:
        self._stream = zlib.decompressobj(-zlib.MAX_WBITS)
        self._left = compressed
        self.out = bytearray()

    @property
    def done(self) -> bool:
        return self._stream.eof or not self._left

    def fill(self, size: int) -> bytearray:
        """Inflate until ``size`` bytes are out, or the stream ends; raise InputProblem on damaged data."""
        while len(self.out) < size and not self.done:
            try:
                self.out += self._stream.decompress(self._left, size - len(self.out))
            except zlib.error as exc:
                raise InputProblem("header", f"the deflated dataset cannot be inflated: {exc}") from None
            self._left = self._stream.unconsumed_tail
        return self.out

    def check_ended(self) -> None:
        """Raise unless the stream ended with its final block (a cut file does not)."""
        if not self._stream.eof:
            raise InputProblem("header", f"the deflate stream ends after {len(self.out)} inflated bytes without its "
                                         "final block: truncated file")


def may_be_deflated(head: bytes) -> bool:
    """Whether the file that starts with ``head`` may be deflated: "DICM" at byte 128 and the syntax's UID
    in its first 4096 bytes (:func:`read_deflated` reads no further for any other file)."""
    return head[128:132] == b"DICM" and _UID in head[:4096]


def _dataset_start(fp: BinaryIO) -> tuple[FileMetaDataset, int] | None:
    """The File Meta Information and where the dataset starts, when they name the deflated syntax."""
    fp.seek(0)
    if not may_be_deflated(fp.read(4096)):
        return None
    fp.seek(132)
    try:
        meta = FileMetaDataset(read_dataset(fp, is_implicit_VR=False, is_little_endian=True,
                                            stop_when=lambda tag, vr, length: tag.group != 2))
        syntax = meta.get("TransferSyntaxUID")
    except Exception:  # noqa: BLE001 -- a damaged meta group: the header parser reports it
        return None
    return (meta, fp.tell()) if syntax == DeflatedExplicitVRLittleEndian else None


def _header(prefix: bytes) -> tuple[Dataset, int] | None:
    """The dataset up to Pixel Data and where its element starts, if ``prefix`` reaches it."""
    buffer = io.BytesIO(prefix)
    try:
        ds = read_dataset(buffer, is_implicit_VR=False, is_little_endian=True,
                          stop_when=lambda tag, vr, length: tag == 0x7FE00010)
    except Exception:  # noqa: BLE001 -- an element cut by the end of the prefix
        return None
    at = buffer.tell()
    return (ds, at) if prefix[at : at + 4] == _PIXEL_TAG else None


def _whole(data: bytes) -> Dataset:
    try:
        return read_dataset(io.BytesIO(data), is_implicit_VR=False, is_little_endian=True)
    except Exception as exc:  # pydicom raises many types on damaged data
        raise InputProblem("header", f"unreadable deflated dataset: {type(exc).__name__}: {exc}") from None


def read_deflated(fp: BinaryIO, name: str) -> tuple[FileDataset, bytes, int] | None:
    """For a deflated file: its dataset up to Pixel Data, the inflated dataset, and the offset of the
    Pixel Data element in it; None for any other file. Raises InputProblem (stage ``header``)."""
    found = _dataset_start(fp)
    if found is None:
        fp.seek(0)  # the caller parses the file from its start
        return None
    meta, start = found
    fp.seek(start)
    stream = _Inflater(fp.read())
    size = _FIRST
    while (header := _header(bytes(stream.fill(size)))) is None:
        if stream.done:  # the whole dataset, and no Pixel Data in it: the caller says so
            stream.check_ended()
            return FileDataset(name, _whole(bytes(stream.out)), b"\0" * 128, meta, False, True), bytes(stream.out), \
                len(stream.out)
        if size >= ALLOWANCE:
            raise InputProblem("header", f"the deflated dataset holds no Pixel Data (7FE0,0010) within its first "
                                         f"{format_size(ALLOWANCE)}: refused (a deflate bomb, or damaged)")
        size *= 4
    ds, pixel_at = header
    limit = pixel_at + 12 + _pixel_bytes(ds) + ALLOWANCE
    element = bytes(stream.out[pixel_at : pixel_at + 12])
    declared = int.from_bytes(element[8:12], "little") if element[4:6] in (b"OB", b"OW") else 0
    if pixel_at + 12 + declared > limit:
        raise InputProblem("header", f"Pixel Data declares {declared} bytes, but {_dimensions(ds)} need "
                                     f"{_pixel_bytes(ds)}: refused before inflating it (a deflate bomb, or damaged)")
    stream.fill(limit + 1)
    if len(stream.out) > limit:
        raise InputProblem("header", f"the deflated dataset inflates past {format_size(limit)}, but {_dimensions(ds)} "
                                     f"need {_pixel_bytes(ds)} bytes of pixels: refused (a deflate bomb, or damaged)")
    stream.check_ended()
    return FileDataset(name, ds, b"\0" * 128, meta, False, True), bytes(stream.out), pixel_at


def inflate_pixels(data: bytes, end: int) -> bytes:
    """The first ``end`` bytes of the inflated dataset of the deflated file ``data`` (a file the header
    pass took: see :func:`read_deflated`)."""
    found = _dataset_start(io.BytesIO(data))
    if found is None:
        raise InputProblem("decode", "not a Deflated Explicit VR Little Endian file any more: changed since its header "
                                     "was read")
    stream = _Inflater(data[found[1] :])
    stream.fill(end)
    if len(stream.out) < end:
        raise InputProblem("decode", f"the deflated dataset inflates to {len(stream.out)} bytes, {end} expected: "
                                     "changed since its header was read")
    return bytes(stream.out)


def _pixel_bytes(ds: Dataset) -> int:
    """Rows x Columns x NumberOfFrames x SamplesPerPixel x BitsAllocated / 8 (PS3.3 C.7.6.3)."""
    return (max(tags.integer(ds, "Rows", default=0), 0) * max(tags.integer(ds, "Columns", default=0), 0)
            * max(tags.integer(ds, "NumberOfFrames", default=1), 1) * max(tags.integer(ds, "SamplesPerPixel", default=1), 1)
            * -(-max(tags.integer(ds, "BitsAllocated", default=16), 1) // 8))


def _dimensions(ds: Dataset) -> str:
    return (f"Rows x Columns x NumberOfFrames {tags.integer(ds, 'Rows', default=0)} x "
            f"{tags.integer(ds, 'Columns', default=0)} x {tags.integer(ds, 'NumberOfFrames', default=1)} of "
            f"{tags.integer(ds, 'BitsAllocated', default=16)} bits")

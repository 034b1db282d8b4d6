"""Encapsulated (compressed) Pixel Data checked before any decode: fragments inside the file, and
codestreams that declare the size the header does.

Encapsulated Pixel Data (7FE0,0010) is a sequence of Items (FFFE,E000) -- a Basic Offset Table, then
fragments -- closed by a Sequence Delimitation Item (FFFE,E0DD) (PS3.5 A.4). Decoders size their
output from each codestream's own header, not from Rows (0028,0010) and Columns (0028,0011): a
codestream declaring 40000 x 40000 pixels inside a 64 x 64 image would be decoded at its own size.
So every fragment must lie inside the file, each frame needs a fragment, and every frame's
codestream header must declare Columns x Rows x SamplesPerPixel (0028,0002): JPEG and JPEG-LS in
their SOFn segment (ITU-T T.81 B.2.2, T.87), JPEG 2000 in SIZ (ISO/IEC 15444-1 A.5.1, inside a
``jp2c`` box when the JP2 file format wraps it); an RLE frame's header must list one segment per
sample byte, inside the fragment (PS3.5 G.5).
"""

from __future__ import annotations

import struct
from typing import BinaryIO

from pydicom.uid import (
    HTJ2K,
    JPEG2000,
    HTJ2KLossless,
    HTJ2KLosslessRPCL,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)

from medload.errors import InputProblem

__all__ = ["check_encapsulated"]

_ITEM, _SEQUENCE_END = (0xFFFE, 0xE000), (0xFFFE, 0xE0DD)
_JPEG = {JPEGBaseline8Bit, JPEGExtended12Bit, JPEGLossless, JPEGLosslessSV1, JPEGLSLossless, JPEGLSNearLossless}
_J2K = {JPEG2000Lossless, JPEG2000, HTJ2KLossless, HTJ2KLosslessRPCL, HTJ2K}
_SOI, _SOC_SIZ = b"\xff\xd8", b"\xff\x4f\xff\x51"
_JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"
_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {0xF7}   # SOF0-15 (not DHT, JPG, DAC), JPEG-LS SOF55
_HEAD = 1 << 16   # codestream headers sit in a fragment's first bytes (tables and markers before SOFn)


def check_encapsulated(fp: BinaryIO, start: int, end: int, file_size: int, syntax: str, rows: int, cols: int,
                       samples: int, bytes_per_sample: int, frames: int) -> None:
    """Raise InputProblem (stage ``header``) unless the items from ``start`` (the first byte of the Pixel
    Data value) up to ``end`` are well formed and every frame's codestream declares the header's size."""
    fragments = _fragments(fp, start, end, file_size)
    if len(fragments) < frames:
        raise InputProblem("header", f"encapsulated Pixel Data holds {len(fragments)} fragments for "
                                     f"NumberOfFrames {frames}: truncated or damaged")
    if syntax == RLELossless:
        for n, (offset, length) in enumerate(fragments[:frames]):
            _check_rle(_read(fp, offset, min(length, 64)), length, samples * bytes_per_sample, n)
        return
    if syntax not in _JPEG | _J2K:
        return
    expected = (cols, rows, samples)
    starts = 0
    for offset, length in fragments:
        head = _read(fp, offset, min(length, _HEAD))
        if syntax in _JPEG and head.startswith(_SOI):
            declared = _jpeg_size(head)
        elif syntax in _J2K and head.startswith((_SOC_SIZ, _JP2_SIGNATURE)):
            declared = _j2k_size(head)
        else:
            continue  # a continuation fragment of the frame before
        if declared != expected:
            found = "no readable size" if declared is None else "{} x {} x {} samples".format(*declared)
            raise InputProblem("header", f"the codestream of frame {starts + 1} declares {found}; Columns x Rows x "
                                         f"SamplesPerPixel say {cols} x {rows} x {samples}")
        starts += 1
    if starts < frames:
        raise InputProblem("header", f"encapsulated Pixel Data holds {starts} codestreams for NumberOfFrames {frames}")


def _read(fp: BinaryIO, offset: int, size: int) -> bytes:
    fp.seek(offset)
    return fp.read(size)


def _fragments(fp: BinaryIO, start: int, end: int, file_size: int) -> list[tuple[int, int]]:
    """(offset, length) of every fragment, the Basic Offset Table left out."""
    items: list[tuple[int, int]] = []
    pos = start
    while True:
        head = _read(fp, pos, 8) if pos + 8 <= end else b""
        if len(head) < 8:
            raise InputProblem("header", "encapsulated Pixel Data ends without its Sequence Delimitation Item "
                                         "(FFFE,E0DD): truncated file")
        group, element, length = struct.unpack("<HHI", head)
        if (group, element) == _SEQUENCE_END:
            break
        if (group, element) != _ITEM:
            raise InputProblem("header", f"encapsulated Pixel Data item {len(items)} has tag ({group:04X},"
                                         f"{element:04X}) instead of (FFFE,E000): damaged")
        if pos + 8 + length > end:
            raise InputProblem("header", f"Pixel Data fragment {len(items)} declares {length} bytes at offset "
                                         f"{pos + 8} but the file has {file_size} bytes: truncated or damaged")
        items.append((pos + 8, length))
        pos += 8 + length
    if len(items) < 2:
        raise InputProblem("header", "encapsulated Pixel Data holds no fragment")
    return items[1:]


def _jpeg_size(head: bytes) -> tuple[int, int, int] | None:
    """(width, height, components) from the SOFn segment of a JPEG or JPEG-LS codestream."""
    i = 2
    while i + 10 <= len(head):
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _SOF:
            height, width = struct.unpack(">HH", head[i + 5 : i + 9])
            return width, height, head[i + 9]
        i += 2 + struct.unpack(">H", head[i + 2 : i + 4])[0]
    return None


def _j2k_size(head: bytes) -> tuple[int, int, int] | None:
    """(width, height, components) from the SIZ segment of a JPEG 2000 codestream, or of the
    codestream box (``jp2c``) of a JP2 file."""
    i = 0
    while head.startswith(_JP2_SIGNATURE) and i + 8 <= len(head):
        size, kind = struct.unpack(">I4s", head[i : i + 8])
        if kind == b"jp2c":
            head, i = head[i + 8 :], 0
            break
        if size < 8:
            return None
        i += size
    if not head.startswith(_SOC_SIZ) or len(head) < 42:
        return None
    xsiz, ysiz, xosiz, yosiz = struct.unpack(">IIII", head[8:24])
    return xsiz - xosiz, ysiz - yosiz, struct.unpack(">H", head[40:42])[0]


def _check_rle(head: bytes, length: int, segments: int, frame: int) -> None:
    """The RLE header of ``frame``: one segment per sample byte, each starting inside the fragment."""
    if len(head) < 64:
        raise InputProblem("header", f"RLE frame {frame + 1} is shorter than its 64-byte header")
    count, *offsets = struct.unpack("<16I", head)
    used = offsets[:count]
    if count != segments or used[0] != 64 or used != sorted(used) or used[-1] >= length:
        raise InputProblem("header", f"RLE header of frame {frame + 1} lists {count} segments at offsets "
                                     f"{used[:4]}...; {segments} segments inside {length} bytes expected")

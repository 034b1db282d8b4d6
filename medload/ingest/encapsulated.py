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
sample byte, inside the fragment (PS3.5 G.5). A Basic Offset Table, when present, must put each frame
at a fragment, in order; a Huffman-coded JPEG frame must hold at least the bytes its pixels need
(:func:`medload.ingest.codestreams.minimum_bytes`). Whether each codestream is whole is checked when
it is decoded (:mod:`medload.ingest.codestreams`).
"""

from __future__ import annotations

import struct
from typing import BinaryIO

from pydicom.uid import RLELossless

from medload.errors import InputProblem
from medload.ingest.codestreams import J2K_SYNTAXES, JPEG_SYNTAXES, SOF_MARKERS, minimum_bytes

__all__ = ["check_encapsulated"]

_ITEM, _SEQUENCE_END = (0xFFFE, 0xE000), (0xFFFE, 0xE0DD)
_SOI, _SOC_SIZ = b"\xff\xd8", b"\xff\x4f\xff\x51"
_JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"
_HEAD = 1 << 16   # codestream headers sit in a fragment's first bytes (tables and markers before SOFn)


def check_encapsulated(fp: BinaryIO, start: int, end: int, file_size: int, syntax: str, rows: int, cols: int,
                       samples: int, bytes_per_sample: int, frames: int) -> None:
    """Raise InputProblem (stage ``header``) unless the items from ``start`` (the first byte of the Pixel
    Data value) up to ``end`` are well formed and every frame's codestream declares the header's size."""
    table, *fragments = _items(fp, start, end, file_size)
    if len(fragments) < frames:
        raise InputProblem("header", f"encapsulated Pixel Data holds {len(fragments)} fragments for "
                                     f"NumberOfFrames {frames}: truncated or damaged")
    _check_offset_table(fp, table, fragments, frames)
    if syntax == RLELossless:
        for n, (offset, length) in enumerate(fragments[:frames]):
            _check_rle(_read(fp, offset, min(length, 64)), length, samples * bytes_per_sample, n)
        return
    if syntax not in JPEG_SYNTAXES | J2K_SYNTAXES:
        return
    expected = (cols, rows, samples)
    codestreams: list[list[int]] = []   # per frame: SOFn marker (0 for JPEG 2000), bytes in its fragments
    for offset, length in fragments:
        head = _read(fp, offset, min(length, _HEAD))
        if syntax in JPEG_SYNTAXES and head.startswith(_SOI):
            sof, declared = _jpeg_size(head)
        elif syntax in J2K_SYNTAXES and head.startswith((_SOC_SIZ, _JP2_SIGNATURE)):
            sof, declared = 0, _j2k_size(head)
        else:
            if codestreams:  # a continuation fragment of the frame before
                codestreams[-1][1] += length
            continue
        if declared != expected:
            found = "no readable size" if declared is None else "{} x {} x {} samples".format(*declared)
            raise InputProblem("header", f"the codestream of frame {len(codestreams) + 1} declares {found}; Columns x "
                                         f"Rows x SamplesPerPixel say {cols} x {rows} x {samples}")
        codestreams.append([sof, length])
    if len(codestreams) < frames:
        raise InputProblem("header", f"encapsulated Pixel Data holds {len(codestreams)} codestreams for "
                                     f"NumberOfFrames {frames}")
    for n, (sof, size) in enumerate(codestreams):
        least = minimum_bytes(sof, cols, rows)
        if size < least:
            raise InputProblem("header", f"the codestream of frame {n + 1} holds {size} bytes, but {cols} x {rows} "
                                         f"pixels take {least} at the least (one bit or more per Huffman code): "
                                         "forged or truncated")


def _read(fp: BinaryIO, offset: int, size: int) -> bytes:
    fp.seek(offset)
    return fp.read(size)


def _items(fp: BinaryIO, start: int, end: int, file_size: int) -> list[tuple[int, int]]:
    """(offset, length) of every item's value: the Basic Offset Table, then the fragments."""
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
    return items


def _check_offset_table(fp: BinaryIO, table: tuple[int, int], fragments: list[tuple[int, int]], frames: int) -> None:
    """A Basic Offset Table, when not empty, lists where each frame's first fragment item starts, counted
    from the first fragment item (PS3.5 A.4): one offset per frame, increasing, each at an item."""
    offset, length = table
    if length == 0:
        return
    if length != 4 * frames:
        raise InputProblem("header", f"the Basic Offset Table holds {length} bytes for NumberOfFrames {frames} "
                                     f"({4 * frames} expected): damaged")
    offsets = struct.unpack(f"<{frames}I", _read(fp, offset, length))
    first = fragments[0][0]
    starts = {at - first for at, _ in fragments}
    for n, at in enumerate(offsets):
        if at not in starts or at != 0 and n == 0:
            raise InputProblem("header", f"the Basic Offset Table puts frame {n + 1} at byte {at}, where no fragment "
                                         "starts: fragment lengths and offsets disagree (truncated or damaged)")
        if n and at <= offsets[n - 1]:
            raise InputProblem("header", f"the Basic Offset Table puts frame {n + 1} at byte {at}, before frame {n} "
                                         f"(byte {offsets[n - 1]}): damaged")


def _jpeg_size(head: bytes) -> tuple[int, tuple[int, int, int] | None]:
    """The SOFn marker and (width, height, components) of a JPEG or JPEG-LS codestream; (0, None) if unread."""
    i = 2
    while i + 10 <= len(head):
        if head[i] != 0xFF:
            return 0, None
        marker = head[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in SOF_MARKERS:
            height, width = struct.unpack(">HH", head[i + 5 : i + 9])
            return marker, (width, height, head[i + 9])
        i += 2 + struct.unpack(">H", head[i + 2 : i + 4])[0]
    return 0, None


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

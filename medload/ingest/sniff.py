"""What a file that is not DICOM plainly is, from its name and first bytes; zero-filled files, told cheaply.

A DICOM Part 10 file has "DICM" at bytes 128..132 (PS3.10 7.1). A file without it may still be a dataset
without the preamble, which starts with an element tag of group 0000, 0002, 0004 or 0008 (elements come in
ascending tag order, PS3.5 7.1, and an image has SOP Class UID (0008,0016)). A file without the preamble
that is text, carries the signature of another format (PNG, JPEG, PDF, NIfTI...), or has the suffix of
one and does not start with such a tag, is not DICOM: discovery reports it as ignored, apart from
damaged DICOM. A file whose first block is all zero bytes (a crash before its data reached the disk, a
zeroed header) is rejected; whether all of it is zero is told from its first MiB and the holes of a
sparse file (``SEEK_DATA``), never by reading all of it.
"""

from __future__ import annotations

import errno
import os

__all__ = ["not_dicom", "zero_head", "zeroed_reason", "ZERO_WINDOW"]

#: How much of a file that starts with a zero block is read to tell zero-filled from zeroed at the start.
ZERO_WINDOW = 1 << 20

_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG image"), (b"\xff\xd8\xff", "JPEG image"), (b"GIF87a", "GIF image"),
               (b"GIF89a", "GIF image"), (b"II*\x00", "TIFF image"), (b"MM\x00*", "TIFF image"),
               (b"%PDF-", "PDF document"), (b"\x89HDF\r\n\x1a\n", "HDF5 file"), (b"\x93NUMPY", "NumPy array"),
               (b"NRRD000", "NRRD image"))
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_TEXT_BYTES = bytes(b for b in range(256) if b >= 0x20 and b != 0x7F or b in b"\t\n\f\r\x1b")
_NON_DICOM_SUFFIXES = (
    ".txt", ".md", ".rst", ".json", ".csv", ".tsv", ".xml", ".html", ".htm", ".log", ".yaml", ".yml", ".ini", ".cfg",
    ".py", ".sh", ".bat", ".pdf", ".rtf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".odt", ".ods",
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".svg", ".mp4", ".avi", ".mov", ".nii", ".nii.gz", ".nrrd", ".nhdr",
    ".mha", ".mhd", ".npy", ".npz", ".h5", ".hdf5", ".pkl", ".pt", ".pth", ".exe", ".dll", ".jar")
_DATASET_GROUPS = frozenset({0x0000, 0x0002, 0x0004, 0x0008})


def not_dicom(name: str, head: bytes) -> str | None:
    """Why the input ``name`` starting with ``head`` (no "DICM" at 128) is plainly not DICOM, or None.
    Office documents (.docx...) and ``.nii.gz`` are told by their suffix before they are taken for archives."""
    kind = _signature(head)
    if kind is not None:
        return f"not DICOM: {kind}"
    if _is_text(head):
        return "not DICOM: text"
    suffix = next((s for s in _NON_DICOM_SUFFIXES if name.lower().endswith(s)), None)
    if suffix is not None and not _may_be_dataset(head):
        return f"not DICOM: a {suffix} file"
    return None


def zero_head(head: bytes) -> bool:
    """Whether ``head`` (a file's first block) is all zero bytes: no preamble, no archive header."""
    return bool(head) and not head.strip(b"\0")


def zeroed_reason(fd: int, size: int) -> str:
    """Why the file open at ``fd`` (``size`` bytes), whose first block is zero, is rejected. Reads at most
    :data:`ZERO_WINDOW` bytes of data; holes (``SEEK_DATA``) are zeros that need no reading."""
    end = min(size, ZERO_WINDOW)
    start = _next_data(fd, 0, size)
    zeros = end
    if start < end:
        data = os.pread(fd, end - start, start)
        zeros = start + len(data) - len(data.lstrip(b"\0"))
    if zeros >= size or (zeros >= end and _next_data(fd, end, size) >= size):
        return f"zero-filled: all {size} bytes are zero"
    if zeros >= end:
        return (f"zero-filled: the first {end >> 20} MiB are zero (no DICOM preamble, no archive header; "
                "the rest was not read)")
    return f"damaged: the first {zeros} bytes are zero (DICOM preamble and header zeroed)"


def _next_data(fd: int, offset: int, size: int) -> int:
    """Offset of the first data at or after ``offset``: ``size`` if only holes follow; ``offset`` where the
    file system cannot tell (no ``SEEK_DATA``)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None or offset >= size:
        return offset
    try:
        return min(os.lseek(fd, offset, seek_data), size)
    except OSError as exc:
        return size if exc.errno == errno.ENXIO else offset


def _signature(head: bytes) -> str | None:
    for magic, kind in _SIGNATURES:
        if head.startswith(magic):
            return kind
    sizeof_hdr = (int.from_bytes(head[:4], "little"), int.from_bytes(head[:4], "big"))
    if 348 in sizeof_hdr and head[344:348] in (b"n+1\0", b"ni1\0"):  # NIfTI-1: sizeof_hdr, then magic at 344
        return "NIfTI-1 image"
    if 540 in sizeof_hdr and head[4:8] in (b"n+2\0", b"ni2\0"):      # NIfTI-2: magic right after sizeof_hdr
        return "NIfTI-2 image"
    return None


def _is_text(head: bytes) -> bool:
    """Text in any 8-bit encoding (UTF-8, Latin-1...): no control byte but tabs, line breaks and escapes;
    or UTF-16 with its BOM. A dataset never is: its first tag holds a zero or control byte."""
    return head.startswith(_UTF16_BOMS) or bool(head) and not head.translate(None, _TEXT_BYTES)


def _may_be_dataset(head: bytes) -> bool:
    """Whether ``head`` may start a dataset without the preamble: a tag of group 0000/0002/0004/0008, in
    either byte order."""
    return len(head) >= 2 and (int.from_bytes(head[:2], "little") in _DATASET_GROUPS
                               or int.from_bytes(head[:2], "big") in _DATASET_GROUPS)

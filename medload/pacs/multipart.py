"""Streaming read of a WADO-RS ``multipart/related`` response holding one DICOM instance.

WADO-RS answers an instance request with ``multipart/related; type="application/dicom"`` (PS3.18
§8.7.3.3.2; the framing is RFC 2046 §5.1 and RFC 2387). The one part's body -- a DICOM Part 10 file --
is written to a file as the chunks arrive: memory holds one chunk and a boundary's length of overlap,
never the instance.
"""

from __future__ import annotations

from collections.abc import Iterable
from email.message import Message
from typing import BinaryIO

from medload.errors import InputProblem

__all__ = ["boundary_of", "write_single_part"]

_MAX_HEADER_BYTES = 16 << 10


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/related`` Content-Type; InputProblem for anything else."""
    message = Message()
    message["content-type"] = content_type
    boundary = message.get_param("boundary")
    if message.get_content_type() != "multipart/related" or not isinstance(boundary, str) or not boundary:
        raise InputProblem("retrieve", f"server answered {content_type or 'no Content-Type'!r}, not multipart/related "
                                       "with a boundary (PS3.18 WADO-RS)")
    return boundary.encode("latin-1")


class _Stream:
    """Chunks with a pushback buffer: ``need`` and ``find`` read on until enough has arrived."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self.buffer = b""

    def more(self) -> bool:
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        self.buffer += chunk
        return True

    def need(self, size: int) -> bytes:
        """The next ``size`` bytes (fewer only at the end of the stream), left in the buffer."""
        while len(self.buffer) < size and self.more():
            pass
        return self.buffer[:size]

    def find(self, marker: bytes, limit: int) -> int:
        """Index of ``marker`` in the buffer, reading on; -1 if the stream ends or ``limit`` bytes pass."""
        while (index := self.buffer.find(marker)) < 0:
            if len(self.buffer) > limit or not self.more():
                return -1
        return index


def write_single_part(chunks: Iterable[bytes], boundary: bytes, out: BinaryIO, max_bytes: int) -> int:
    """Write the body of the one ``application/dicom`` part to ``out``; the number of bytes written.

    InputProblem if the framing is broken, the response is cut short, it holds another kind of part or
    more than one part, or the body exceeds ``max_bytes``.
    """
    stream = _Stream(chunks)
    opening = b"--" + boundary
    start = stream.find(opening, _MAX_HEADER_BYTES)
    if start < 0:
        raise _broken("no opening boundary")
    stream.buffer = stream.buffer[start + len(opening):]
    if stream.need(2) == b"--":
        raise _broken("no part at all (empty multipart response)")
    end = stream.find(b"\r\n\r\n", _MAX_HEADER_BYTES)
    if end < 0:
        raise _broken("part headers never end")
    _check_part_headers(stream.buffer[:end])
    stream.buffer = stream.buffer[end + 4:]
    size = _copy_body(stream, b"\r\n" + opening, out, max_bytes)
    if stream.need(2) != b"--":
        raise InputProblem("retrieve", "the response holds more than one part, where one instance was asked for")
    return size


def _check_part_headers(block: bytes) -> None:
    message = Message()
    for line in block.decode("latin-1").split("\r\n"):
        name, sep, value = line.partition(":")
        if sep:
            message[name.strip()] = value.strip()
    kind = message.get_content_type() if message["content-type"] else "application/dicom"  # RFC 2387: the type= default
    if kind != "application/dicom":
        raise InputProblem("retrieve", f"part is {kind}, not application/dicom")


def _copy_body(stream: _Stream, delimiter: bytes, out: BinaryIO, max_bytes: int) -> int:
    """Copy up to ``delimiter``, keeping back a delimiter's length in case it spans two chunks."""
    written = 0
    keep = len(delimiter) - 1
    while (index := stream.buffer.find(delimiter)) < 0:
        if len(stream.buffer) > keep:
            written += _write(out, stream.buffer[:-keep], written, max_bytes)
            stream.buffer = stream.buffer[-keep:]
        if not stream.more():
            raise _broken("the response ended inside the instance (cut short)")
    written += _write(out, stream.buffer[:index], written, max_bytes)
    stream.buffer = stream.buffer[index + len(delimiter):]
    return written


def _write(out: BinaryIO, data: bytes, written: int, max_bytes: int) -> int:
    if written + len(data) > max_bytes:
        raise InputProblem("retrieve", f"instance larger than the cap of {max_bytes} bytes")
    out.write(data)
    return len(data)


def _broken(what: str) -> InputProblem:
    return InputProblem("retrieve", f"malformed multipart/related response: {what}")

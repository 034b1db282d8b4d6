"""Compressed frames checked for completeness: a codestream cut short is refused, never decoded into
made-up pixels.

Decoders fill what a codestream lacks. A JPEG or JPEG-LS scan cut short -- even closed again with an
EOI marker -- decodes without an error through libjpeg (pylibjpeg) and libjpeg-turbo (Pillow), the
missing pixels invented. So a frame is trusted only when

* its structure is whole (:func:`check_structure`): a JPEG (ITU-T T.81 B.2) or JPEG-LS (T.87 annex
  C) codestream is SOI, marker segments and scans, then EOI; each scan's entropy-coded data end at a
  marker, holding the restart markers RST0..RST7 in turn and, under a restart interval (DRI), as many
  as the number of MCUs calls for (T.81; one scan for a one-component sequential or lossless frame).
  A JPEG 2000 codestream (ISO/IEC 15444-1 A.4) is SOC, the main header, then tile-parts each as long
  as its SOT segment's Psot says, the last followed by EOC. What follows the end marker is ignored
  (the even-length padding of PS3.5 A.4, or junk a decoder never reads);
* a JPEG / JPEG-LS scan was consumed to its end (:func:`decode_frame`): a decoder that fills missing
  data decodes the frame a second time with bytes put between the end of its last scan and the marker
  after it. A complete scan never reaches them, so both images are equal; a scan cut short decodes
  them in place of the decoder's fill (zero bits, or blank blocks) and the images differ. CharLS
  (pyjpegls) refuses a scan that ends early or late by itself, so it is tried first for JPEG-LS
  (whose decoding is exact, T.87: its pixels are libjpeg's) and a frame it decodes is decoded once;
* a Huffman-coded sequential or lossless JPEG frame is not smaller than its pixels need at the very
  least (:func:`minimum_bytes`, checked in the header pass before any decode): each 8 x 8 block
  takes two Huffman codes (DC, end of block), each lossless sample one, of one bit or more, so 5 kB
  cannot hold 16384 x 16384 pixels.

RLE frames are left to their decoders, which refuse a segment that does not decode to Rows x Columns
bytes (PS3.5 G.3.1), and to the header checks of :mod:`medload.ingest.encapsulated`.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from pydicom.encaps import encapsulate, get_frame
from pydicom.pixels import get_decoder
from pydicom.pixels.decoders.base import Decoder
from pydicom.uid import (
    HTJ2K,
    JPEG2000,
    UID,
    HTJ2KLossless,
    HTJ2KLosslessRPCL,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
)

from medload.errors import InputProblem

__all__ = ["check_structure", "decode_frame", "minimum_bytes", "JPEG_SYNTAXES", "J2K_SYNTAXES"]

JPEG_SYNTAXES = {JPEGBaseline8Bit, JPEGExtended12Bit, JPEGLossless, JPEGLosslessSV1, JPEGLSLossless,
                 JPEGLSNearLossless}
J2K_SYNTAXES = {JPEG2000Lossless, JPEG2000, HTJ2KLossless, HTJ2KLosslessRPCL, HTJ2K}
_LS_SYNTAXES = {JPEGLSLossless, JPEGLSNearLossless}

_SOI, _EOI, _SOS, _DRI, _TEM = 0xD8, 0xD9, 0xDA, 0xDD, 0x01
_RST = range(0xD0, 0xD8)
_LS_SOF = 0xF7                                           # JPEG-LS SOF55 (T.87 C.2.2)
_LOSSLESS_SOF = {0xC3, 0xC7, 0xCB, 0xCF}                 # T.81 lossless processes
SOF_MARKERS = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {_LS_SOF}  # not DHT, JPG, DAC
_ONE_SCAN_SOF = {0xC0, 0xC1, 0xC3, _LS_SOF}              # sequential / lossless: one scan per component
_HUFFMAN_MINIMUM = {0xC0: 2, 0xC1: 2, 0xC3: 1}           # bits per data unit at least (see minimum_bytes)
_SOC, _SOT, _EOC = b"\xff\x4f", b"\xff\x90", b"\xff\xd9"
_JP2_SIGNATURE = b"\x00\x00\x00\x0cjP  \r\n\x87\n"

#: Put between a JPEG / JPEG-LS scan and the marker after it by the completeness probe: no 0xFF (no
#: marker, no stuffing), and the first bit set, unlike the zero bits a decoder supplies past the end.
_FILLER = bytes(range(0x80, 0xC0))
#: Decoder plugins that refuse a scan ending early or late themselves (CharLS, for JPEG-LS).
_STRICT_PLUGINS = {"pyjpegls"}


def minimum_bytes(sof: int, width: int, height: int) -> int:
    """The fewest bytes a one-component Huffman-coded frame of ``width`` x ``height`` can take (0 when
    there is no such bound: arithmetic coding, progressive scans, JPEG-LS run mode)."""
    bits = _HUFFMAN_MINIMUM.get(sof)
    if bits is None:
        return 0
    units = width * height if sof in _LOSSLESS_SOF else -(-width // 8) * -(-height // 8)
    return -(-units * bits // 8)


def check_structure(codestream: bytes, syntax: str, frame: int) -> int | None:
    """Raise InputProblem (stage ``decode``) unless the codestream of ``frame`` (0-based) is whole; for
    a JPEG / JPEG-LS codestream return the offset where its last scan's entropy-coded data end."""
    if syntax in JPEG_SYNTAXES:
        return _JpegWalk(codestream, syntax in _LS_SYNTAXES, frame).run()
    if syntax in J2K_SYNTAXES:
        _check_j2k(codestream, frame)
    return None


def _problem(frame: int, what: str) -> InputProblem:
    return InputProblem("decode", f"the codestream of frame {frame + 1} {what}")


class _JpegWalk:
    """One pass over the markers of a JPEG (T.81) or JPEG-LS (T.87) codestream."""

    def __init__(self, data: bytes, ls: bool, frame: int) -> None:
        self.data, self.ls, self.frame = data, ls, frame
        self.sof: tuple[int, int, int, int] | None = None   # marker, width, height, components
        self.interval = 0
        self.scans = 0

    def run(self) -> int:
        data, n = self.data, len(self.data)
        if not data.startswith(b"\xff\xd8"):
            raise _problem(self.frame, "does not start with an SOI marker (FFD8)")
        i, scan_end = 2, 0
        while True:
            if i + 2 > n:
                raise _problem(self.frame, f"ends at byte {n} without its EOI marker (FFD9): truncated")
            if data[i] != 0xFF:
                raise _problem(self.frame, f"has byte {data[i]:02X} at offset {i} where a marker belongs: damaged")
            marker = data[i + 1]
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            if marker == _EOI:
                break
            if marker in _RST or marker in (_SOI, _TEM):
                raise _problem(self.frame, f"has marker FF{marker:02X} outside a scan at offset {i}: damaged")
            length = struct.unpack(">H", data[i + 2 : i + 4])[0] if i + 4 <= n else 0
            if length < 2 or i + 2 + length > n:
                raise _problem(self.frame, f"ends inside its FF{marker:02X} segment at offset {i}: truncated")
            body = data[i + 4 : i + 2 + length]
            if marker in SOF_MARKERS and len(body) >= 6:
                height, width = struct.unpack(">HH", body[1:5])
                self.sof = (marker, width, height, body[5])
            elif marker == _DRI and len(body) >= 2:
                self.interval = struct.unpack(">H", body[:2])[0]
            elif marker == _SOS:
                i = scan_end = self._scan(i + 2 + length)
                continue
            i += 2 + length
        if self.scans == 0:
            raise _problem(self.frame, "holds no scan (SOS): damaged")
        if self.sof is not None and self.sof[0] in _ONE_SCAN_SOF and self.sof[3] == 1 and self.scans != 1:
            raise _problem(self.frame, f"holds {self.scans} scans for one component: damaged")
        return scan_end

    def _scan(self, start: int) -> int:
        """Walk the entropy-coded data from ``start``; return the offset of the marker that ends them."""
        if self.sof is None:
            raise _problem(self.frame, "has a scan before its frame header (SOFn): damaged")
        data, n, restarts, j = self.data, len(self.data), 0, start
        while True:
            k = data.find(b"\xff", j)
            if k < 0 or k + 1 >= n:
                raise _problem(self.frame, f"ends inside scan {self.scans + 1}, without the marker that closes it: "
                                           "truncated")
            code = data[k + 1]
            if (code < 0x80) if self.ls else (code == 0x00):  # stuffing: a data byte 0xFF (T.81 F.1.2.3, T.87 A.1)
                j = k + 2
            elif code == 0xFF:  # fill byte before a marker
                j = k + 1
            elif code in _RST:
                if code - 0xD0 != restarts % 8:
                    raise _problem(self.frame, f"has RST{code - 0xD0} where RST{restarts % 8} belongs (offset {k}): "
                                               "restart intervals lost or damaged")
                restarts += 1
                j = k + 2
            else:
                break
        self.scans += 1
        self._check_restarts(restarts)
        return k

    def _check_restarts(self, restarts: int) -> None:
        marker, width, height, components = self.sof or (0, 0, 0, 0)
        if not self.interval:
            if restarts:
                raise _problem(self.frame, f"has {restarts} restart markers and no restart interval (DRI): damaged")
            return
        # T.81 only: one component, so an MCU is one 8 x 8 block, or one sample in the lossless process
        if self.ls or components != 1 or height == 0 or marker not in _ONE_SCAN_SOF:
            return
        mcus = width * height if marker in _LOSSLESS_SOF else -(-width // 8) * -(-height // 8)
        expected = -(-mcus // self.interval) - 1
        if restarts != expected:
            raise _problem(self.frame, f"holds {restarts} restart markers; {mcus} MCUs in intervals of "
                                       f"{self.interval} need {expected}: truncated or damaged")


def _check_j2k(data: bytes, frame: int) -> None:
    """SOC, the main header, then tile-parts chained by their Psot lengths up to EOC."""
    if data.startswith(_JP2_SIGNATURE):
        data = _jp2_codestream(data, frame)
    n = len(data)
    if not data.startswith(_SOC):
        raise _problem(frame, "does not start with an SOC marker (FF4F): damaged")
    i = 2
    while data[i : i + 2] != _SOT:  # main header: marker segments up to the first tile-part
        if i + 4 > n or data[i] != 0xFF or data[i : i + 2] == _EOC:
            raise _problem(frame, f"ends inside its main header at offset {i}, before any tile-part: truncated")
        i += 2 + struct.unpack(">H", data[i + 2 : i + 4])[0]
    while data[i : i + 2] == _SOT:
        if i + 12 > n:
            raise _problem(frame, f"ends inside the SOT segment at offset {i}: truncated")
        length = struct.unpack(">I", data[i + 6 : i + 10])[0]
        if length == 0:  # the last tile-part, running to EOC: only its decoder can tell where the data end
            return
        i += length
    if i + 2 > n:
        raise _problem(frame, f"ends at byte {n}, but its tile-part lengths (Psot) run to byte {i + 2}: truncated")
    if data[i : i + 2] != _EOC:
        raise _problem(frame, f"has no EOC marker (FFD9) at offset {i}, where its tile-part lengths (Psot) end: "
                              "damaged")


def _jp2_codestream(data: bytes, frame: int) -> bytes:
    """The contents of the contiguous codestream box (``jp2c``) of a JP2 file (ISO/IEC 15444-1 I.5)."""
    i = 0
    while i + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        head = 8
        if size == 1 and i + 16 <= len(data):
            size, head = struct.unpack(">Q", data[i + 8 : i + 16])[0], 16
        end = len(data) if size == 0 else i + size
        if kind == b"jp2c":
            if end > len(data):
                raise _problem(frame, f"has a JP2 codestream box of {size} bytes, {len(data) - i} left: truncated")
            return data[i + head : end]
        if size < head:
            break
        i = end
    raise _problem(frame, "is a JP2 file without a codestream box (jp2c): damaged")


def decode_frame(pixel_data: bytes, index: int, frames: int, syntax: str, **options: object) -> np.ndarray:
    """Frame ``index`` (0-based) of encapsulated ``pixel_data``, decoded and checked complete.

    ``options`` are pydicom's decoding options (rows, columns, bits_allocated...). Plugins are tried
    in pydicom's order (strict ones first, see :func:`_plugins`); the frame is checked with the plugin
    that decoded it. Raises InputProblem (stage ``decode``).
    """
    try:
        codestream = get_frame(pixel_data, index, number_of_frames=frames)
    except Exception as exc:  # pydicom raises several types on damaged items
        raise InputProblem("decode", f"cannot find frame {index + 1} in the Pixel Data: {type(exc).__name__}: "
                                     f"{exc}") from None
    scan_end = check_structure(codestream, syntax, index)
    try:
        decoder = get_decoder(syntax)
    except NotImplementedError as exc:
        raise InputProblem("decode", f"cannot decode {UID(syntax).name} pixel data: {exc}") from None
    failures = []
    for plugin in _plugins(decoder):
        try:
            values = _decode(decoder, codestream, plugin, options)
        except MemoryError:
            raise  # the worker names its memory cap
        except Exception as exc:  # decoder plugins raise their own types
            failures.append(f"{plugin}: {type(exc).__name__}: {exc}")
            continue
        if scan_end is not None and plugin not in _STRICT_PLUGINS:
            _probe(decoder, codestream, scan_end, plugin, options, values, index)
        return values
    name = UID(syntax).name
    raise InputProblem("decode", f"cannot decode {name} pixel data: " + ("; ".join(failures) or
                                 f"no decoder installed for {name}"))


def _plugins(decoder: Decoder) -> list[str]:
    """pydicom's order of preference (the order its plugins were added; ``available_plugins`` sorts by
    name), strict plugins first: JPEG-LS decoding is exact (T.87), so CharLS gives libjpeg's pixels."""
    order = list(getattr(decoder, "_available", None) or decoder.available_plugins)
    return sorted(order, key=lambda name: name not in _STRICT_PLUGINS)


def _decode(decoder: Decoder, codestream: bytes, plugin: str, options: dict[str, Any]) -> np.ndarray:
    # pydicom annotates the options as each a DecodeOptions (a dict of them all): passed as one such dict
    values, _ = decoder.as_array(encapsulate([codestream]), decoding_plugin=plugin, **{**options, "number_of_frames": 1})
    return values


def _probe(decoder: Decoder, codestream: bytes, scan_end: int, plugin: str, options: dict, values: np.ndarray,
           index: int) -> None:
    """Raise unless decoding with :data:`_FILLER` after the last scan gives ``values`` again (see the
    module docstring)."""
    before = codestream[:scan_end]
    if before.endswith(b"\xff"):  # JPEG-LS: a byte after 0xFF carries 7 bits (T.87 A.1); 0x7F: all set
        before += b"\x7f"
    try:
        same = np.array_equal(values, _decode(decoder, before + _FILLER + codestream[scan_end:], plugin, options))
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 -- a decoder that fails on the bytes put in has read them: the same verdict
        same = False
    if not same:
        raise InputProblem("decode", f"the {UID(decoder.UID).name} scan of frame {index + 1} ends before its "
                                     f"image does: the decoder ({plugin}) made up the missing pixels (codestream "
                                     "cut short, or damaged); refused")

"""Slice values on disk: a fixed header, a codec payload and a checksum.

Layout of one value (little endian)::

    offset 0   2s  magic b"ML"
           2   B   value format version (1)
           3   B   dtype code  (1 int16, 2 uint8, 3 uint16, 4 float32)
           4   B   codec id    (0 raw, 1 blosc2-lz4, 2 blosc2-zstd)
           5   3x  reserved (zero)
           8   I   rows
          12   I   columns
          16   ... payload (codec output of the C-ordered rows x columns array)
        end-8  Q   xxh3_64 of everything before it (header and payload)

No pickle: the payload is array bytes, so any language can read a store. The codec was chosen by
``benchmarks/codecs.py`` on real CT slices: blosc2 with LZ4 and bit-shuffle, the fastest to decode of
those that halve the bytes of HU int16 slices (figures in docs/store.md, "Slice codec (measured)").
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from types import ModuleType

import numpy as np
import xxhash

from medload.errors import ChecksumError, ConfigError, StoreFormatError

__all__ = ["CODECS", "DEFAULT_CODEC", "SliceCodec", "get_codec", "encode_value", "decode_value", "value_shape"]

_HEADER = struct.Struct("<2sBBB3xII")
_CHECK = struct.Struct("<Q")
_MAGIC = b"ML"
_VERSION = 1
_OVERHEAD = _HEADER.size + _CHECK.size

_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<i2"),
    2: np.dtype("u1"),
    3: np.dtype("<u2"),
    4: np.dtype("<f4"),
}
_DTYPE_CODES = {dt: code for code, dt in _DTYPES.items()}


def _blosc2() -> ModuleType:
    """python-blosc2, imported on the first slice encoded or decoded: importing it takes longer than the
    rest of ``import medload`` (it brings its own HTTP client and array engine), and ``ls``, ``info`` or
    ``--help`` never need it."""
    import blosc2

    return blosc2


@dataclass(frozen=True)
class SliceCodec:
    """A named way of turning a 2-D array into payload bytes and back (``blosc_codec``: a member name of
    ``blosc2.Codec``, or None for raw bytes)."""

    name: str
    codec_id: int
    blosc_codec: str | None = None
    clevel: int = 0

    def compress(self, array: np.ndarray) -> bytes:
        if self.blosc_codec is None:
            return array.tobytes()
        blosc2 = _blosc2()
        return blosc2.compress2(
            array,
            codec=blosc2.Codec[self.blosc_codec],
            clevel=self.clevel,
            filters=[blosc2.Filter.BITSHUFFLE],
            typesize=array.dtype.itemsize,
            nthreads=1,
        )

    def load(self) -> None:
        """Import the codec's library now (blosc2: 0.1-0.3 s of CPU), in a process about to fork the
        processes that encode, so that they inherit it instead of each importing it again."""
        if self.blosc_codec is not None:
            _blosc2()

    def decompress_into(self, payload: memoryview, out: np.ndarray) -> None:
        """Decode ``payload`` into the C-contiguous array ``out`` (no intermediate copy)."""
        if self.blosc_codec is None:
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, dtype=np.uint8)
        else:
            _blosc2().decompress2(payload, dst=out, nthreads=1)


CODECS: dict[str, SliceCodec] = {
    c.name: c
    for c in (
        SliceCodec("raw", 0),
        SliceCodec("blosc2-lz4", 1, "LZ4", 5),
        SliceCodec("blosc2-zstd", 2, "ZSTD", 1),
    )
}
_BY_ID = {c.codec_id: c for c in CODECS.values()}
DEFAULT_CODEC = "blosc2-lz4"


def get_codec(name: str) -> SliceCodec:
    """Return the codec called ``name`` (one of :data:`CODECS`)."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}: choose one of {', '.join(CODECS)}") from None


def encode_value(array: np.ndarray, codec: SliceCodec) -> bytes:
    """Encode a 2-D array (int16, uint8, uint16 or float32) as one store value."""
    if array.ndim != 2:
        raise ConfigError(f"a slice value must be 2-D, got shape {array.shape}")
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    code = _DTYPE_CODES.get(np.dtype(dtype))
    if code is None:
        raise ConfigError(f"dtype {array.dtype} cannot be stored: use int16, uint8, uint16 or float32")
    array = np.ascontiguousarray(array, dtype=_DTYPES[code])
    body = _HEADER.pack(_MAGIC, _VERSION, code, codec.codec_id, *array.shape) + codec.compress(array)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def _parse_header(value: bytes | memoryview) -> tuple[np.dtype, SliceCodec, int, int]:
    if len(value) < _OVERHEAD:
        raise ChecksumError(f"stored value of {len(value)} bytes is shorter than its header: the store is damaged")
    magic, version, code, codec_id, rows, cols = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != _VERSION:
        raise StoreFormatError(f"stored value has magic {magic!r} version {version}: not a medload v1 slice value")
    if code not in _DTYPES or codec_id not in _BY_ID:
        raise StoreFormatError(f"stored value has unknown dtype code {code} or codec id {codec_id}")
    return _DTYPES[code], _BY_ID[codec_id], rows, cols


def value_shape(value: bytes | memoryview) -> tuple[int, int]:
    """(rows, columns) of a stored value, read from its header alone."""
    _, _, rows, cols = _parse_header(value)
    return rows, cols


def decode_value(value: bytes | memoryview, *, verify: bool = True, out: np.ndarray | None = None,
                 on_decode: Callable[[float], None] | None = None) -> np.ndarray:
    """Decode one store value to a 2-D array; with ``verify``, check its xxh3_64 first.

    ``out``, when given, must be a C-contiguous array of the value's shape and dtype; it is filled and
    returned (this is how slab reads decode straight into one preallocated volume). ``on_decode`` is
    called with the seconds the decompression took (a read observer's hook, :mod:`medload.storage.observe`).
    """
    view = memoryview(value)
    dtype, codec, rows, cols = _parse_header(view)
    body = view[: len(view) - _CHECK.size]
    if verify:
        (expected,) = _CHECK.unpack_from(view, len(view) - _CHECK.size)
        if xxhash.xxh3_64_intdigest(body) != expected:
            raise ChecksumError("slice checksum mismatch: the store is damaged; run `medload verify` and re-ingest")
    if out is None:
        out = np.empty((rows, cols), dtype=dtype)
    elif out.shape != (rows, cols) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ConfigError(f"output buffer {out.shape} {out.dtype} does not fit a {rows}x{cols} {dtype} slice")
    t0 = perf_counter() if on_decode is not None else 0.0
    try:
        codec.decompress_into(body[_HEADER.size :], out)
    except (ValueError, RuntimeError) as exc:
        raise ChecksumError(f"slice payload does not decode as {rows}x{cols} {dtype}: {exc}") from exc
    if on_decode is not None:
        on_decode(perf_counter() - t0)
    return out

"""Keys of the slice store.

A series key is 16 bytes derived from the pseudonymised series identity and its split descriptor, so
the same source always gets the same key and no raw UID can be read back from it. A slice key is the
series key followed by the slice index as 4 big-endian bytes: the slices of one series are adjacent in
the B-tree, in z order, and a slab is one cursor range scan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from pathlib import Path

from medload.errors import ConfigError, SeriesNotFoundError

__all__ = ["SERIES_KEY_BYTES", "series_key", "slice_key", "split_slice_key", "key_hex", "parse_key_hex", "match_key"]

SERIES_KEY_BYTES = 16
_Z_BYTES = 4


def series_key(series_pseudonym: str, descriptor: str) -> bytes:
    """16-byte key of one stored volume: a hash of the series pseudonym and its split descriptor."""
    text = f"{series_pseudonym}|{descriptor}".encode()
    return hashlib.blake2b(text, digest_size=SERIES_KEY_BYTES, person=b"medload-series").digest()


def slice_key(key: bytes, z: int) -> bytes:
    """Key of slice ``z`` of series ``key``."""
    return key + z.to_bytes(_Z_BYTES, "big")


def split_slice_key(k: bytes) -> tuple[bytes, int]:
    """Inverse of :func:`slice_key`."""
    if len(k) != SERIES_KEY_BYTES + _Z_BYTES:
        raise ConfigError(f"a slice key has {SERIES_KEY_BYTES + _Z_BYTES} bytes, got {len(k)}")
    return k[:SERIES_KEY_BYTES], int.from_bytes(k[SERIES_KEY_BYTES:], "big")


def key_hex(key: bytes) -> str:
    """The printable form of a series key (32 hex digits), as ``medload ls`` shows it."""
    return key.hex()


def parse_key_hex(text: str) -> bytes:
    """Bytes of a full 32-digit hex series key."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a hex series key (see `medload ls`)") from None
    if len(key) != SERIES_KEY_BYTES:
        raise ConfigError(f"a series key has {2 * SERIES_KEY_BYTES} hex digits, {text!r} has {len(text)}")
    return key


def match_key(text: str, keys: Collection[bytes], store: str | Path, *, min_digits: int = 1) -> bytes:
    """The one key of ``keys`` (the series of ``store``) that ``text`` names: a full hex key, or a unique
    prefix of at least ``min_digits`` hex digits."""
    text = text.lower()
    if len(text) < min_digits:
        raise ConfigError(f"series key {text!r} is too short: give at least {min_digits} hex digits "
                          f"(`medload ls {store}` lists them)")
    if len(text) == 2 * SERIES_KEY_BYTES and all(c in "0123456789abcdef" for c in text) and bytes.fromhex(text) in keys:
        return bytes.fromhex(text)
    matches = [k for k in keys if k.hex().startswith(text)] if text else []
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise SeriesNotFoundError(f"no series key starts with {text!r} in {store}: list them with `medload ls {store}`")
    raise SeriesNotFoundError(f"{len(matches)} series keys start with {text!r}: give more digits")

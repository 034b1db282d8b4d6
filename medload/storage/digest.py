"""Content digests: a series digest that depends only on the stored voxel values and the grid shape.

The digest is independent of the codec and of shard layout, so two ingests of the same source -- on
one machine or on a cluster, with any worker count -- can be compared by digest alone
(``medload ls --json`` shows it).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

__all__ = ["slice_digest", "series_digest"]


def slice_digest(array: np.ndarray) -> bytes:
    """xxh3-128 of one slice's little-endian, C-ordered values."""
    a = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return xxhash.xxh3_128_digest(a.data)


def series_digest(slice_digests: Iterable[bytes], shape: tuple[int, int, int], dtype: str) -> str:
    """Hex xxh3-128 over the dtype, the (D, H, W) shape and the per-slice digests in z order."""
    h = xxhash.xxh3_128(f"{dtype}:{shape[0]}x{shape[1]}x{shape[2]}".encode())
    for d in slice_digests:
        h.update(d)
    return h.hexdigest()

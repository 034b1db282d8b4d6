"""Spans of slices for :class:`~medload.storage.store.Store` reads: bounds, runs of missing slices, and each
thread's scratch buffer."""

from __future__ import annotations

import threading

import numpy as np

from medload.errors import ConfigError
from medload.storage.records import SeriesRecord

__all__ = ["span_end", "scratch", "runs"]


def span_end(rec: SeriesRecord, z0: int, z1: int | None) -> int:
    """``z1`` (None: the series' end), once ``z0 <= z < z1`` is known to be inside the series."""
    depth = rec.shape[0]
    z1 = depth if z1 is None else z1
    if not 0 <= z0 < z1 <= depth:
        raise ConfigError(f"slices [{z0}, {z1}) are outside series {rec.key[:12]} of {depth} slices")
    return z1


_local = threading.local()


def scratch(n: int, hw: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """This thread's scratch array of ``n`` slices (reused: no page faults for fresh memory per read)."""
    buf = getattr(_local, "scratch", None)
    need = n * hw[0] * hw[1] * dtype.itemsize
    if buf is None or buf.nbytes < need:
        buf = _local.scratch = np.empty(max(need, 1 << 20), dtype=np.uint8)
    return buf[:need].view(dtype).reshape(n, *hw)


def runs(zs: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[a, b)`` of a sorted list of slice indices."""
    out: list[tuple[int, int]] = []
    for z in zs:
        if out and out[-1][1] == z:
            out[-1] = (out[-1][0], z + 1)
        else:
            out.append((z, z + 1))
    return out

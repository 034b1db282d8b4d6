"""The read path of a :class:`~medload.Store` below its public methods: slices of one series from the L1,
then each run of misses with one LMDB range scan in the fastest tier that holds the shard (its L2 hot
copy, else the store: :class:`~medload.storage.cache.tiered.ShardResolver`).

A miss the L1 admits is decoded into an array of its own, which the L1 keeps without a copy (unless it
went into ``out``). A damaged hot copy is dropped and the store read instead; a shard that ``compact``
or ``repair`` replaced since ``store.json`` was read raises :class:`ShardReplaced`, and the Store reads
again from the replacement. Read observers (:mod:`medload.storage.observe`) hear of L1 hits and fills,
range reads and decoding.
"""

from __future__ import annotations

from time import perf_counter

import lmdb
import numpy as np

from medload.errors import ChecksumError, ShardUnavailableError, StoreError, StoreFormatError
from medload.storage import read_spans
from medload.storage import shard as sh
from medload.storage.availability import repair_hint
from medload.storage.cache.lru import SliceLRU
from medload.storage.cache.tiered import ShardResolver
from medload.storage.keys import slice_key
from medload.storage.manifest import ShardEntry, replaced
from medload.storage.observe import Observers
from medload.storage.records import SeriesRecord
from medload.storage.value_reads import read_values

__all__ = ["ShardReplaced", "read_planes", "scan"]


class ShardReplaced(Exception):
    """A shard a Store read of is no longer in ``store.json``: the Store reads again (see :meth:`Store.refresh`)."""


def read_planes(tiers: ShardResolver, entry: ShardEntry, rec: SeriesRecord, db: bytes, dtype: np.dtype, z0: int,
                z1: int, verify: bool, *, out: np.ndarray | None, transient: bool, lru: SliceLRU | None,
                observers: Observers | None) -> list[np.ndarray]:
    """Slices ``z0 <= z < z1`` of ``rec`` in sub-database ``db`` of shard ``entry``: into ``out``, or as the
    L1's arrays and new ones (``transient``: this thread's scratch buffer for those the L1 does not keep)."""
    key = rec.key_bytes
    planes: list = [None] * (z1 - z0)
    missing = list(range(z0, z1))
    if lru is not None:
        missing = []
        for z in range(z0, z1):
            hit = lru.get((entry.digest, db, slice_key(key, z)))
            if hit is None:
                missing.append(z)
            elif out is None:
                planes[z - z0] = hit
            else:
                out[z - z0] = planes[z - z0] = hit
    hw = (rec.shape[1], rec.shape[2])
    nbytes = hw[0] * hw[1] * dtype.itemsize
    scratch = read_spans.scratch(len(missing), hw, dtype) if transient and out is None and missing else None
    spare = iter(scratch) if scratch is not None else None
    fills = 0
    for a, b in read_spans.runs(missing):
        kept = [lru is not None and lru.admits((entry.digest, db, slice_key(key, z)), nbytes) for z in range(a, b)]
        for z, keep in zip(range(a, b), kept):
            if out is not None:
                planes[z - z0] = out[z - z0]
            elif spare is not None and not keep:
                planes[z - z0] = next(spare)
            else:
                planes[z - z0] = np.empty(hw, dtype=dtype)
        scan(tiers, entry, db, key, a, b, planes[a - z0 : b - z0], verify, observers)
        for z, keep in zip(range(a, b), kept):
            if keep and lru is not None:  # kept only where there is an L1
                lru.put((entry.digest, db, slice_key(key, z)), planes[z - z0], copy=out is not None)
                fills += 1
    if observers is not None and lru is not None:
        observers.l1(z1 - z0 - len(missing), fills)
    return planes


def scan(tiers: ShardResolver, entry: ShardEntry, db: bytes, key: bytes, z0: int, z1: int,
         targets: list[np.ndarray], verify: bool, observers: Observers | None) -> None:
    """Slices ``z0..z1-1`` of series ``key`` into ``targets``, with one range scan of the fastest tier."""
    t0, decoded = (0.0, None) if observers is None else (perf_counter(), observers.decoded)
    root = tiers.root
    try:
        env, tier, path = tiers.env(entry)
        try:
            nbytes = read_values(env, path, db, key, z0, z1, targets, verify, decoded)
        except (StoreError, lmdb.Error) as exc:
            if tier != "l2":
                raise
            tiers.damaged(entry, exc)
            env, tier, path = tiers.env(entry)
            nbytes = read_values(env, path, db, key, z0, z1, targets, verify, decoded)
    except (StoreError, lmdb.Error) as exc:
        if not isinstance(exc, (ChecksumError, StoreFormatError)) and replaced(root, entry):
            raise ShardReplaced(entry.name) from None
        plane = "" if db == sh.SLICES else f" ({db.decode()})"
        what = f"slices {z0}-{z1 - 1}{plane} of series {key.hex()[:12]} in shard {entry.name} of {root}"
        error = type(exc) if isinstance(exc, (ChecksumError, StoreFormatError)) else ShardUnavailableError
        raise error(f"{what} do not read ({exc}): {repair_hint(root)}") from None
    tiers.count(tier, z1 - z0, nbytes)
    if observers is not None:
        observers.range_read(tier, z1 - z0, nbytes, perf_counter() - t0)

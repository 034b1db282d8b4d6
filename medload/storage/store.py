"""Reading a store: series records, slab reads through the cache tiers, quarantine records.

A slab read asks the in-process LRU (L1) for each slice, and finds each run of missing slices with
one LMDB cursor range scan in the fastest file that holds the shard: its hot copy on local SSD (L2)
or the store itself (L3). The values' bytes are read with positioned reads, not through LMDB's map,
and decoded straight into the output array; :meth:`Store.prefetch` has the kernel read the slices
of batches to come meanwhile (see :mod:`medload.storage.value_reads`).

A :class:`Store` is safe to hand to DataLoader workers under ``fork`` and ``spawn``: it pickles to its
path and cache settings, and LMDB environments are opened lazily in the process that uses them, once
per process for all Store objects (a pid check reopens them after a fork, following py-lmdb's rule that
an environment is never used across ``fork``).

A store with a shard that cannot be read opens degraded (see :mod:`medload.storage.availability`):
:meth:`Store.unavailable` names the shard, why, and its series; reading one of them raises
:class:`~medload.errors.ShardUnavailableError` saying what to do; every other series reads as before.

A read that finds its shard replaced by ``compact`` or ``repair`` since ``store.json`` was read re-reads
``store.json`` and reads the replacement: a training job keeps running while its store is compacted.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING

import lmdb
import numpy as np

from medload import windows
from medload.config import CacheConfig, parse_size
from medload.errors import (
    ConfigError,
    SeriesNotFoundError,
    ShardUnavailableError,
    StoreError,
)
from medload.storage import read_spans
from medload.storage import shard as sh
from medload.storage.availability import Unavailable, read_shards, repair_hint, unavailable
from medload.storage.cache.lru import shared_lru
from medload.storage.cache.tiered import ShardResolver
from medload.storage.keys import match_key, slice_key
from medload.storage.live import merge
from medload.storage.manifest import Manifest, read_manifest, replaced, shard_path
from medload.storage.observe import Observers, ReadObserver
from medload.storage.read_spans import span_end
from medload.storage.records import LabelRecord, RejectRecord, SeriesRecord
from medload.storage.rejects import current as current_rejects
from medload.storage.selection import require_series, slab_starts, thick_enough
from medload.storage.slab_reads import ShardReplaced, read_planes
from medload.storage.uri import monai_items
from medload.storage.value_reads import advise_values

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Store", "open_store"]

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {"int16": np.int16, "float32": np.float32, "uint8": np.uint8, "uint16": np.uint16}


def open_store(path: str | os.PathLike, cache: CacheConfig | str | int | None = None) -> Store:
    """Open the store at ``path`` for reading.

    ``cache`` is a :class:`~medload.config.CacheConfig` (L1 budget, hot directory and its budget), or
    just an L1 budget such as ``"512MB"``; by default a 256 MB L1 and no hot directory.

    Examples:
        >>> store = medload.open_store("stores/sample", cache="512MB")
        >>> rec = store.series()[0]
        >>> slab = store.read(rec.key, 10, 13)   # (3, rows, columns) HU int16, one range read
        >>> slab.shape, slab.dtype
        ((3, 512, 512), dtype('int16'))
    """
    return Store(path, cache)


def _cache_config(cache: CacheConfig | str | int | None) -> CacheConfig:
    if cache is None:
        return CacheConfig()
    if isinstance(cache, CacheConfig):
        return cache
    return CacheConfig(l1_bytes=parse_size(cache))


class Store:
    """Read access to a medload store (see :func:`open_store`).

    Examples:
        >>> store = medload.open_store("stores/sample")
        >>> [(len(r.key), r.shape) for r in store.series()]
        [(32, (28, 512, 512))]
        >>> store.read(store.series()[0].key[:6], 10, 13).shape     # a unique key prefix is enough
        (3, 512, 512)
    """

    def __init__(self, path: str | os.PathLike, cache: CacheConfig | str | int | None = None) -> None:
        self.path = Path(path)
        self.cache = _cache_config(cache)
        self.manifest: Manifest = read_manifest(self.path)
        self._entries = {s.name: s for s in self.manifest.shards}
        self._records: dict[bytes, SeriesRecord] | None = None
        self._labels: dict[bytes, LabelRecord] | None = None
        self._unavailable: list[Unavailable] = []
        self._tiers = ShardResolver(self.path, self.cache)
        self._observers: Observers | None = None  # see observe()

    # ---- pickling, refresh, close -----------------------------------------------------------
    def __getstate__(self) -> dict:
        return {"path": self.path, "cache": self.cache}

    def __setstate__(self, state: dict) -> None:
        Store.__init__(self, state["path"], state["cache"])

    def refresh(self) -> None:
        """Re-read ``store.json`` to see shards published since the store was opened (a read of a shard
        that compact or repair replaced meanwhile does this by itself)."""
        self.manifest = read_manifest(self.path)
        self._entries = {s.name: s for s in self.manifest.shards}
        self._records = None
        self._labels = None
        self._unavailable = []

    def close(self) -> None:
        """Close this process's LMDB handles on the store's shards (other Store objects of the same
        store reopen them on their next read)."""
        sh.close_reader_envs([shard_path(self.path, s.name) for s in self.manifest.shards])
        self._tiers.close()

    def observe(self, observer: ReadObserver) -> ReadObserver:
        """Call ``observer``'s hooks on every read of this Store object, in this process, until
        :meth:`unobserve` (see :mod:`medload.storage.observe`); returns it. Registering it again does nothing."""
        held = () if self._observers is None else self._observers.observers
        if observer not in held:
            self._observers = Observers((*held, observer))
        return observer

    def unobserve(self, observer: ReadObserver) -> None:
        """Stop calling ``observer`` (one that is not registered: nothing to do)."""
        held = tuple(o for o in (() if self._observers is None else self._observers.observers) if o is not observer)
        self._observers = Observers(held) if held else None

    def _meta_env(self, shard_name: str) -> lmdb.Environment:
        return sh.reader_env(shard_path(self.path, shard_name), self._entries[shard_name].bytes)

    # ---- records -----------------------------------------------------------------------------
    def _all_records(self) -> dict[bytes, SeriesRecord]:
        if self._records is None:
            return self._load_records()[0]
        return self._records

    def _all_labels(self) -> dict[bytes, LabelRecord]:
        if self._labels is None:
            return self._load_records()[1]
        return self._labels

    def _load_records(self) -> tuple[dict[bytes, SeriesRecord], dict[bytes, LabelRecord]]:
        """The live series and label records: a later shard's replacement supersedes earlier copies
        (see :mod:`medload.storage.live`); those in shards that cannot be read are unavailable.
        Kept (``_records``, ``_labels``) until the next :meth:`refresh`, and returned."""
        shards, down = read_shards(self.path, self.manifest)
        live = merge(shards)
        for (kind, key), (shard, why) in live.broken.items():
            log.warning("%s record %s in shard %s does not parse (%s): skipped; run `medload verify %s`",
                        kind, key.hex(), shard, why, self.path)
        self._unavailable = unavailable(self.manifest, live, down)
        self._records = records = dict(sorted(live.series.items()))
        self._labels = labels = live.labels
        return records, labels

    def unavailable(self) -> list[Unavailable]:
        """The shards that cannot be read, why, and the series (and labels) whose live copies they hold:
        :meth:`series` leaves those series out, and reading one raises ShardUnavailableError.

        Example:
            >>> store.unavailable()   # a healthy store
            []
        """
        self._all_records()
        return list(self._unavailable)

    def _lost(self, key: bytes, kind: str = "series") -> ShardUnavailableError | None:
        """The error of reading series ``key`` (or its label) whose live copy is in a shard that cannot be read."""
        for u in self._unavailable:
            if key.hex() in ((u.series if kind == "series" else u.labels) or ()):
                return ShardUnavailableError(f"{kind} {key.hex()[:12]} of {self.path} is in shard {u.shard}, which "
                                             f"cannot be read ({u.reason}): {repair_hint(self.path)}")
        return None

    def labels(self, key: str | bytes) -> LabelRecord | None:
        """The label record of a series (classes, per-slice foreground counts, source), or None."""
        return self._all_labels().get(self.record(key).key_bytes)

    def series(self) -> list[SeriesRecord]:
        """Records of every stored volume, sorted by key."""
        return list(self._all_records().values())

    def catalog(self) -> pd.DataFrame:
        """A pandas DataFrame of the series (scanner, kernel, geometry, labels, pseudonyms, shard), one
        row per series; its ``key`` column filters datasets (see :mod:`medload.storage.catalog`).

        Examples:
            >>> cat = store.catalog()
            >>> cat.groupby("kernel").slices.sum().to_dict()
            {'UB': 28}
            >>> len(SliceDataset(store, keys=cat.query("kernel == 'UB'").key))
            28
        """
        from medload.storage.catalog import catalog  # pandas loads on first use, not with medload

        return catalog(self)

    def record(self, key: str | bytes) -> SeriesRecord:
        """The record of one series, by key bytes, full hex key or a unique hex prefix."""
        records = self._all_records()
        lost = [bytes.fromhex(k) for u in self._unavailable for k in u.series or ()]
        if not isinstance(key, bytes):
            key = match_key(key, [*records, *lost], self.path)
        if key in records:
            return records[key]
        raise self._lost(key) or SeriesNotFoundError(f"no series {key.hex()} in {self.path}: list them with "
                                                     f"`medload ls {self.path}`")

    def rejects(self, *, include_skipped: bool = True) -> list[RejectRecord]:
        """Quarantine records: inputs that were rejected (and, by default, those skipped and those ignored as
        not DICOM), sorted by source; not those of a source a later ingest stored (see
        :mod:`medload.storage.rejects`)."""
        held: list[list[RejectRecord]] = []
        down = {u.shard for u in self.unavailable()}
        for entry in self.manifest.shards:
            if entry.name in down:
                log.warning("the quarantine records of shard %s are unavailable: it cannot be read", entry.name)
                continue
            env = self._meta_env(entry.name)
            with env.begin(buffers=True) as txn:
                dbs = sh.open_dbs(env, [sh.REJECTS], create=False, txn=txn)
                if sh.REJECTS in dbs:
                    held.append([RejectRecord.from_json(bytes(v))
                                 for v in txn.cursor(db=dbs[sh.REJECTS]).iternext(keys=False)])
        out = current_rejects(held)
        if not include_skipped:
            out = [r for r in out if r.status == "rejected"]
        return sorted(out, key=lambda r: (r.source, r.stage, r.reason))

    def items(self, *, context: int | None = None, depth: int | None = None, stride: int | None = None,
              plane: str | None = None, labels: bool = False, modality: str | Sequence[str] | None = None,
              kernel: str | Sequence[str] | None = None, thickness: tuple[float, float] | None = None,
              keys: str | Iterable[str] | None = None,
              orientation: str | Sequence[str] | None = None) -> list[dict[str, str | int]]:
        """Every 2.5D stack (``context=k``) or 3D slab (``depth=D``, every ``stride`` slices) as a dict
        for MONAI's ``LoadImaged(keys=..., reader=MedloadReader())``: ``"image"`` (and ``"label"`` with
        ``labels=True``) a ``medload:`` URI, plus the datasets' ``"key"`` (series key), ``"z"`` (the
        centre slice of a stack, the first slice of a slab) and ``"index"`` (position in the list).

        ``modality``, ``kernel``, ``thickness``, ``keys``, ``orientation`` filter the series as the datasets do (see
        :func:`~medload.storage.selection.select_series`), so ``items[i]`` is the sample ``i`` of a
        :class:`~medload.data.SliceDataset` (or :class:`~medload.data.SlabDataset`) with the same
        arguments. ``plane``: a uint8 plane stored at ingest instead of HU.

        Examples:
            >>> from monai.transforms import LoadImaged
            >>> from medload.data import MedloadReader
            >>> items = store.items(context=1, modality="CT")
            >>> sorted(items[1]), items[1]["z"], items[1]["index"]
            (['image', 'index', 'key', 'z'], 1, 1)
            >>> LoadImaged(keys=["image"], reader=MedloadReader())(items[1])["image"].shape   # as SliceDataset's
            torch.Size([3, 512, 512])
        """
        if (context is None) == (depth is None):
            raise ConfigError("give either context=k (2.5D stacks) or depth=D (3D slabs)")
        if context is not None and context < 0:
            raise ConfigError(f"context must be >= 0 neighbours, got {context}")
        records = require_series(self.series(), str(self.path), modality=modality, kernel=kernel, thickness=thickness,
                                 keys=keys, orientation=orientation)
        if depth is not None:
            records = thick_enough(records, depth)
        plane = None if plane is None else windows.stored(plane).name
        for rec in records:
            self._plane(rec, plane)  # a series without the stored plane fails here, not at its first load
        if labels and (missing := [r.key[:12] for r in records if r.key_bytes not in self._all_labels()]):
            raise ConfigError(f"{len(missing)} of {len(records)} series have no labels (e.g. {missing[0]}): "
                              "filter them out (keys=...) or ingest their labels")
        starts: Sequence[Iterable[int]] = ([range(r.shape[0]) for r in records] if depth is None
                                           else slab_starts(records, depth, stride or depth))
        return monai_items(self.path, [(rec.key, zs) for rec, zs in zip(records, starts)], context=context,
                           depth=depth, plane=plane, labels=labels)

    def stats(self) -> dict[str, dict[str, int] | None]:
        """This process's reads per tier: ``l1`` (hits, misses, bytes held, budget, entries, evictions),
        ``l2`` and ``l3`` (slices read, bytes of stored values, L2 misses and dropped damaged copies)."""
        out: dict[str, dict[str, int] | None] = {"l1": asdict(shared_lru(self.cache.l1_bytes).stats()) if self.cache.l1_bytes else None}
        out.update(self._tiers.stats())
        return out

    # ---- slices ------------------------------------------------------------------------------
    def read(self, key: str | bytes, z0: int = 0, z1: int | None = None, *, plane: str | None = None,
             verify: bool | None = None, out: np.ndarray | None = None, window: str | None = None) -> np.ndarray:
        """Slices ``z0 <= z < z1`` of a series as one ``(z1 - z0, rows, columns)`` array.

        HU int16 for CT (float32 where the rescale is not integral), or the uint8 planes of a window
        stored at ingest (``plane="lung"`` or ``"350/50"``; ``window=`` is its deprecated old spelling).
        Each value's checksum is verified unless ``verify=False`` (default: the cache settings'
        ``verify``). ``out``, a C-contiguous array of the right shape and dtype (e.g. a slot of a batch
        buffer), is filled and returned instead of a new one.
        """
        rec = self.record(key)
        return self._read(rec, *self._plane(rec, _plane_arg(plane, window, "read")), z0, z1, verify, out)

    def plane_dtype(self, key: str | bytes, plane: str | None = None, *, window: str | None = None) -> np.dtype:
        """The dtype :meth:`read` returns for this series (and stored plane)."""
        return self._plane(self.record(key), _plane_arg(plane, window, "plane_dtype"))[1]

    def _plane(self, rec: SeriesRecord, plane: str | None) -> tuple[bytes, np.dtype]:
        if plane is None:
            return sh.SLICES, np.dtype(_NUMPY_DTYPES[rec.dtype])
        name = windows.stored_name(plane, rec.windows)  # "350/50" names its custom window; "W8/L32" an old "8/32"
        if name is None:
            wanted = windows.get(plane)  # held to the rule now: a bare "40/400" is refused as probably swapped
            raise ConfigError(f"series {rec.key[:12]} has no stored {plane!r} planes (it has {list(rec.windows) or 'none'}): "
                              f"ingest them with `medload ingest ... --windows {wanted.name}`")
        return sh.window_db(name), np.dtype(np.uint8)

    def read_label(self, key: str | bytes, z0: int = 0, z1: int | None = None, *, verify: bool | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
        """The label map of slices ``z0 <= z < z1``, aligned voxel for voxel with :meth:`read`
        (uint8, or uint16 beyond 255 classes; 0 is background; see :meth:`labels` for class names)."""
        rec = self.record(key)
        label = self._all_labels().get(rec.key_bytes)
        if label is None and (lost := self._lost(rec.key_bytes, "label")) is not None:
            raise lost
        if label is None:
            raise ConfigError(f"series {rec.key[:12]} has no labels: ingest them with `medload ingest ... --labels`")
        return self._read(rec, sh.LABELS, np.dtype(label.dtype), z0, z1, verify, out, shard=label.shard)

    def planes(self, key: str | bytes, z0: int = 0, z1: int | None = None, *, plane: str | None = None,
               verify: bool | None = None, window: str | None = None, transient: bool = False) -> list[np.ndarray]:
        """Slices ``z0 <= z < z1`` as a list of ``(rows, columns)`` arrays, without copying what the L1
        cache holds: its arrays are returned themselves (read-only), slices it lacks are decoded (and
        cached). For a caller that converts each slice anyway -- the loader casts them straight into a
        float batch -- this saves a copy of every slice. Arguments as :meth:`read`; ``transient``: the
        slices the L1 does not keep are decoded into this thread's scratch buffer instead of new arrays,
        valid until its next transient read (for a caller that converts each slice at once).

        Examples:
            >>> [p.shape for p in store.planes(store.series()[0].key, 0, 2)]
            [(512, 512), (512, 512)]
        """
        rec = self.record(key)
        return self._planes(rec, *self._plane(rec, _plane_arg(plane, window, "planes")), z0, z1, verify,
                            transient=transient)

    def _read(self, rec: SeriesRecord, db: bytes, dtype: np.dtype, z0: int, z1: int | None,
              verify: bool | None, out: np.ndarray | None = None, shard: str | None = None) -> np.ndarray:
        z1 = span_end(rec, z0, z1)
        shape = (z1 - z0, rec.shape[1], rec.shape[2])
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ConfigError(f"out has shape {out.shape} {out.dtype}; reading needs a C-contiguous {shape} {dtype} array")
        self._planes(rec, db, dtype, z0, z1, verify, out, shard)
        return out

    def _planes(self, rec: SeriesRecord, db: bytes, dtype: np.dtype, z0: int, z1: int | None, verify: bool | None,
                out: np.ndarray | None = None, shard: str | None = None, transient: bool = False) -> list[np.ndarray]:
        """The read path of :meth:`read` (into ``out``) and :meth:`planes` (``out`` None: cached arrays as
        they are, the rest decoded into new arrays -- or, ``transient``, into this thread's scratch
        buffer, valid until its next transient read: for a caller that converts each slice at once).
        Where the shard was replaced since ``store.json`` was read, reads again from its replacement."""
        if self._observers is not None:
            slices, t0 = span_end(rec, z0, z1) - z0, perf_counter()
            try:
                return self._planes_again(rec, db, dtype, z0, z1, verify, out, shard, transient)
            finally:
                self._observers.read(slices, perf_counter() - t0)
        return self._planes_again(rec, db, dtype, z0, z1, verify, out, shard, transient)

    def _planes_again(self, rec: SeriesRecord, db: bytes, dtype: np.dtype, z0: int, z1: int | None,
                      verify: bool | None, out: np.ndarray | None, shard: str | None, transient: bool) -> list[np.ndarray]:
        """:meth:`_planes`, read again (at most three times) from a shard's replacement."""
        for _ in range(3):
            try:
                return self._planes_in(rec, db, dtype, z0, z1, verify, out, shard, transient)
            except ShardReplaced as gone:
                log.info("shard %s of %s was replaced since store.json was read: reading it again", gone, self.path)
                self.refresh()
                rec = self.record(rec.key_bytes)
                shard = None if shard is None else self._all_labels()[rec.key_bytes].shard  # compact keeps labels
        raise ShardUnavailableError(f"the shard of series {rec.key[:12]} of {self.path} was replaced three times "
                                    "while it was read: wait for `medload compact` to finish, then read again")

    def _planes_in(self, rec: SeriesRecord, db: bytes, dtype: np.dtype, z0: int, z1: int | None, verify: bool | None,
                   out: np.ndarray | None, shard: str | None, transient: bool) -> list[np.ndarray]:
        """:meth:`_planes` from the shards this Store knows (:func:`~medload.storage.slab_reads.read_planes`)."""
        lru = shared_lru(self.cache.l1_bytes) if self.cache.l1_bytes else None
        return read_planes(self._tiers, self._entries[shard or rec.shard], rec, db, dtype, z0, span_end(rec, z0, z1),
                           self.cache.verify if verify is None else verify, out=out, transient=transient, lru=lru,
                           observers=self._observers)

    # ---- read-ahead --------------------------------------------------------------------------
    def prefetch(self, spans: Iterable[tuple[str | bytes, int, int]], *, plane: str | None = None, labels: bool = False, window: str | None = None) -> None:
        """Have the operating system start reading these slices from disk now, without waiting: each
        span is ``(key, z0, z1)``. A loader calls it for the batches it will read next, so that their
        disk reads overlap the decoding of this one (see :mod:`medload.storage.value_reads`); slices
        the L1 holds are skipped. ``plane``: of this stored plane (as :meth:`read`); ``labels``: their
        label maps too.

        Examples:
            >>> key = store.series()[0].key
            >>> store.prefetch([(key, 10, 13), (key, 20, 23)])   # returns at once
            >>> store.read(key, 10, 13).shape   # from the page cache, if the disk was quick enough
            (3, 512, 512)
        """
        plane = _plane_arg(plane, window, "prefetch")
        items = [(self.record(key), z0, z1) for key, z0, z1 in spans]
        if items:
            self._prefetch(items, self._plane(items[0][0], plane)[0])
            if labels:
                self._prefetch([item for item in items if self._all_labels().get(item[0].key_bytes)], sh.LABELS)

    def prefetch_labels(self, spans: Iterable[tuple[str | bytes, int, int]]) -> None:
        """:meth:`prefetch` of the label maps of ``spans`` (``(key, z0, z1)`` each) alone, for a caller
        whose labels span other slices than its images (a 2.5D stack's label is its centre slice's)."""
        items = [(self.record(key), z0, z1) for key, z0, z1 in spans]
        self._prefetch([item for item in items if self._all_labels().get(item[0].key_bytes)], sh.LABELS)

    def _prefetch(self, items: list[tuple[SeriesRecord, int, int]], db: bytes) -> None:
        """:meth:`prefetch` of ``(record, z0, z1)`` spans of sub-database ``db`` (``LABELS``: their labels)."""
        lru = shared_lru(self.cache.l1_bytes) if self.cache.l1_bytes else None
        groups: dict[str, list[tuple[bytes, int, int]]] = {}
        for rec, z0, z1 in items:
            shard = self._all_labels()[rec.key_bytes].shard if db == sh.LABELS else rec.shard
            digest = self._entries[shard].digest
            zs = [z for z in range(z0, span_end(rec, z0, z1))
                  if lru is None or (digest, db, slice_key(rec.key_bytes, z)) not in lru]
            groups.setdefault(shard, []).extend((rec.key_bytes, a, b) for a, b in read_spans.runs(zs))
        for shard, runs in groups.items():
            if runs:
                try:
                    env, _, path = self._tiers.env(self._entries[shard])
                except (StoreError, lmdb.Error):
                    if not replaced(self.path, self._entries[shard]):
                        raise
                    self.refresh()  # read-ahead only: the reads themselves find the replacement
                    return
                advise_values(env, path, db, runs)


def _plane_arg(plane: str | None, window: str | None, method: str) -> str | None:
    """The stored plane a read asks for: ``plane=``, or ``window=``, its old spelling (deprecated: "window"
    now only means windowing HU on the fly, as ``make_loader(window=)`` does)."""
    if window is None:
        return plane
    if plane is not None:
        raise ConfigError(f"Store.{method}: give plane={plane!r} alone (window= is its deprecated old spelling)")
    warnings.warn(f"Store.{method}(window=...) is deprecated and goes in the next release: it reads a stored plane, "
                  f"so spell it plane={window!r}", DeprecationWarning, stacklevel=3)
    return window

"""The contenders of the loading benchmark (``medload bench``, ``benchmarks/loading.py``), and why each
is a fair peer.

A sample is ``depth`` consecutive slices ``z0 .. z0+depth-1`` of one series: a 2.5D sample
(``depth=3``) is laid out as channels, ``(3, rows, columns)``; a 3D sample is a slab
``(1, depth, rows, columns)``. A batch is a float32 tensor ``(B, *sample)`` in 0..1 under the
soft-tissue window 400/40, i.e. ``(clip(HU, -160, 240) + 160) / 400``, on ``device``. A contender is a
function ``(prepared, batch_size, num_workers, device) -> iterable of batches``: the call sets up
(fills caches) outside the timed passes, and each ``iter()`` is one pass over the prepared sample
list, in order, so every contender reads the same samples. All of them start from the same CT: DICOM
folders, the medload stores ingested from them, and .npy volumes of the same HU.

- ``monai_load_dicom``: what a MONAI user writes first: ``LoadImaged(reader="PydicomReader")`` on the
  series' DICOM folder, ``EnsureChannelFirstd``, a small MapTransform taking the sample's slices,
  ``ScaleIntensityRanged(a_min=-160, a_max=240, b_min=0, b_max=1, clip=True)``,
  ``EnsureTyped(track_meta=False)`` (MONAI's own advice for speed) and a torch DataLoader with default
  collate. It reads and decodes the whole series for every sample: that is the point of the row.
- ``monai_cache_dataset``: ``CacheDataset`` of the volumes (LoadImaged + EnsureChannelFirstd cached in
  RAM before the DataLoader forks its workers, which share it copy-on-write; ``copy_cache=False``
  because the per-sample crop never writes to the cached volume), then crop + window per sample. The
  strongest MONAI set-up when the data fit in RAM.
- ``monai_persistent_dataset``: the same volume cache kept by ``PersistentDataset`` (``torch.save``
  files in a cache directory, filled before timing): each sample loads its whole cached volume.
- ``monai_lmdb_dataset``: the same with ``LMDBDataset``, MONAI's LMDB-backed persistent cache (one
  pickled volume per LMDB value).
- ``npy_memmap``: the nnU-Net way: each volume saved once as int16 .npy; an item is
  ``np.load(path, mmap_mode="r")[z0:z0+depth]`` windowed to float32 with numpy, default collate. It
  reads only the bytes of the sample, so ratios are given against it.
- ``ceiling_float32``: no DataLoader and no Python per sample beyond a loop: the int16 slices read from
  the medload store's LMDB (``txn.get`` + :func:`~medload.storage.codec.decode_value`, no checksum)
  into a reused buffer and windowed into a reused float32 batch; ``num_workers`` is its thread count
  (0 or 1: one thread; N: N threads, each filling its share of the batch). What any loader over the
  store can reach without a cache of decoded slices. python-blosc2's ``decompress2`` holds the GIL
  (two threads decode no faster than one), so threads speed up only the windowing.
- ``ceiling_int16``: the same without the window: the int16 batch a GPU path would ship (windowing on
  the GPU). Its batches are int16 HU, not 0..1.
- ``medload``: :class:`medload.data.SliceDataset` (HU int16, ``context=depth//2``) or
  :class:`medload.data.SlabDataset` (``depth``, ``stride=1``) over every slice of the series, the
  benchmark's samples picked by a sampler, and :func:`medload.data.make_loader` with the soft-tissue
  window applied by the loader (on the device). It reads through a 256 MB L1 of decoded slices per
  process (the memory target: peak PSS <= 1 GB with 2 workers): what the L1 holds is served from RAM
  in later passes, as CacheDataset's volumes are; what does not fit is read again from the store.
  Each process's cache counters (:meth:`medload.Store.stats`: L1 hits and misses, L3 slices read) are
  gathered from every DataLoader worker and reported with the row.
- ``medload_uint8``: the same reading the soft-tissue uint8 planes stored at ingest
  (``plane="soft_tissue"``); values are the stored planes / 255, within 0.5/255 of the float window.
- ``medload_int16``: the same loader with ``dtype=torch.int16``: HU batches as stored, unwindowed --
  what the GPU path ships for windowing on the device -- compared with ``ceiling_int16``. On the CPU
  it measures that path's host side (a pinned copy and the transfer are left out); with
  ``--device cuda`` its batches land on the GPU.

The MONAI volume caches hold what LoadImaged returns (float32, its default). Caching each sample
instead of each volume (crop inside the cached transforms) would make the persistent caches read one
sample rather than a volume, at the price of storing every slice ``depth`` times in float32 and of a
sample list fixed before the first epoch; we cache volumes, as MONAI's examples do, and crop per
sample. MONAI's PydicomReader (1.6.1) stacks a DICOM folder by InstanceNumber, not by position, so the
benchmark writes synthetic series whose InstanceNumbers follow the slice order, and skips the MONAI
contenders on a user's series where they do not (it would stack another volume).

Besides these, a contender may be named ``module:function`` or ``path/to/file.py:function``: your own
loader, with the signature above, in the same table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from medload.windows import get as get_window

if TYPE_CHECKING:
    from medload.bench.loading_data import Prepared

__all__ = ["CONTENDERS", "CEILINGS", "MEDLOAD", "MONAI", "WINDOW", "L1_BUDGET", "PeerUnavailable", "Contender",
           "resolve", "window_into", "device_batches", "npy_memmap", "ceiling_float32", "ceiling_int16",
           "medload_loader", "medload_uint8", "medload_int16", "INT16"]

WINDOW = get_window("soft_tissue")
_LOW, _HIGH = (np.float32(b) for b in WINDOW.bounds)
_WIDTH = _HIGH - _LOW
L1_BUDGET = "256MB"
"""The L1 budget of the medload contenders (per process: the trainer and each DataLoader worker)."""

Contender = Callable[["Prepared", int, int, str], Iterable[torch.Tensor]]


class PeerUnavailable(RuntimeError):
    """A contender cannot run here or on these data (reported as skipped, with this message)."""


def window_into(hu: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = (clip(hu, low, high) - low) / width`` in float32, with no temporary array."""
    np.subtract(hu, _LOW, out=out, dtype=np.float32)
    np.clip(out, np.float32(0), _WIDTH, out=out)
    np.divide(out, _WIDTH, out=out)
    return out


class device_batches:  # noqa: N801 - used like a function
    """Re-iterable: the ``"image"`` of each batch of a torch DataLoader over ``dataset``, on ``device``."""

    def __init__(self, dataset: Dataset, batch_size: int, num_workers: int, device: str) -> None:
        self.device = torch.device(device)
        self.loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                 pin_memory=self.device.type == "cuda")

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.loader:
            yield batch["image"].to(self.device, non_blocking=True)


# ---- nnU-Net style: int16 .npy volumes, memory-mapped ---------------------------------------------
class NpySamples(Dataset):
    """Sample ``i``: slices ``z0 .. z0+depth-1`` of a memory-mapped int16 .npy volume, windowed to
    float32 and shaped ``shape`` (``(depth, H, W)`` for 2.5D, ``(1, depth, H, W)`` for 3D)."""

    def __init__(self, paths: list[str], series_index: np.ndarray, z0: np.ndarray, depth: int,
                 shape: tuple[int, ...]) -> None:
        self.paths, self.series_index, self.z0, self.depth, self.shape = paths, series_index, z0, depth, shape

    def __len__(self) -> int:
        return len(self.z0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        volume = np.load(self.paths[self.series_index[i]], mmap_mode="r")
        z0 = int(self.z0[i])
        hu = volume[z0 : z0 + self.depth]
        return {"image": torch.from_numpy(window_into(hu, np.empty(hu.shape, np.float32)).reshape(self.shape))}


def npy_memmap(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    npys = [s.npy for s in prep.series if s.npy is not None]
    if len(npys) < len(prep.series):
        raise PeerUnavailable("no .npy volumes were prepared")
    dataset = NpySamples(npys, prep.series_index, prep.z0, prep.depth, prep.sample_shape)
    return device_batches(dataset, batch_size, num_workers, device)


# ---- ceilings: the store's LMDB read by hand into reused buffers --------------------------------
class _Ceiling:
    """Batches from the medload store's LMDB: ``txn.get`` + ``decode_value`` into reused buffers."""

    def __init__(self, prep: Prepared, batch_size: int, threads: int, device: str, windowed: bool) -> None:
        from medload.storage import shard as sh
        from medload.storage.manifest import shard_path
        from medload.storage.store import open_store

        store = open_store(prep.store, cache=0)
        shards = {r.key: r.shard for r in store.series()}
        self.envs = [sh.reader_env(shard_path(store.path, shards[s.key])) for s in prep.series]
        self.dbs = [env.open_db(sh.SLICES, create=False) for env in self.envs]
        self.keys = [bytes.fromhex(s.key) for s in prep.series]
        self.series_index, self.z0, self.depth = prep.series_index, prep.z0, prep.depth
        self.batch_size, self.threads, self.windowed = batch_size, max(1, threads), windowed
        shape = (batch_size, *prep.sample_shape)
        self.host = np.empty(shape, np.float32 if windowed else np.int16)
        self.planes = self.host.reshape(batch_size, prep.depth, prep.rows, prep.cols)  # a view: slices of a sample
        self.scratch = np.empty((self.threads, prep.depth, prep.rows, prep.cols), np.int16)
        self.device = torch.device(device)
        self.out = torch.from_numpy(self.host)
        if self.device.type != "cpu":
            self.out = torch.empty(shape, dtype=self.out.dtype, device=self.device)
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def _fill(self, part: int, first: int, lo: int, hi: int) -> None:
        from medload.storage.codec import decode_value
        from medload.storage.keys import slice_key

        for b in range(lo, hi):
            s, z0 = self.series_index[first + b], int(self.z0[first + b])
            dst = self.scratch[part] if self.windowed else self.planes[b]
            with self.envs[s].begin(buffers=True) as txn:
                for c in range(self.depth):
                    decode_value(txn.get(slice_key(self.keys[s], z0 + c), db=self.dbs[s]), verify=False,
                                 out=dst[c])
            if self.windowed:
                window_into(dst, self.planes[b])

    def __iter__(self) -> Iterator[torch.Tensor]:
        n = len(self.z0)
        for first in range(0, n, self.batch_size):
            size = min(self.batch_size, n - first)
            cuts = np.linspace(0, size, self.threads + 1).astype(int)
            if self.pool is None:
                self._fill(0, first, 0, size)
            else:
                list(self.pool.map(self._fill, range(self.threads), [first] * self.threads, cuts[:-1], cuts[1:]))
            if self.device.type == "cpu":
                yield self.out[:size]
            else:
                self.out[:size].copy_(torch.from_numpy(self.host[:size]))
                yield self.out[:size]


def ceiling_float32(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    return _Ceiling(prep, batch_size, num_workers, device, windowed=True)


def ceiling_int16(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    return _Ceiling(prep, batch_size, num_workers, device, windowed=False)


# ---- medload ------------------------------------------------------------------------------------
class _Images:
    """Re-iterable: ``batch["image"]`` of each batch of a medload loader, plus the cache counters
    (``trainer``: the store the loader reads in this process when it has no workers; ``baseline``:
    this process's counters when the loader was made, subtracted from its row)."""

    def __init__(self, loader: Iterable[Any], counters: torch.Tensor, baseline: torch.Tensor, trainer=None) -> None:
        self.loader, self.counters, self.baseline, self.trainer = loader, counters, baseline, trainer

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.loader:
            yield batch["image"]

    def cache_stats(self) -> dict:
        """Every process's counters summed; ``l1_hit_rate`` = hits / (hits + misses) (None: no lookups);
        ``l1_bytes`` is the largest L1 of one process."""
        from medload.bench.counted import COUNTERS, counted_now

        counters = self.counters.clone()
        if self.trainer is not None:  # the trainer read (num_workers=0): count only this loader's reads
            counters[0] = counted_now(self.trainer) - self.baseline
        rows = counters.tolist()
        total = {name: sum(r[i] for r in rows) for i, name in enumerate(COUNTERS)}
        total["l1_bytes"] = max(r[COUNTERS.index("l1_bytes")] for r in rows)
        lookups = total["l1_hits"] + total["l1_misses"]
        total["l1_hit_rate"] = total["l1_hits"] / lookups if lookups else None
        total["l1_budget_mb"] = int(L1_BUDGET.removesuffix("MB"))
        cost = getattr(self.loader, "cost", None)  # the training thread inside next(loader), warm-up included
        if cost is not None:
            total["next_ms"], total["next_cpu_ms"] = cost.wall_ms_per_batch, cost.cpu_ms_per_batch
        return total


def _medload(prep: Prepared, batch_size: int, num_workers: int, device: str, plane: str | None,
             dtype: torch.dtype = torch.float32) -> Iterable[torch.Tensor]:
    try:
        from medload.bench.counted import COUNTERS, CountedSlabs, CountedSlices, counted_now
        from medload.data import make_loader
    except ImportError as exc:
        raise PeerUnavailable(f"not available yet: medload.data ({exc})") from exc
    from medload.storage.store import open_store

    path = prep.store if plane is None else prep.store_u8
    if path is None:
        raise PeerUnavailable("no store with stored uint8 planes was prepared")
    store = open_store(path, cache=L1_BUDGET)
    keys = [s.key for s in prep.series]
    ds: CountedSlabs | CountedSlices
    if prep.kind == "3d":
        ds = CountedSlabs(store, depth=prep.depth, stride=1, plane=plane, labels=False, keys=keys)
        first = prep.z0
    else:
        ds = CountedSlices(store, context=prep.depth // 2, plane=plane, labels=False, keys=keys)
        first = prep.z0 + prep.depth // 2  # the centre slice
    ds.counters = torch.zeros((num_workers + 1, len(COUNTERS)), dtype=torch.int64).share_memory_()
    baseline = counted_now(store)
    baseline[COUNTERS.index("l1_bytes")] = 0  # a level, not a count
    # the dataset has every slice (or slab) of every series; a sampler picks the benchmark's samples, in order
    position = {(ds.index.keys[s], int(z)): i for i, (s, z) in enumerate(zip(ds.index.series, ds.index.z))}
    order = [position[(prep.series[s].key, int(z))] for s, z in zip(prep.series_index, first)]
    loader = make_loader(ds, batch_size=batch_size, num_workers=num_workers, device=device, shuffle=False,
                         sampler=order, window=WINDOW.name if plane is None and dtype.is_floating_point else None,
                         dtype=dtype)
    return _Images(loader, ds.counters, baseline, trainer=None if num_workers else store)


def medload_loader(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    return _medload(prep, batch_size, num_workers, device, plane=None)


def medload_uint8(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    return _medload(prep, batch_size, num_workers, device, plane=WINDOW.name)


def medload_int16(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    return _medload(prep, batch_size, num_workers, device, plane=None, dtype=torch.int16)


# ---- the registry -------------------------------------------------------------------------------
def _monai(name: str) -> Contender:
    """A MONAI contender, imported when called (so the other contenders' processes never load MONAI)."""

    def run(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
        if prep.monai_note:
            raise PeerUnavailable(prep.monai_note)
        return getattr(import_module("medload.bench.monai_peers"), name)(prep, batch_size, num_workers, device)

    run.__name__ = name
    return run


CONTENDERS: dict[str, Contender] = {
    "monai_load_dicom": _monai("monai_load_dicom"),
    "monai_cache_dataset": _monai("monai_cache_dataset"),
    "monai_persistent_dataset": _monai("monai_persistent_dataset"),
    "monai_lmdb_dataset": _monai("monai_lmdb_dataset"),
    "npy_memmap": npy_memmap,
    "medload": medload_loader,
    "medload_uint8": medload_uint8,
    "medload_int16": medload_int16,
    "ceiling_float32": ceiling_float32,
    "ceiling_int16": ceiling_int16,
}
"""Every contender by name, in table order."""

CEILINGS = ("ceiling_float32", "ceiling_int16")
"""Contenders without a DataLoader: their ``num_workers`` is a thread count."""
MEDLOAD = ("medload", "medload_uint8")
"""medload's own contenders (the rows the ratio table compares with every peer)."""
INT16 = ("medload_int16", "ceiling_int16")
"""Contenders whose batches are int16 HU, unwindowed (compared with ``ceiling_int16``)."""
MONAI = ("monai_load_dicom", "monai_cache_dataset", "monai_persistent_dataset", "monai_lmdb_dataset")


def resolve(name: str) -> Contender:
    """A contender by its registry name, or ``module:function`` / ``path/to/file.py:function``."""
    if name in CONTENDERS:
        return CONTENDERS[name]
    if ":" not in name:
        raise KeyError(f"unknown contender {name!r}: choose from {', '.join(CONTENDERS)} or give module:function")
    where, func = name.rsplit(":", 1)
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_bench_contender_{Path(where).stem}", where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import contender file {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = import_module(where)
    return getattr(module, func)

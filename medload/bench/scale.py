"""The scale section of ``medload bench``: loading when the store is far larger than the L1 cache, with
the page cache warm and cold.

Data: ``series`` synthetic CT series of ``slices`` slices (default 100 x 128 of 512 x 512: 12,800 slices,
about 3 GB of store, 6.7 GB of int16 and 25x the default 256 MB L1 when decoded), written as DICOM --
``distinct`` phantoms (:mod:`medload.synthetic`), the other series copies of them under new UIDs, which
changes nothing for reading -- and ingested by medload; the DICOM is then deleted, and every series is
written again in each peer's format (:mod:`medload.bench.scale_peers`): .npy, zarr, HDF5, nnU-Net.

Samples: random 2.5D stacks (three neighbouring slices of a random series), batches of 8 windowed to
float32 soft tissue. Each run -- one contender, ``num_workers``, page cache mode -- is a fresh process
that sets up, then reads one iterator through ``repeats`` passes: ``warmup`` batches, then up to
``batches`` timed ones (or ``max_pass_s`` seconds of them). Passes never repeat a sample, as an epoch
over an archive would not within the reach of any cache; so the L1 (256 MB per process, the memory
target) holds what it can and is mostly missed, as in training on such a store.

- ``warm``: before the run, the contender's own files are read once, so they are in the page cache.
- ``cold``: before each pass, the pages of *every* format's files are dropped from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file: :func:`~medload.bench.common.evict_page_cache`).
  The kernel cannot drop a page some process has mapped, so a reader that keeps pages mapped (LMDB's
  B-tree pages, a few per megabyte of store) keeps those warm; value bytes medload reads are never
  mapped (:mod:`medload.storage.value_reads`). The warm-up batches absorb the batches DataLoader
  workers had read ahead before the pages were dropped.

Reported per run: samples/s (median of the passes, min-max), MB read from disk per timed sample
(``/proc/<pid>/io`` of the run's processes, readahead included), medload's L1 hit rate, peak PSS of the
process tree; medload's ratio to the best peer at the same mode and workers; and the compressed bytes of
a sample's three slices in the store, against which medload's disk reads are a target.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medload.bench.common import data_files, evict_page_cache, loader_row, peak_pss, read_files, tree_bytes
from medload.bench.peers import L1_BUDGET, PeerUnavailable

__all__ = ["ScaleSettings", "SCALE_CONTENDERS", "FORMAT_OF", "prepare_scale", "run_scale", "run_continuous", "sample_bytes"]

SCALE_CONTENDERS = ("medload", "npy_memmap", "zarr_blosc", "hdf5_chunked", "monai_cache_thread", "nnunet")
"""The contenders of the section, in table order."""
FORMAT_OF = {"medload": "store", "npy_memmap": "npy", "monai_cache_thread": "npy", "zarr_blosc": "zarr",
             "hdf5_chunked": "hdf5", "nnunet": "nnunet"}
"""Which prepared files each contender reads (warmed before its ``warm`` runs)."""
MODES = ("warm", "cold")
_SERVERS = {"base": ["medload.bench.scale"]}
"""One fork server, with what every contender needs (torch, numpy): each imports its own libraries in its
own process (medload.data, zarr, h5py, MONAI, nnunetv2), so their pages count in its memory alone."""


@dataclass(frozen=True)
class ScaleSettings:
    """Sizes and repeats of the scale section (see the module docstring)."""

    series: int = 100
    slices: int = 128
    size: int = 512
    distinct: int = 8
    workers: tuple[int, ...] = (0, 2)
    modes: tuple[str, ...] = MODES
    warmup: int = 6
    batches: int = 30
    repeats: int = 3
    max_pass_s: float = 10.0
    batch_size: int = 8
    contenders: tuple[str, ...] = SCALE_CONTENDERS
    timeout: float = 1800.0

    @property
    def samples(self) -> int:
        return self.repeats * (self.warmup + self.batches) * self.batch_size


# ---- the data -------------------------------------------------------------------------------------------
def _disk_needed(settings: ScaleSettings) -> int:
    """Bytes the data take at their peak (DICOM and store and the peers' formats: about 4.5x the HU)."""
    return int(4.5 * settings.series * settings.slices * settings.size**2 * 2)


def _synthetic_archive(dicom: Path, settings: ScaleSettings) -> None:
    """``settings.series`` series as DICOM: ``distinct`` phantoms, the rest copies under new UIDs."""
    import pydicom
    from pydicom.uid import generate_uid

    from medload.bench.loading_data import make_synthetic

    distinct = max(1, min(settings.distinct, settings.series))
    bases = make_synthetic(dicom, series=distinct, slices=settings.slices, rows=settings.size, cols=settings.size)
    for i in range(distinct, settings.series):
        out = dicom / f"series{i:03d}"
        out.mkdir(parents=True)
        series_uid, study_uid = generate_uid(), generate_uid()
        for path in bases[i % distinct].paths:
            ds = pydicom.dcmread(path)
            ds.SeriesInstanceUID, ds.StudyInstanceUID, ds.SeriesNumber = series_uid, study_uid, i + 1
            ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
            ds.PatientID = f"SCALE{i:04d}"
            ds.save_as(out / path.name)


def _write_peers(root: Path, case: str, key: str, volume: np.ndarray, formats: dict[str, str]) -> None:
    """One series in every peer's format whose library is installed (``formats``: those written)."""
    from medload.bench.scale_peers import write_hdf5, write_nnunet, write_zarr

    jobs = {"zarr": lambda: write_zarr(root / "zarr" / f"{key}.zarr", volume),
            "hdf5": lambda: write_hdf5(root / "hdf5" / f"{key}.h5", volume),
            "nnunet": lambda: write_nnunet(root / "nnunet", case, volume, (3, *volume.shape[1:]))}
    for name, job in jobs.items():
        try:
            (root / name).mkdir(exist_ok=True)
            job()
            formats[name] = str(root / name)
        except PeerUnavailable:
            pass


def prepare_scale(root: Path, settings: ScaleSettings, *, key_file: Path, progress: bool = True):
    """The section's data under ``root`` (reused if a previous run with the same settings left it there):
    the medload store, .npy volumes, zarr arrays, HDF5 files, an nnU-Net dataset, and the sample list.
    Raises :class:`PeerUnavailable` when the disk lacks room."""
    from medload.bench.loading_data import Prepared, PreparedSeries, ingest_into
    from medload.config import affinity_cores
    from medload.progress import progress_bar
    from medload.storage.store import open_store

    root = Path(root)
    done = root / "prepared.json"
    shape = {"series": settings.series, "slices": settings.slices, "size": settings.size,
             "distinct": settings.distinct, "samples": settings.samples}
    if done.exists() and json.loads(done.read_text()).get("settings") == shape:
        return Prepared.load(root / "prepared-scale.json")
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < _disk_needed(settings):
        raise PeerUnavailable(f"the scale data need about {_disk_needed(settings) / 1e9:.0f} GB free under {root}, "
                              f"which has {free / 1e9:.0f} GB: free some, or run fewer series (--scale N)")
    for old in ("dicom", "store", "npy", "zarr", "hdf5", "nnunet"):
        shutil.rmtree(root / old, ignore_errors=True)
    _synthetic_archive(root / "dicom", settings)
    ingest_into([root / "dicom"], root / "store", key_file, workers=affinity_cores())
    shutil.rmtree(root / "dicom")
    store = open_store(root / "store", cache=0)
    records = [r for r in store.series() if r.shape[0] >= 3]
    formats: dict[str, str] = {}
    series: list[PreparedSeries] = []
    with progress_bar("scale data: peers' formats", len(records), enabled=progress) as advance:
        for i, rec in enumerate(records):
            volume = store.read(rec.key)
            npy = root / "npy" / f"{rec.key}.npy"
            npy.parent.mkdir(exist_ok=True)
            np.save(npy, volume)
            _write_peers(root, f"case_{i:04d}", rec.key, volume, formats)
            series.append(PreparedSeries(rec.key, None, str(npy), rec.shape[0]))
            advance(1)
    store.close()
    os.sync()  # written pages are clean, so that a cold pass can drop them
    rng = np.random.default_rng(0)
    index = rng.integers(len(series), size=settings.samples)
    z0 = np.array([rng.integers(series[s].depth - 2) for s in index], np.int64)
    prep = Prepared(str(root), str(root / "store"), None, records[0].shape[1], records[0].shape[2], tuple(series),
                    index, z0, 3, "2.5d", monai_note=None, note=None, formats=formats)
    prep.save(root / "prepared-scale.json")
    done.write_text(json.dumps({"settings": shape}))
    return prep


def _contender(name: str):
    from medload.bench.peers import medload_loader, npy_memmap
    from medload.bench.scale_peers import SCALE_PEERS

    return {"medload": medload_loader, "npy_memmap": npy_memmap, **SCALE_PEERS}[name]


def sample_bytes(prep) -> float:
    """Mean bytes of a sample's three slices as stored (compressed), found without reading them."""
    from medload.storage import shard as sh
    from medload.storage.manifest import shard_path
    from medload.storage.store import open_store
    from medload.storage.value_reads import locate, value_file

    store = open_store(prep.store, cache=0)
    shard = {r.key: r.shard for r in store.series()}
    total = 0
    for s, z in zip(prep.series_index.tolist(), prep.z0.tolist()):
        key = prep.series[s].key
        path = shard_path(store.path, shard[key])
        env = sh.reader_env(path)
        total += sum(v.length for v in locate(value_file(path, env).tree(env, sh.SLICES), bytes.fromhex(key), z, z + 3))
    store.close()
    return total / len(prep.z0)


# ---- one run, in its own process ------------------------------------------------------------------------
def run_continuous(name: str, prep, *, batch_size: int, num_workers: int, device: str, warmup: int, batches: int,
                   repeats: int, max_pass_s: float, cold: bool) -> dict:
    """Set up contender ``name``, then read one iterator through ``repeats`` passes (see the module
    docstring); per pass: seconds, samples, bytes read from disk; and medload's cache counters."""
    import torch

    from medload.bench.common import tree_read_bytes
    from medload.bench.loading import _check

    files = data_files([f for fmt in set(FORMAT_OF.values()) for f in _files_of(prep, fmt)]) if cold else []
    shape, dev = (batch_size, *prep.sample_shape), torch.device(device)
    t0 = time.perf_counter()
    loader = _contender(name)(prep, batch_size, num_workers, device)
    setup = time.perf_counter() - t0
    it = iter(loader)
    seconds, samples, disk = [], [], []
    for _ in range(repeats):
        if cold:
            evict_page_cache(files)
        for _ in range(warmup):
            _check(next(it), shape, torch.float32, dev)
        timed, t0, read0 = 0, time.perf_counter(), tree_read_bytes()
        while timed < batches and (timed == 0 or time.perf_counter() - t0 < max_pass_s):
            _check(next(it), shape, torch.float32, dev)
            timed += 1
        seconds.append(time.perf_counter() - t0)
        samples.append(timed * batch_size)
        disk.append(tree_read_bytes() - read0)
    stats = getattr(loader, "cache_stats", None)
    result = {"setup_s": setup, "seconds": seconds, "samples": samples, "disk_bytes": disk,
              "cache": stats() if stats else None}
    getattr(it, "close", lambda: None)()
    return result


def _child(spec_json: str) -> None:
    from medload.bench.loading_data import Prepared

    spec = json.loads(spec_json)
    out = Path(spec.pop("out"))
    try:
        result = run_continuous(spec.pop("name"), Prepared.load(Path(spec.pop("prep"))), **spec)
    except PeerUnavailable as exc:
        result = {"skipped": str(exc)}
    except Exception as exc:  # reported as a failed row, with its message
        result = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))


# ---- the section ----------------------------------------------------------------------------------------
def _files_of(prep, fmt: str) -> list[str]:
    if fmt == "store":
        return [prep.store]
    if fmt == "npy":
        return [s.npy for s in prep.series]
    return [prep.formats[fmt]] if fmt in prep.formats else []


def _run_one(prep, prep_path: Path, name: str, workers: int, mode: str, settings: ScaleSettings, device: str,
             log_dir: Path, servers) -> dict:
    out, log = log_dir / f"{name}-w{workers}-{mode}.json", log_dir / f"{name}-w{workers}-{mode}.log"
    spec = {"name": name, "prep": str(prep_path), "out": str(out), "batch_size": settings.batch_size,
            "num_workers": workers, "device": device, "warmup": settings.warmup, "batches": settings.batches,
            "repeats": settings.repeats, "max_pass_s": settings.max_pass_s, "cold": mode == "cold"}
    if mode == "warm":
        read_files(data_files(_files_of(prep, FORMAT_OF[name])))
    server = servers.get("base")
    with peak_pss(server.pid) as peak:
        code, timed_out = server.run("medload.bench.scale:_child", json.dumps(spec), log, settings.timeout)
    if out.exists():
        result = json.loads(out.read_text())
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        why = f"timed out after {settings.timeout:g} s" if timed_out else f"exit status {code}"
        result = {"error": f"{why}: {' | '.join(tail)}"}
    result["peak_pss_mb"] = peak.mb
    return result


def _row(name: str, workers: int, mode: str, res: dict) -> dict:
    row = loader_row(name, workers, mode, res, "samples", "mb_per_sample", cache=res.get("cache"))
    if row["status"] == "ok":
        row.update(seconds=res["seconds"], samples=res["samples"])
    return row


def _best_peers(rows: list[dict]) -> None:
    """Each medload row's ratio to the fastest other contender at the same mode and workers."""
    for r in rows:
        if r["contender"] != "medload" or r.get("samples_per_s") is None:
            continue
        peers = [p for p in rows if p["contender"] != "medload" and p.get("samples_per_s")
                 and (p["mode"], p["num_workers"]) == (r["mode"], r["num_workers"])]
        if peers:
            best = max(peers, key=lambda p: p["samples_per_s"])
            r["best_peer"], r["x_best_peer"] = best["contender"], r["samples_per_s"] / best["samples_per_s"]


def run_scale(root: Path, work: Path, settings: ScaleSettings = ScaleSettings(), *, key_file: Path,
              device: str = "cpu", progress: bool = True) -> dict:
    """The scale section: prepare the data under ``root`` (or reuse them), run every contender at every
    workers count and page cache mode, and return every figure, as a dict."""
    from medload.bench.loading import Servers
    from medload.config import parse_size
    from medload.progress import progress_bar

    prep = prepare_scale(root, settings, key_file=key_file, progress=progress)
    work = Path(work)
    log_dir = work / "logs-scale"
    log_dir.mkdir(parents=True, exist_ok=True)
    prep_path = work / "prepared-scale.json"
    prep.save(prep_path)
    plan = [(n, w, m) for m in settings.modes for w in settings.workers for n in settings.contenders]
    rows = []
    with Servers(_SERVERS) as servers, progress_bar("loading at scale", len(plan), enabled=progress) as advance:
        for name, w, mode in plan:
            rows.append(_row(name, w, mode, _run_one(prep, prep_path, name, w, mode, settings, device, log_dir,
                                                      servers)))
            advance(1)
    _best_peers(rows)
    store_bytes = tree_bytes(prep.store)
    return {"status": "ok", "series": len(prep.series), "slices": sum(s.depth for s in prep.series),
            "rows_px": prep.rows, "cols_px": prep.cols, "batch_size": settings.batch_size,
            "warmup": settings.warmup, "batches": settings.batches, "repeats": settings.repeats,
            "max_pass_s": settings.max_pass_s, "device": device, "l1": L1_BUDGET.replace("MB", " MB"),
            "store_gb": store_bytes / 1e9, "x_l1": store_bytes / parse_size(L1_BUDGET),
            "decoded_gb": sum(s.depth for s in prep.series) * prep.rows * prep.cols * 2 / 1e9,
            "sample_mb": sample_bytes(prep) / 1e6,
            "data_gb": {name: tree_bytes(path) / 1e9 for name, path in
                        [("store", prep.store), ("npy", Path(prep.root) / "npy"), *prep.formats.items()]},
            "rows": rows}

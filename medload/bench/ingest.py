"""Ingest throughput: medload at 1 and N workers against bare pydicom, dcm2niix and SimpleITK, on the
same files in the same run.

Contenders (each timed run is a fresh process, so none inherits another's imports or allocator state):

- ``pydicom read+decode``: ``dcmread`` + ``pixel_array`` + rescale to int16 per file, in 1 and N
  processes: the floor any Python ingester pays (no grouping, no geometry, no writing).
- ``dcm2niix .nii``: Chris Rorden's C converter writing uncompressed NIfTI (one thread), the reference
  for geometry; timed as a whole process.
- ``SimpleITK ImageSeriesReader``: per folder, ``GetGDCMSeriesIDs`` + ``GetGDCMSeriesFileNames`` +
  ``Execute`` for each series (GDCM decodes and rescales), one ITK thread: how ITK users load series.
- ``medload ingest``: everything ``medload ingest`` does -- header pass, grouping, geometry checks, HU,
  blosc2 encoding, checksums, digests, one LMDB transaction per series, shard publish -- at 1 and N
  workers; the child tunes its allocator as the ``medload`` command does. One worker is more than one
  core's work: its decoding process decodes while the ingest process writes (LMDB puts, commits, the
  kernel's copy of every byte into the page cache), so the row ``1 worker, pinned to 1 core`` runs the same
  ingest with its whole process tree on one CPU (``sched_setaffinity``): the baseline for how throughput
  grows with the cores. Every local medload row reports ``cores_busy``, the CPU seconds of its whole
  process tree (``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``, every child reaped by then) per second of the ingest.
- ``... files not in the page cache``: medload at N workers and pydicom in N processes with the source
  files' pages dropped before each timed run (``posix_fadvise``; their folders and inodes stay cached):
  what an archive larger than the machine's memory costs to read.
- ``medload writer capacity``: the writing side alone (puts into a task shard, one transaction and a synced
  commit per series), fed slices decoded, windowed and encoded beforehand (untimed): the files/s one
  writing process absorbs, so a small machine shows how many decode workers one writer could serve.
  Local and Dask tasks write the same task shards.
- ``medload ingest process capacity``: for every medload ingest row, the files per CPU-second (user + system,
  ``getrusage(RUSAGE_SELF)``) of the ingest process alone during the timed ingest: the serial part
  (discovery, headers, grouping, planning, publishing), so a small machine shows whether 16-64 decode
  workers could be absorbed. Its CPU time is less sensitive to other load than wall time.
- ``medload ingest on Dask``: the same on a Dask LocalCluster of 1 and N workers (each task decoding in a
  process of its own and writing its own shard, published by the timed process). As imports are for
  the other Python contenders, starting the cluster (about 1 s here) is not timed: it is reported
  apart (``cluster_start_s``), since a cluster serves many ingests.

Python contenders time their work after their imports (medload's codec included: an ingest imports it
before forking its workers, as pydicom's pool inherits pydicom). One untimed warm-up run per contender fills
the page cache. Figures: files/s and MB/s from the median of the repeats (min-max kept), per core, and
per-core ratios against pydicom (1 process), dcm2niix and SimpleITK measured in this run; plus the size
of the medload store and of dcm2niix's NIfTI against the DICOM.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np

from medload.bench.common import data_files, evict_page_cache, spread, tree_bytes, tree_read_bytes
from medload.bench.ingest_data import make_data, replicate
from medload.bench.ingest_scaling import PINNED, medload_row, pydicom_row, scaling_curve, worker_counts
from medload.config import affinity_cores

__all__ = ["COLD", "INGEST_PROCESS", "WRITER", "IngestContender", "contenders", "run_ingest", "make_data", "replicate", "main"]

CODEC = "blosc2-lz4"
PEERS = {"pydicom": "pydicom read+decode (1 proc)", "dcm2niix": "dcm2niix .nii (1 thread)",
         "simpleitk": "SimpleITK ImageSeriesReader (1 thread)"}
"""The peers every row is compared with (per core), by short name -> contender name."""
WRITER = "medload writer capacity (1 process)"
"""The writing side alone, fed slices decoded and encoded beforehand (into a task shard, as local and Dask
tasks write): what one task's writer absorbs."""
COLD = "files not in the page cache"
"""Rows whose source files' pages are dropped before each timed run: read from the disk, as an archive
larger than the machine's memory is (the folders' entries and the files' inodes stay cached)."""
INGEST_PROCESS = "medload ingest process capacity"
"""The serial part of a medload ingest row: files per CPU-second of the timed (ingest) process alone --
discovery, headers received, grouping, planning, publishing -- the files/s it could absorb were it the
only limit. Reported for every medload ingest row as ``ingest_process_files_per_cpu_s``."""


# ---- contenders, each run in its own process -----------------------------------------------------
def _pydicom_one(path: str) -> int:
    """HU int16 of one file; 0 for a file that is not a DICOM image (user data may hold such files)."""
    import pydicom

    try:
        ds = pydicom.dcmread(path)
        pixels = ds.pixel_array
    except (pydicom.errors.InvalidDicomError, AttributeError, ValueError, TypeError, NotImplementedError):
        return 0
    slope, intercept = float(ds.get("RescaleSlope", 1)), float(ds.get("RescaleIntercept", 0))
    if slope == int(slope) and intercept == int(intercept):
        hu = (pixels.astype(np.int32) * int(slope) + int(intercept)).astype(np.int16)
    else:
        hu = (pixels * slope + intercept).astype(np.float32)
    return 1 if hu.size else 0


def _files(src: Path) -> list[str]:
    return sorted(str(p) for p in src.rglob("*") if p.is_file())


def _run_pydicom(src: Path, procs: int) -> dict:
    files = _files(src)
    if procs == 1:
        decoded = sum(_pydicom_one(f) for f in files)
    else:
        with Pool(procs) as pool:
            decoded = sum(pool.map(_pydicom_one, files, chunksize=16))
    return {"decoded": decoded}


def _run_simpleitk(src: Path) -> dict:
    import SimpleITK as sitk

    sitk.ProcessObject.SetGlobalDefaultNumberOfThreads(1)
    folders = sorted({p.parent for p in src.rglob("*") if p.is_file()})
    read = series = 0
    errors: list[str] = []
    for folder in folders:
        for uid in sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder)):
            names = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), uid)
            reader = sitk.ImageSeriesReader()
            reader.SetFileNames(names)
            try:
                image = reader.Execute()
            except RuntimeError as exc:
                errors.append(f"{folder.name}: {str(exc).strip().splitlines()[-1][:100]}")
                continue
            read += len(names)
            series += 1
            del image
    if series == 0:
        raise RuntimeError(f"SimpleITK read no series ({'; '.join(errors[:3]) or 'no DICOM series found'})")
    return {"decoded": read, "series": series, "series_failed": len(errors), "errors": errors[:5]}


def _run_medload(src: Path, store: Path, workers: int, codec: str, scheduler: str | None) -> dict:
    from medload.config import IngestConfig
    from medload.ingest import ingest

    shutil.rmtree(store, ignore_errors=True)
    own, tree, t0 = _cpu_seconds("self"), _cpu_seconds("children"), time.perf_counter()
    report = ingest(src, store, config=IngestConfig(workers=workers, codec=codec), scheduler=scheduler)
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds("self") - own
    if report.count("ingested") == 0:
        raise RuntimeError(f"medload ingested nothing: {report.counts}")
    out = {"counts": dict(report.counts), "ingest_process_cpu_s": cpu}
    if scheduler is None:  # a Dask cluster's processes are not this process's children
        out["cores_busy"] = (cpu + _cpu_seconds("children") - tree) / seconds
    return out


def _cpu_seconds(who: str) -> float:
    """User + system CPU seconds of this process alone (``self``: its children, the task and decoding
    processes, are not counted; on Dask the in-process scheduler is), or of its children that have ended
    and been waited for, theirs included (``children``)."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF if who == "self" else resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _run_writer(src: Path, store: Path, codec: str) -> dict:
    """The writing side alone: each series' slices decoded, windowed and encoded beforehand (untimed, the
    decoders' work), then timed: its puts into a task shard in one transaction, and the synced commit --
    what one writing process absorbs, in files/s."""
    import pydicom

    from medload import windows as win
    from medload.config import IngestConfig
    from medload.storage.codec import encode_value, get_codec
    from medload.storage.task_shard import TaskShardWriter

    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    windows, enc = [win.get(w) for w in IngestConfig().windows], get_codec(codec)
    series: dict[str, list[np.ndarray]] = {}
    for path in _files(src):
        try:
            ds = pydicom.dcmread(path)
            series.setdefault(str(ds.SeriesInstanceUID), []).append(ds.pixel_array.astype(np.int16))
        except (pydicom.errors.InvalidDicomError, AttributeError, ValueError, TypeError, NotImplementedError):
            continue
    writer, seconds, files = TaskShardWriter(store / "task.lmdb", tuple(w.name for w in windows)), 0.0, 0
    for n, slices in enumerate(series.values()):
        values: list[tuple[bytes, dict[str, bytes | memoryview]]] = [
            (encode_value(v, enc), {w.name: encode_value(win.to_uint8(v, w), enc) for w in windows}) for v in slices]
        t0 = time.perf_counter()
        txn = writer.begin_series(n.to_bytes(16, "big"), sum(len(v) + sum(map(len, p.values())) for v, p in values))
        for z, (value, planes) in enumerate(values):
            txn.put_slice(z, value, planes)
        txn.commit()
        seconds += time.perf_counter() - t0
        files += len(values)
    writer.close()
    return {"decoded": files, "timed_seconds": seconds}


def _child(spec: dict) -> dict:
    """One contender's work in this (fresh) process; the seconds exclude the imports (and starting a
    Dask cluster, reported apart as ``cluster_start_s``)."""
    kind, src = spec["kind"], Path(spec["src"])
    if spec.get("cold"):  # untimed: the files' pages written out, then dropped (their folders stay cached)
        os.sync()
        evict_page_cache(data_files([src]))
    with ExitStack() as stack:
        scheduler, started = None, None
        if kind == "medload":
            from medload.allocator import keep_large_buffers_in_heap

            keep_large_buffers_in_heap()  # as the `medload` command does for its own process
            import medload.ingest  # noqa: F401 - imports are not timed, the codec's included (as pydicom's)
            from medload.storage.codec import get_codec

            get_codec(spec["codec"]).load()
            if spec.get("pin"):  # this process and every process it starts on one CPU
                os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            if spec.get("dask_workers"):
                t0 = time.perf_counter()
                scheduler = _started_cluster(stack, spec["dask_workers"])
                started = time.perf_counter() - t0
        elif kind == "simpleitk":
            import SimpleITK  # noqa: F401
        elif kind == "writer":
            import medload.storage.task_shard  # noqa: F401
        else:
            import pydicom  # noqa: F401
        read0, t0 = tree_read_bytes(), time.perf_counter()
        if kind == "pydicom":
            out = _run_pydicom(src, spec["procs"])
        elif kind == "writer":
            out = _run_writer(src, Path(spec["store"]), spec["codec"])
        elif kind == "simpleitk":
            out = _run_simpleitk(src)
        else:
            out = _run_medload(src, Path(spec["store"]), spec["workers"], spec["codec"], scheduler)
        out["seconds"] = out.pop("timed_seconds", time.perf_counter() - t0)
        out["read_mb"] = (tree_read_bytes() - read0) / 1e6
    if started is not None:
        out["cluster_start_s"] = started
    return out


def _started_cluster(stack: ExitStack, workers: int) -> str:
    """The address of a LocalCluster of ``workers`` whose workers have imported medload's ingest."""
    from distributed import Client

    from medload.ingest.cluster import local_cluster

    cluster = stack.enter_context(local_cluster(workers))
    client = stack.enter_context(Client(cluster))
    client.run(importlib.import_module, "medload.ingest.dask_engine")
    return cluster.scheduler_address


def _run_child(spec: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "medload.bench.ingest", "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(tail[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_dcm2niix(src: Path, out: Path, timeout: float) -> dict:
    """dcm2niix writing .nii, one thread; the whole process is timed (it is one C program)."""
    exe = shutil.which("dcm2niix")
    if exe is None:
        raise FileNotFoundError("dcm2niix is not on PATH (Debian/Ubuntu: apt install dcm2niix)")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    proc = subprocess.run([exe, "-z", "n", "-b", "n", "-o", str(out), "-f", "%s_%j", str(src)], capture_output=True,
                          text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"dcm2niix exit status {proc.returncode}: {proc.stderr.strip()[-200:]}")
    return {"seconds": seconds, "nii_files": len(list(out.glob("*.nii")))}


@dataclass(frozen=True)
class IngestContender:
    """A named contender: ``run()`` does one timed run and returns at least ``{"seconds": s}``."""

    name: str
    cores: int
    run: Callable[[], dict]


def contenders(src: Path, work: Path, *, cores: int, codecs: Sequence[str] = (CODEC,),
               timeout: float = 1800) -> list[IngestContender]:
    """The contenders on ``src``, writing under ``work`` (medload stores, NIfTI)."""
    def child(**spec) -> Callable[[], dict]:
        return lambda: _run_child({"src": str(src), **spec}, timeout)

    counts = worker_counts(cores)[1:]  # the scaling curve: 2, 4, ... up to every core (none on one core)
    out = [IngestContender(PEERS["pydicom"], 1, child(kind="pydicom", procs=1))]
    out += [IngestContender(pydicom_row(n), n, child(kind="pydicom", procs=n)) for n in counts]
    if cores > 1:
        out.append(IngestContender(f"pydicom read+decode ({cores} procs, {COLD})", cores,
                                   child(kind="pydicom", procs=cores, cold=True)))
    out.append(IngestContender(PEERS["dcm2niix"], 1, lambda: _run_dcm2niix(src, work / "nii", timeout)))
    out.append(IngestContender(PEERS["simpleitk"], 1, child(kind="simpleitk")))
    for codec in codecs:
        flag = "" if codec == CODEC else f" --codec {codec}"
        tag = "" if codec == CODEC else f"-{codec}"
        out.append(IngestContender(f"medload ingest{flag} (1 worker)", 1,
                                   child(kind="medload", store=str(work / f"store1{tag}"), workers=1, codec=codec)))
        if cores > 1 and codec == CODEC:
            out.append(IngestContender(PINNED, 1, child(kind="medload", store=str(work / "store1-pinned"), workers=1,
                                                        codec=codec, pin=True)))
            out += [IngestContender(medload_row(n), n, child(kind="medload", store=str(work / f"store{n}"), workers=n,
                                                             codec=codec)) for n in counts]
            out.append(IngestContender(f"medload ingest ({cores} workers, {COLD})", cores,
                                       child(kind="medload", store=str(work / "storeN-cold"), workers=cores,
                                             codec=codec, cold=True)))
    for n in sorted({1, cores}):
        out.append(IngestContender(f"medload ingest on Dask, {n} worker{'s' if n > 1 else ''}", n,
                                   child(kind="medload", store=str(work / f"store-dask{n}"), workers=n, codec=CODEC,
                                         dask_workers=n)))
    out.append(IngestContender(WRITER, 1, child(kind="writer", store=str(work / "store-writer"), codec=CODEC)))
    return out


def run_ingest(src: Path, work: Path, *, repeats: int, warmup: int = 1, codecs: Sequence[str] = (CODEC,),
               timeout: float = 1800, progress: bool = True, source: str | None = None, only: str | None = None) -> dict:
    """Time every contender on the files under ``src`` (scratch space under ``work``); every figure.
    ``only``: a regular expression; just the contenders whose names it finds (e.g. the scaling curve's rows).

    A contender that fails is kept, with ``status="failed"`` and its ``error``; the others run on.
    """
    from medload.progress import progress_bar

    src, work = Path(src), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    ncores = affinity_cores()
    files = [p for p in src.rglob("*") if p.is_file()]
    dicom_bytes = sum(p.stat().st_size for p in files)
    mb = dicom_bytes / 1e6
    plan = [c for c in contenders(src, work, cores=ncores, codecs=codecs, timeout=timeout)
            if only is None or re.search(only, c.name)]
    rows: list[dict[str, Any]] = []
    with progress_bar("ingest runs", len(plan) * (warmup + repeats), enabled=progress) as advance:
        for c in plan:
            row: dict[str, Any] = {"contender": c.name, "cores": c.cores, "status": "ok", "error": None}
            try:
                results = []
                for n in range(warmup + repeats):
                    res = c.run()
                    advance(1)
                    if n >= warmup:
                        results.append(res)
            except Exception as exc:  # reported as a failed row, with its message
                row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
                rows.append(row)
                continue
            seconds = [r["seconds"] for r in results]
            s = spread(seconds)
            row.update(seconds=seconds, seconds_median=s["median"], seconds_min=s["min"], seconds_max=s["max"],
                       files_per_s=len(files) / s["median"], mb_per_s=mb / s["median"],
                       files_per_s_per_core=len(files) / s["median"] / c.cores)
            cpu = [r["ingest_process_cpu_s"] for r in results if "ingest_process_cpu_s" in r]
            if cpu:
                cpu_median = spread(cpu)["median"]
                row.update(ingest_process_cpu_s=cpu_median, ingest_process_files_per_cpu_s=len(files) / cpu_median)
            busy = [r["cores_busy"] for r in results if "cores_busy" in r]
            if busy:
                row["cores_busy"] = spread(busy)["median"]
            read = [r["read_mb"] for r in results if "read_mb" in r]
            if read:  # MB its process tree had read from storage (not the page cache) in the timed run
                row["read_mb"] = spread(read)["median"]
            detail = {k: v for k, v in results[-1].items()
                      if k not in ("seconds", "ingest_process_cpu_s", "cores_busy", "read_mb")}
            if detail:
                row["detail"] = detail
            rows.append(row)
    by_name = {r["contender"]: r for r in rows}
    for r in rows:
        r["ratios"] = {}
        for short, name in PEERS.items():
            peer = by_name.get(name, {}).get("files_per_s_per_core")
            own = r.get("files_per_s_per_core")
            r["ratios"][short] = own / peer if own and peer else None
    store = work / "store1"
    nii = work / "nii"
    sizes: dict[str, Any] = {"dicom_mb": mb, "store_codec": CODEC,
             "store_mb": tree_bytes(store) / 1e6 if store.exists() else None,
             "nii_mb": tree_bytes(nii) / 1e6 if nii.exists() and any(nii.iterdir()) else None}
    sizes["store_x_dicom"] = sizes["store_mb"] / mb if sizes["store_mb"] and mb else None
    sizes["nii_x_dicom"] = sizes["nii_mb"] / mb if sizes["nii_mb"] and mb else None
    from medload.bench.targets import ingest_targets

    return {"status": "ok", "source": source or str(src), "files": len(files), "megabytes": mb, "cores": ncores,
            "repeats": repeats, "warmup": warmup, "rows": rows, "sizes": sizes,
            "scaling": scaling_curve(rows, worker_counts(ncores)),
            "targets": ingest_targets(rows, ncores, WRITER, INGEST_PROCESS, PINNED)}


# ---- the command-line script (benchmarks/ingest.py) ----------------------------------------------
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(_child(json.loads(argv[1]))))
        return
    ap = argparse.ArgumentParser(prog="benchmarks/ingest.py", description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="folder of DICOM files (default: generate synthetic CT)")
    ap.add_argument("--replicate", type=int, default=0, help="copies of --data with new UIDs")
    ap.add_argument("--series", type=int, default=8)
    ap.add_argument("--slices", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", metavar="REGEX", help="time only the contenders whose names this finds, e.g. "
                    "'medload ingest \\(\\d+ workers?\\)$|pydicom read\\+decode \\(\\d+ procs?\\)$' for the scaling curve")
    ap.add_argument("--plot", type=Path, help="PNG of files/s against workers (the scaling curve, 2 cores or more)")
    ap.add_argument("--codec", action="append", default=None,
                    help=f"medload codecs to time at 1 worker (repeatable; default {CODEC} and raw)")
    args = ap.parse_args(argv)

    from medload.bench.report import print_tables, section_tables
    from medload.deid import create_key

    codecs = tuple(dict.fromkeys([CODEC, *(args.codec or ["raw"])]))
    with tempfile.TemporaryDirectory(prefix="medload-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if not os.environ.get("MEDLOAD_KEY_FILE"):
            os.environ["MEDLOAD_KEY_FILE"] = str(create_key(tmp / "bench.key"))
        src = args.data or make_data(tmp, args.series, args.slices)
        if args.replicate:
            src = replicate(src, tmp, args.replicate)
        label = ("synthetic CT" if args.data is None else str(args.data)) + (
            f" x{args.replicate} (new UIDs)" if args.replicate else "")
        result = run_ingest(src, tmp / "work", repeats=args.repeats, codecs=codecs, source=label, only=args.only)
    print_tables(section_tables({"ingest": result}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        from medload.bench.report import plot

        plot({"ingest": result, "config": {"command": "benchmarks/ingest.py", "machine": {"cores": result["cores"]}}},
             args.plot)


if __name__ == "__main__":
    main()

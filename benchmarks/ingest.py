"""Ingest throughput: medload at 1 and N workers against bare pydicom read+decode and dcm2niix,
on the same files, in the same run.

Usage: python benchmarks/ingest.py [--data DIR [--replicate N]] [--series 4] [--slices 64] [--repeats 5]
                                   [--json OUT] [--dcm2niix-gz]

Without --data, generates synthetic 512x512 CT series (realistic HU statistics) in a temporary folder.
``--replicate N`` copies the DICOM files of --data N times with new UIDs (pydicom rewrite, every other
tag kept), to time a larger archive with real scanner headers.

Every timed run is a fresh process (so no contender inherits another's imports or allocator state);
Python contenders time their work after their imports, dcm2niix is timed as a whole process. One
untimed warm-up run per contender fills the page cache. Figures: files/s and MB/s from the median of
the repeats (min-max shown), per core, and ratios against pydicom and dcm2niix measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import pydicom

HERE = Path(__file__).resolve()


# ---- contenders, each run in its own process -----------------------------------------------------
def _pydicom_one(path: str) -> int:
    ds = pydicom.dcmread(path)
    hu = ds.pixel_array.astype(np.int32) * int(ds.RescaleSlope) + int(ds.RescaleIntercept)
    return int(hu.astype(np.int16)[0, 0])


def run_pydicom(src: Path, procs: int) -> None:
    """Bare pydicom: read every file, decode pixels, apply the rescale (HU int16)."""
    files = sorted(str(p) for p in src.rglob("*") if p.is_file())
    if procs == 1:
        for f in files:
            _pydicom_one(f)
    else:
        with Pool(procs) as pool:
            pool.map(_pydicom_one, files, chunksize=16)


def run_medload(src: Path, store: Path, workers: int, codec: str) -> None:
    """What ``medload ingest`` does, allocator tuning of its own process included."""
    from medload.allocator import keep_large_buffers_in_heap
    from medload.config import IngestConfig
    from medload.ingest import ingest

    keep_large_buffers_in_heap()
    shutil.rmtree(store, ignore_errors=True)
    report = ingest(src, store, config=IngestConfig(workers=workers, codec=codec))
    if report.count("ingested") == 0:
        raise RuntimeError("medload ingested nothing")


def child(args: list[str]) -> None:
    """``--child KIND ...``: do one contender's work and print the seconds it took (after imports)."""
    kind, src = args[0], Path(args[1])
    t0 = time.perf_counter()
    if kind == "pydicom":
        run_pydicom(src, int(args[2]))
    else:
        run_medload(src, Path(args[2]), int(args[3]), args[4])
    print(time.perf_counter() - t0)


def run_child(*args: str) -> float:
    out = subprocess.run([sys.executable, str(HERE), "--child", *args], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_dcm2niix(src: Path, out: Path, compress: str) -> float:
    """dcm2niix writing .nii (``compress="n"``) or .nii.gz with its internal gzip (``"i"``); whole process."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    t0 = time.perf_counter()
    subprocess.run(["dcm2niix", "-z", compress, "-b", "n", "-o", str(out), "-f", "%s_%j", str(src)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


# ---- data ----------------------------------------------------------------------------------------
def make_data(root: Path, series: int, slices: int) -> Path:
    from medload.synthetic import SeriesSpec, make_series

    src = root / "dicom"
    for i in range(series):
        spec = SeriesSpec(n_slices=slices, rows=512, cols=512, pixel_spacing=(0.7, 0.7), slice_spacing=1.0,
                          orientation="axial" if i % 2 == 0 else "oblique", signed=bool(i % 2),
                          bits_stored=16 if i % 2 else 12)
        make_series(src, spec, seed=100 + i, series_number=i + 1)
    return src


def replicate(src: Path, root: Path, copies: int) -> Path:
    """N copies of every DICOM file under ``src``, each copy with new Study/Series/SOP Instance UIDs."""
    out = root / "replicated"
    files = sorted(p for p in src.rglob("*") if p.is_file())
    for n in range(copies):
        target = out / f"copy{n:03d}"
        target.mkdir(parents=True)
        uids: dict[str, str] = {}
        for i, path in enumerate(files):
            try:
                ds = pydicom.dcmread(path)
            except pydicom.errors.InvalidDicomError:
                continue
            for kw in ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID"):
                if kw in ds:
                    setattr(ds, kw, uids.setdefault(str(getattr(ds, kw)), pydicom.uid.generate_uid()))
            if "SOPInstanceUID" in ds:
                ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
            ds.save_as(target / f"{i:05d}.dcm")
    return out


# ---- the run -------------------------------------------------------------------------------------
def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="folder of DICOM files (default: generate synthetic CT)")
    ap.add_argument("--replicate", type=int, default=0, help="copies of --data with new UIDs")
    ap.add_argument("--series", type=int, default=4)
    ap.add_argument("--slices", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dcm2niix-gz", action="store_true", help="also time dcm2niix writing .nii.gz (slow)")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from medload.progress import progress_bar

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("MEDLOAD_KEY_FILE", str(tmp / "bench.key"))
        src = args.data or make_data(tmp, args.series, args.slices)
        if args.replicate:
            src = replicate(src, tmp, args.replicate)
        files = [p for p in src.rglob("*") if p.is_file()]
        mb = sum(p.stat().st_size for p in files) / 1e6
        contenders = {
            "pydicom read+decode (1 proc)": (1, lambda: run_child("pydicom", str(src), "1")),
            f"pydicom read+decode ({cores} procs)": (cores, lambda: run_child("pydicom", str(src), str(cores))),
            "dcm2niix .nii (1 thread)": (1, lambda: run_dcm2niix(src, tmp / "nii", "n")),
            "medload ingest (1 worker)": (1, lambda: run_child("medload", str(src), str(tmp / "s1"), "1", "blosc2-lz4")),
            f"medload ingest ({cores} workers)": (cores, lambda: run_child("medload", str(src), str(tmp / "sN"), str(cores), "blosc2-lz4")),
            "medload ingest --codec raw (1 worker)": (1, lambda: run_child("medload", str(src), str(tmp / "sR"), "1", "raw")),
        }
        if args.dcm2niix_gz:
            contenders["dcm2niix .nii.gz (1 thread)"] = (1, lambda: run_dcm2niix(src, tmp / "niigz", "i"))
        rows = []
        with progress_bar("benchmark runs", len(contenders) * (args.repeats + 1), enabled=True) as advance:
            for name, (ncores, fn) in contenders.items():
                fn()  # warm-up: page cache
                advance(1)
                times = []
                for _ in range(args.repeats):
                    times.append(fn())
                    advance(1)
                med = statistics.median(times)
                rows.append({"contender": name, "cores": ncores, "seconds_median": med, "seconds_min": min(times),
                             "seconds_max": max(times), "files_per_s": len(files) / med, "mb_per_s": mb / med,
                             "files_per_s_per_core": len(files) / med / ncores})
    by = {r["contender"]: r for r in rows}
    base_py = by["pydicom read+decode (1 proc)"]["files_per_s_per_core"]
    base_dx = by["dcm2niix .nii (1 thread)"]["files_per_s_per_core"]
    for r in rows:
        r["per_core_vs_pydicom"] = r["files_per_s_per_core"] / base_py
        r["per_core_vs_dcm2niix"] = r["files_per_s_per_core"] / base_dx
    title = (f"ingest: {len(files)} files, {mb:.0f} MB, {cores} cores, "
             f"{'synthetic' if args.data is None else args.data}, median of {args.repeats} (min-max s)")
    table = Table(title=title)
    for col in ("contender", "s", "files/s", "MB/s", "files/s/core", "x pydicom/core", "x dcm2niix .nii/core"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["contender"], f"{r['seconds_median']:.2f} ({r['seconds_min']:.2f}-{r['seconds_max']:.2f})",
                      f"{r['files_per_s']:.0f}", f"{r['mb_per_s']:.0f}", f"{r['files_per_s_per_core']:.0f}",
                      f"{r['per_core_vs_pydicom']:.2f}", f"{r['per_core_vs_dcm2niix']:.2f}")
    Console(width=160).print(table)
    if args.json:
        args.json.write_text(json.dumps({"files": len(files), "megabytes": mb, "cores": cores, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

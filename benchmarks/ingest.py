"""Ingest throughput: medload at 1 and N workers against bare pydicom read+decode and dcm2niix,
on the same files, in the same run (page cache warm for everyone: one untimed warm-up each).

Usage: python benchmarks/ingest.py [--data DIR] [--series 4] [--slices 64] [--repeats 3] [--json OUT]

Without --data, generates synthetic 512x512 CT series (realistic HU statistics) in a temporary folder.
Figures: files/s and MB/s (median of the repeats, min-max shown), per core, and ratios measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import pydicom
from rich.console import Console
from rich.table import Table

from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.synthetic import SeriesSpec, make_series


def make_data(root: Path, series: int, slices: int) -> Path:
    src = root / "dicom"
    for i in range(series):
        spec = SeriesSpec(n_slices=slices, rows=512, cols=512, pixel_spacing=(0.7, 0.7), slice_spacing=1.0,
                          orientation="axial" if i % 2 == 0 else "oblique", signed=bool(i % 2), bits_stored=16 if i % 2 else 12)
        make_series(src, spec, seed=100 + i, series_number=i + 1)
    return src


def _pydicom_one(path: str) -> int:
    ds = pydicom.dcmread(path)
    hu = ds.pixel_array.astype(np.int32) * int(ds.RescaleSlope) + int(ds.RescaleIntercept)
    return int(hu.astype(np.int16)[0, 0])


def pydicom_decode(files: list[str], procs: int) -> None:
    if procs == 1:
        for f in files:
            _pydicom_one(f)
    else:
        with Pool(procs) as pool:
            pool.map(_pydicom_one, files, chunksize=16)


def dcm2niix(src: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    subprocess.run(["dcm2niix", "-z", "n", "-b", "n", "-o", str(out), "-f", "%s_%j", str(src)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def medload_ingest(src: Path, store: Path, workers: int) -> None:
    shutil.rmtree(store, ignore_errors=True)
    report = ingest(src, store, config=IngestConfig(workers=workers))
    if report.count("ingested") == 0:
        raise RuntimeError("medload ingested nothing")


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: page cache, imports, pools
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="folder of DICOM files (default: generate synthetic CT)")
    ap.add_argument("--series", type=int, default=4)
    ap.add_argument("--slices", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ.setdefault("MEDLOAD_KEY_FILE", str(tmp / "bench.key"))
        src = args.data or make_data(tmp, args.series, args.slices)
        files = sorted(str(p) for p in src.rglob("*") if p.is_file())
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        contenders = {
            "pydicom read+decode (1 proc)": (1, lambda: pydicom_decode(files, 1)),
            f"pydicom read+decode ({cores} procs)": (cores, lambda: pydicom_decode(files, cores)),
            "dcm2niix (1 thread)": (1, lambda: dcm2niix(src, tmp / "nii")),
            "medload ingest (1 worker)": (1, lambda: medload_ingest(src, tmp / "store1", 1)),
            f"medload ingest ({cores} workers)": (cores, lambda: medload_ingest(src, tmp / "storeN", cores)),
        }
        rows = []
        for name, (ncores, fn) in contenders.items():
            times = timed(fn, args.repeats)
            med = statistics.median(times)
            rows.append({"contender": name, "cores": ncores, "seconds_median": med, "seconds_min": min(times),
                         "seconds_max": max(times), "files_per_s": len(files) / med, "mb_per_s": mb / med,
                         "files_per_s_per_core": len(files) / med / ncores})
    by = {r["contender"]: r for r in rows}
    base_py = by["pydicom read+decode (1 proc)"]["files_per_s_per_core"]
    base_dx = by["dcm2niix (1 thread)"]["files_per_s_per_core"]
    for r in rows:
        r["per_core_vs_pydicom"] = r["files_per_s_per_core"] / base_py
        r["per_core_vs_dcm2niix"] = r["files_per_s_per_core"] / base_dx
    table = Table(title=f"ingest: {len(files)} files, {mb:.0f} MB, {cores} cores, median of {args.repeats} (min-max s)")
    for col in ("contender", "s", "files/s", "MB/s", "files/s/core", "x pydicom/core", "x dcm2niix/core"):
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

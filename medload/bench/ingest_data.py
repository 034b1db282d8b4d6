"""The ingest section's data: synthetic CT series written in parallel, or copies of real files with new UIDs."""

from __future__ import annotations

from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from medload.config import affinity_cores

if TYPE_CHECKING:
    from medload.synthetic import SeriesSpec

__all__ = ["SeriesJob", "write_series", "make_data", "replicate"]


class SeriesJob(NamedTuple):
    """One synthetic series to write: :func:`medload.synthetic.make_series`'s arguments."""

    out: Path
    spec: SeriesSpec
    seed: int
    series_number: int
    shuffle: bool = True


def _write(job: SeriesJob) -> None:
    from medload.synthetic import make_series

    make_series(job.out, job.spec, seed=job.seed, series_number=job.series_number, shuffle=job.shuffle)


def write_series(jobs: list[SeriesJob]) -> None:
    """Write these series, one process per core: the same bytes as one by one (each series from its own
    seed), in a fraction of the time (2,048 files of 512 x 512: 82 s in one process of the 2-core VM, 42 s in two,
    most of a many-core machine's set-up for the ingest rows)."""
    procs = min(len(jobs), affinity_cores())
    if procs <= 1:
        for job in jobs:
            _write(job)
        return
    with get_context("fork").Pool(procs) as pool:
        pool.map(_write, jobs, chunksize=1)


def make_data(root: Path, series: int, slices: int) -> Path:
    """``series`` synthetic 512x512 CT series (axial and oblique, signed and unsigned) under ``root/dicom``."""
    from medload.synthetic import SeriesSpec

    src = root / "dicom"
    write_series([SeriesJob(src, SeriesSpec(n_slices=slices, rows=512, cols=512, pixel_spacing=(0.7, 0.7),
                                            slice_spacing=1.0, orientation="axial" if i % 2 == 0 else "oblique",
                                            signed=bool(i % 2), bits_stored=16 if i % 2 else 12), 100 + i, i + 1)
                  for i in range(series)])
    return src


def replicate(src: Path, root: Path, copies: int) -> Path:
    """N copies of every DICOM file under ``src``, each copy with new Study/Series/SOP Instance UIDs."""
    import pydicom

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

"""The ingest section's data: synthetic CT series written in parallel, or copies of real files with new UIDs."""

from __future__ import annotations

from multiprocessing import get_context
from pathlib import Path

from medload.config import affinity_cores

__all__ = ["make_data", "replicate"]


def _one_series(args: tuple[Path, int, int]) -> None:
    from medload.synthetic import SeriesSpec, make_series

    src, i, slices = args
    spec = SeriesSpec(n_slices=slices, rows=512, cols=512, pixel_spacing=(0.7, 0.7), slice_spacing=1.0,
                      orientation="axial" if i % 2 == 0 else "oblique", signed=bool(i % 2),
                      bits_stored=16 if i % 2 else 12)
    make_series(src, spec, seed=100 + i, series_number=i + 1)


def make_data(root: Path, series: int, slices: int) -> Path:
    """``series`` synthetic 512x512 CT series (axial and oblique, signed and unsigned) under ``root/dicom``,
    written by one process per core (the 2,048 files of 1 GB took 90 s in one process of the 2-core VM): the
    same files whatever the number of processes, each series from its own seed."""
    src = root / "dicom"
    jobs = [(src, i, slices) for i in range(series)]
    procs = min(series, affinity_cores())
    if procs <= 1:
        for job in jobs:
            _one_series(job)
    else:
        with get_context("fork").Pool(procs) as pool:
            pool.map(_one_series, jobs, chunksize=1)
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

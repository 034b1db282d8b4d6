"""The data of the loading benchmark: synthetic CT (or your DICOM) in every form the contenders read --
a medload store (HU, and one with stored uint8 soft-tissue planes), DICOM folders one series each for
MONAI's readers, ``.npy`` volumes -- and the random sample list every contender reads in the same order
(:class:`Prepared`). :mod:`medload.bench.loading` times the contenders on it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from medload.bench.peers import PeerUnavailable

if TYPE_CHECKING:
    from medload.synthetic import SeriesSpec

__all__ = ["PreparedSeries", "Prepared", "make_synthetic", "write_synthetic", "prepare", "prepare_from", "series_folders",
           "choose_series", "ingest_into", "warm_page_cache", "KINDS"]

KINDS = {"2.5d": 3, "3d": 32}
"""Sample kinds and their depth: 2.5D stacks of 3 slices as channels, 3D slabs of 32 slices."""


@dataclass(frozen=True)
class PreparedSeries:
    """One series in every form the contenders read: its store key, a DICOM folder holding only it
    (None where MONAI cannot read it), its .npy volume (None if not prepared), its number of slices."""

    key: str
    dicom_dir: str | None
    npy: str | None
    depth: int


@dataclass
class Prepared:
    """The data of one loading benchmark, and the sample list: sample ``i`` is slices
    ``z0[i] .. z0[i] + depth - 1`` of ``series[series_index[i]]``, laid out as channels (``kind="2.5d"``)
    or as a ``(1, depth, rows, columns)`` slab (``"3d"``). ``monai_note`` says why MONAI's readers
    cannot apply, if they cannot; ``note`` which series were used, if not all. ``truth`` (ground-truth HU by series position) is not saved."""

    root: str
    store: str
    store_u8: str | None
    rows: int
    cols: int
    series: tuple[PreparedSeries, ...]
    series_index: np.ndarray
    z0: np.ndarray
    depth: int = 3
    kind: str = "2.5d"
    monai_note: str | None = None
    note: str | None = None
    truth: list[np.ndarray] | None = field(default=None, repr=False)
    formats: dict[str, str] = field(default_factory=dict)
    """Folders of the same series in other formats (``"zarr"``, ``"hdf5"``, ``"nnunet"``: the scale section)."""

    @property
    def sample_shape(self) -> tuple[int, ...]:
        if self.kind == "3d":
            return (1, self.depth, self.rows, self.cols)
        return (self.depth, self.rows, self.cols)

    def cache_dir(self, name: str) -> Path:
        """A directory for a contender's own cache files, under the benchmark's temporary root."""
        return Path(self.root) / "cache" / name

    def save(self, path: Path) -> None:
        doc = {k: getattr(self, k) for k in ("root", "store", "store_u8", "rows", "cols", "depth", "kind",
                                            "monai_note", "note", "formats")}
        doc.update(series=[asdict(s) for s in self.series], series_index=self.series_index.tolist(),
                   z0=self.z0.tolist())
        path.write_text(json.dumps(doc))

    @classmethod
    def load(cls, path: Path) -> Prepared:
        doc = json.loads(path.read_text())
        return cls(**{**doc, "series": tuple(PreparedSeries(**s) for s in doc["series"]),
                      "series_index": np.asarray(doc["series_index"], np.int64), "z0": np.asarray(doc["z0"], np.int64)})


def make_synthetic(out: Path, *, series: int, slices: int, rows: int = 512, cols: int = 512, seed: int = 0,
                   first: int = 0) -> list:
    """Write synthetic CT series ``first .. first+series-1`` as ``out/seriesNN`` (one folder each, realistic
    HU from :mod:`medload.synthetic`); returns their :class:`~medload.synthetic.GeneratedSeries`.

    InstanceNumbers follow the slice order (``shuffle=False``): MONAI's PydicomReader stacks a folder by
    InstanceNumber, not by position, and must read the same volumes as everyone else."""
    from medload.synthetic import make_series

    spec = _spec(slices, rows, cols)
    return [make_series(Path(out) / f"series{i:02d}", spec, seed=seed + i, series_number=i + 1, shuffle=False)
            for i in range(first, first + series)]


def _spec(slices: int, rows: int, cols: int) -> SeriesSpec:
    from medload.synthetic import SeriesSpec

    return SeriesSpec(n_slices=slices, rows=rows, cols=cols, pixel_spacing=(0.7, 0.7), slice_spacing=1.0)


def write_synthetic(out: Path, *, series: int, slices: int, rows: int = 512, cols: int = 512, seed: int = 0) -> None:
    """The files :func:`make_synthetic` writes, without its ground truth, one process per core."""
    from medload.bench.ingest_data import SeriesJob, write_series

    spec = _spec(slices, rows, cols)
    write_series([SeriesJob(Path(out) / f"series{i:02d}", spec, seed + i, i + 1, shuffle=False) for i in range(series)])


def prepare(root: str | os.PathLike, *, series: int, slices: int, samples: int, rows: int = 512, cols: int = 512,
            seed: int = 0, kind: str = "2.5d", depth: int | None = None) -> Prepared:
    """Synthetic data for one benchmark: ``series`` CT series written as DICOM folders under ``root/dicom``,
    then :func:`prepare_from` (stores, .npy volumes, ``samples`` samples), with the ground truth."""
    root = Path(root)
    generated = make_synthetic(root / "dicom", series=series, slices=slices, rows=rows, cols=cols, seed=seed)
    return prepare_from(root, [root / "dicom"], samples=samples, kind=kind, depth=depth, seed=seed,
                        generated=generated)


def ingest_into(sources: Sequence[Path], store: Path, key_file: Path, windows: tuple[str, ...] = (),
                workers: int = 1) -> None:
    from medload.config import IngestConfig
    from medload.deid import KeyFile
    from medload.ingest import ingest

    ingest([str(s) for s in sources], store, config=IngestConfig(workers=workers, windows=windows),
           key_file=KeyFile(key_file, new=True))  # a benchmark's own key, created on its first ingest


def _match_generated(records: list, generated: list) -> dict[str, int]:
    """Store key -> position in ``generated``, by slice positions (LPS mm)."""
    out = {}
    for rec in records:
        pos = np.asarray(rec.positions, dtype=np.float64)
        hits = [i for i, g in enumerate(generated)
                if g.ipp.shape == pos.shape and np.allclose(np.asarray(g.ipp, np.float64), pos, atol=1e-3)]
        if len(hits) != 1:
            raise RuntimeError(f"stored series {rec.key[:12]} matches {len(hits)} generated series, expected 1")
        out[rec.key] = hits[0]
    return out


def _dicom_headers(sources: Sequence[Path]) -> dict[tuple, list[tuple[Path, np.ndarray, float]]]:
    """Single-frame images under ``sources`` grouped by (SeriesInstanceUID, Rows, Columns, orientation):
    (path, ImagePositionPatient, InstanceNumber) each."""
    import pydicom

    tags = ["SeriesInstanceUID", "Rows", "Columns", "ImageOrientationPatient", "ImagePositionPatient",
            "InstanceNumber", "NumberOfFrames"]
    groups: dict[tuple, list] = {}
    for src in sources:
        for path in sorted(p for p in Path(src).rglob("*") if p.is_file()):
            try:
                ds = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=tags)
                if int(ds.get("NumberOfFrames", 1) or 1) != 1:
                    continue
                key = (str(ds.SeriesInstanceUID), int(ds.Rows), int(ds.Columns),
                       tuple(round(float(v), 4) for v in ds.ImageOrientationPatient))
                ipp = np.asarray([float(v) for v in ds.ImagePositionPatient])
                number = float(ds.InstanceNumber) if ds.get("InstanceNumber") is not None else float("nan")
            except Exception:  # noqa: BLE001 - not a single-frame image with geometry: MONAI is not asked to read it
                continue
            groups.setdefault(key, []).append((path, ipp, number))
    return groups


def series_folders(records: list, sources: Sequence[Path], out: Path) -> tuple[dict[str, str], str | None]:
    """For each stored series, a folder ``out/<key>`` of links to exactly its DICOM files (in
    InstanceNumber order), found by matching slice positions; and, if MONAI's PydicomReader (which stacks
    a folder by InstanceNumber) would not read the stored volume of every series, why not."""
    groups = _dicom_headers(sources)
    folders: dict[str, str] = {}
    problems: Counter[str] = Counter()
    for rec in records:
        pos = np.asarray(rec.positions, dtype=np.float64)
        match = None
        for (_, rows, cols, _), members in groups.items():
            if (rows, cols) != tuple(rec.shape[1:]) or len(members) != len(pos):
                continue
            have = np.stack([m[1] for m in members])
            if np.abs(np.sort(have, axis=0) - np.sort(pos, axis=0)).max() < 1e-3:
                match = members
                break
        if match is None:
            problems["its files are not one single-frame file per slice of one series"] += 1
            continue
        if any(np.isnan(m[2]) for m in match):
            problems["its files lack InstanceNumber"] += 1
            by_number = match
        else:
            by_number = sorted(match, key=lambda m: m[2])
            if np.abs(np.stack([m[1] for m in by_number]) - pos).max() >= 1e-3:
                problems["its InstanceNumbers do not follow the slice order"] += 1
        folder = out / rec.key[:16]
        folder.mkdir(parents=True, exist_ok=True)
        for i, (path, _, _) in enumerate(by_number):
            link = folder / f"{i:05d}.dcm"
            if not link.exists():
                link.symlink_to(Path(path).resolve())
        folders[rec.key] = str(folder)
    note = None
    if problems:
        why = "; ".join(f"{n} series: {reason}" for reason, n in problems.items())
        note = (f"MONAI's PydicomReader (it stacks a folder by InstanceNumber) would not read the stored volume of "
                f"{sum(problems.values())} of {len(records)} series ({why})")
    return folders, note


def choose_series(records: list, depth: int, max_series: int | None) -> tuple[list, str | None]:
    """The series a benchmark can batch: int16 HU, at least ``depth`` slices, the most common matrix."""
    eligible = [r for r in records if r.dtype == "int16" and r.shape[0] >= depth]
    if not eligible:
        return [], (f"no stored series has int16 HU and at least {depth} slices "
                    f"({len(records)} series: {sorted({(r.dtype, r.shape[0]) for r in records})[:5]})")
    sizes = Counter(tuple(r.shape[1:]) for r in eligible)
    (size, _), = sizes.most_common(1)
    chosen = [r for r in eligible if tuple(r.shape[1:]) == size]
    note = None
    if len(chosen) < len(records):
        note = (f"{len(chosen)} of {len(records)} stored series used: int16 HU, >= {depth} slices, "
                f"{size[0]}x{size[1]} (batches need one matrix size)")
    if max_series is not None and len(chosen) > max_series:
        note = f"{max_series} of {len(records)} stored series used (the first by key)" + (
            f"; eligible: int16 HU, >= {depth} slices, {size[0]}x{size[1]}" if note else "")
        chosen = chosen[:max_series]
    return chosen, note


def prepare_from(  # noqa: PLR0913 - keyword-only choices of which data the bench prepares
        root: str | os.PathLike, sources: Sequence[str | os.PathLike], *, samples: int, kind: str = "2.5d",
        depth: int | None = None, seed: int = 0, generated: list | None = None,
        stores: tuple[Path, Path | None] | None = None, max_series: int | None = None, u8: bool = True,
        npy: bool = True, monai: bool = True, key_file: Path | None = None) -> Prepared:
    """The data of one benchmark from DICOM ``sources``: a medload store (HU) and, with ``u8``, one with
    soft-tissue uint8 planes (or the given ``stores``), .npy volumes (``npy``), per-series DICOM folders
    for MONAI (``monai``), and ``samples`` samples of ``depth`` slices drawn with ``seed``.

    ``generated``: the synthetic series the sources hold (their order and ground truth). Otherwise the
    series are a user's: those with int16 HU, enough slices and the most common matrix are used (at most
    ``max_series``). ``key_file``: the pseudonymisation key of the ingests (default: a new one under
    ``root``). Raises :class:`PeerUnavailable` when no stored series can give a sample."""
    from medload.storage.store import open_store

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    depth = depth or KINDS[kind]
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    source_paths = [Path(s) for s in sources]
    key_file = key_file or root / "bench.key"
    if stores is None:
        stores = (root / "store", root / "store_u8" if u8 else None)
        ingest_into(source_paths, stores[0], key_file)
        if stores[1] is not None:
            ingest_into(source_paths, stores[1], key_file, windows=("soft_tissue",))
    store = open_store(stores[0], cache=0)
    records = store.series()
    truth = None
    note = None
    if generated is not None:
        position = _match_generated(records, generated)
        records = sorted(records, key=lambda r: position[r.key])
        chosen = [r for r in records if r.shape[0] >= depth]
        if len(chosen) < len(records):
            raise PeerUnavailable(f"synthetic series have fewer than {depth} slices")
        truth = [generated[position[r.key]].hu for r in chosen]
        dicom_dirs = {r.key: str(generated[position[r.key]].paths[0].parent) for r in chosen}
        monai_note = None
    else:
        chosen, note = choose_series(records, depth, max_series)
        if not chosen:
            raise PeerUnavailable(note)
        dicom_dirs, monai_note = series_folders(chosen, source_paths, root / "series") if monai else ({}, None)
    if not monai:
        monai_note = "not prepared for this benchmark"
    out = []
    for i, rec in enumerate(chosen):
        npy_path = None
        if npy or truth is not None:
            volume = store.read(rec.key)
            if truth is not None and not np.array_equal(volume, truth[i]):
                raise RuntimeError(f"stored series {rec.key[:12]} differs from the generated HU")
            if npy:
                path = root / "npy" / f"{rec.key}.npy"
                path.parent.mkdir(exist_ok=True)
                if not path.exists():
                    np.save(path, volume)
                npy_path = str(path)
        out.append(PreparedSeries(rec.key, dicom_dirs.get(rec.key), npy_path, rec.shape[0]))
    rng = np.random.default_rng(seed)
    index = rng.integers(len(out), size=samples)
    z0 = np.array([rng.integers(out[s].depth - depth + 1) for s in index], np.int64)
    prep = Prepared(str(root), str(stores[0]), None if stores[1] is None else str(stores[1]), chosen[0].shape[1],
                    chosen[0].shape[2], tuple(out), index, z0, depth, kind, monai_note, note, truth)
    return prep


def warm_page_cache(prep: Prepared) -> None:
    """Read every file a contender may read, so each run starts with the data in the page cache."""
    from medload.bench.common import data_files, read_files

    paths = [prep.store] + ([prep.store_u8] if prep.store_u8 else [])
    paths += [s.npy for s in prep.series if s.npy] + [s.dicom_dir for s in prep.series if s.dicom_dir]
    read_files(data_files(paths))

"""Loading benchmark harness: data, one fresh process per contender, timing, peak memory, cache counters.

Every contender of :mod:`medload.bench.peers` turns the same random list of samples -- ``(series, first
slice z0)``, ``depth`` slices each -- into batches of windowed float32 on the target device: 2.5D
``(B, 3, rows, columns)`` or 3D ``(B, 1, depth, rows, columns)``. Each run is a fresh process
(memory and allocator state never leak from one contender to the next), forked from a server that has
done the contender's imports (:mod:`medload.bench.forkserver`), started with the data in the page
cache; it sets up (fills its caches), then makes ``repeats`` passes of ``warmup`` batches followed
by up to ``batches`` timed ones (a fresh iterator each pass, so DataLoader workers start in the
warm-up). A pass stops early once ``max_pass_s`` seconds of timed batches have elapsed (at least one
timed batch always counts), and its warm-up after one batch if that took ``max_pass_s``: slow
contenders are measured on fewer samples rather than for minutes.
A batch counts once it is checked (shape, dtype, device) and, on a GPU, synchronised. Meanwhile a
thread of this process samples the PSS of the run's whole process tree, the server included (shared
import pages count once, as in a standalone process; :class:`~medload.bench.common.peak_pss`).
A contender that fails is reported with its error, one that cannot apply to the data as skipped with
the reason; neither is ever dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from medload.bench.common import peak_pss, spread, tree_bytes
from medload.bench.peers import CEILINGS, CONTENDERS, MEDLOAD, PeerUnavailable, resolve

__all__ = ["Prepared", "PreparedSeries", "Settings", "make_synthetic", "prepare", "prepare_from", "series_folders",
           "choose_series", "run_contender", "run_loading", "peak_pss", "KINDS", "BATCH_SIZE", "REFERENCE", "main"]

BATCH_SIZE = 8
KINDS = {"2.5d": 3, "3d": 32}
"""Sample kinds and their depth: 2.5D stacks of 3 slices as channels, 3D slabs of 32 slices."""
REFERENCE = "npy_memmap"


# ---- data ----------------------------------------------------------------------------------------
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
                                            "monai_note", "note")}
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
    from medload.synthetic import SeriesSpec, make_series

    spec = SeriesSpec(n_slices=slices, rows=rows, cols=cols, pixel_spacing=(0.7, 0.7), slice_spacing=1.0)
    return [make_series(Path(out) / f"series{i:02d}", spec, seed=seed + i, series_number=i + 1, shuffle=False)
            for i in range(first, first + series)]


def prepare(root: str | os.PathLike, *, series: int, slices: int, samples: int, rows: int = 512, cols: int = 512,
            seed: int = 0, kind: str = "2.5d", depth: int | None = None) -> Prepared:
    """Synthetic data for one benchmark: ``series`` CT series written as DICOM folders under ``root/dicom``,
    then :func:`prepare_from` (stores, .npy volumes, ``samples`` samples), with the ground truth."""
    root = Path(root)
    generated = make_synthetic(root / "dicom", series=series, slices=slices, rows=rows, cols=cols, seed=seed)
    return prepare_from(root, [root / "dicom"], samples=samples, kind=kind, depth=depth, seed=seed,
                        generated=generated)


def _ingest(sources: Sequence[Path], store: Path, key_file: Path, windows: tuple[str, ...] = ()) -> None:
    from medload.config import IngestConfig
    from medload.ingest import ingest

    ingest([str(s) for s in sources], store, config=IngestConfig(workers=1, windows=windows), key_file=key_file)


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
    folders, problems = {}, Counter()
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


def prepare_from(root: str | os.PathLike, sources: Sequence[str | os.PathLike], *, samples: int, kind: str = "2.5d",
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
    sources = [Path(s) for s in sources]
    key_file = key_file or root / "bench.key"
    if stores is None:
        stores = (root / "store", root / "store_u8" if u8 else None)
        _ingest(sources, stores[0], key_file)
        if stores[1] is not None:
            _ingest(sources, stores[1], key_file, windows=("soft_tissue",))
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
        dicom_dirs, monai_note = series_folders(chosen, sources, root / "series") if monai else ({}, None)
    if not monai:
        monai_note = "not prepared for this benchmark"
    out = []
    for i, rec in enumerate(chosen):
        path = None
        if npy or truth is not None:
            volume = store.read(rec.key)
            if truth is not None and not np.array_equal(volume, truth[i]):
                raise RuntimeError(f"stored series {rec.key[:12]} differs from the generated HU")
            if npy:
                path = root / "npy" / f"{rec.key}.npy"
                path.parent.mkdir(exist_ok=True)
                if not path.exists():
                    np.save(path, volume)
                path = str(path)
        out.append(PreparedSeries(rec.key, dicom_dirs.get(rec.key), path, rec.shape[0]))
    rng = np.random.default_rng(seed)
    index = rng.integers(len(out), size=samples)
    z0 = np.array([rng.integers(out[s].depth - depth + 1) for s in index], np.int64)
    prep = Prepared(str(root), str(stores[0]), None if stores[1] is None else str(stores[1]), chosen[0].shape[1],
                    chosen[0].shape[2], tuple(out), index, z0, depth, kind, monai_note, note, truth)
    return prep


def _warm_page_cache(prep: Prepared) -> None:
    """Read every file a contender may read, so each run starts with the data in the page cache."""
    paths = [Path(prep.store)] + ([Path(prep.store_u8)] if prep.store_u8 else [])
    paths += [Path(s.npy) for s in prep.series if s.npy] + [Path(s.dicom_dir) for s in prep.series if s.dicom_dir]
    for top in paths:
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.is_file():
                with open(path, "rb") as f:
                    while f.read(1 << 22):
                        pass


# ---- one run, inside its own process -------------------------------------------------------------
def _check(batch, shape: tuple[int, ...], dtype, device) -> None:
    import torch

    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"batch is a {type(batch).__name__}, not a tensor")
    if tuple(batch.shape) != shape or batch.dtype != dtype or batch.device.type != device.type:
        raise ValueError(f"batch is {tuple(batch.shape)} {batch.dtype} on {batch.device}, "
                         f"expected {shape} {dtype} on {device}")


def run_contender(name: str, prep: Prepared, *, batch_size: int, num_workers: int, device: str, warmup: int,
                  batches: int, repeats: int, max_pass_s: float | None = None, pss_root: int | None = None) -> dict:
    """Set up contender ``name`` and time ``repeats`` passes. Returns ``setup_s``, ``seconds`` and
    ``samples`` per pass, and ``cache`` (the medload contenders' summed cache counters, else None).

    ``pss_root``: a process whose tree's PSS is also read here after set-up and after each pass, while
    the loader is alive (``pss_in_run_mb``): short runs would otherwise end between two samples."""
    import torch

    from medload.bench.common import tree_pss_mb

    pss = []

    dev = torch.device(device)
    dtype = torch.int16 if name == "ceiling_int16" else torch.float32
    shape = (batch_size, *prep.sample_shape)
    t0 = time.perf_counter()
    loader = resolve(name)(prep, batch_size, num_workers, device)
    setup = time.perf_counter() - t0
    if pss_root is not None:
        pss.append(tree_pss_mb(pss_root))
    seconds, samples = [], []
    for _ in range(repeats):
        it = iter(loader)
        n, timed, t0 = 0, 0, None
        w0 = time.perf_counter()
        try:
            while timed < batches:
                now = time.perf_counter()
                if t0 is None and (n >= warmup or (n > 0 and max_pass_s is not None and now - w0 >= max_pass_s)):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()  # warm-up over (or cut short: a slow contender)
                elif t0 is not None and timed > 0 and max_pass_s is not None and now - t0 >= max_pass_s:
                    break
                try:
                    batch = next(it)
                except StopIteration:
                    raise RuntimeError(f"yielded {n} batches, expected {warmup + batches}") from None
                _check(batch, shape, dtype, dev)
                n += 1
                timed += t0 is not None
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds.append(time.perf_counter() - t0)
            samples.append(timed * batch_size)
            if pss_root is not None:
                pss.append(tree_pss_mb(pss_root))
        finally:
            getattr(it, "close", lambda: None)()
            del it
    stats = getattr(loader, "cache_stats", None)
    return {"setup_s": setup, "seconds": seconds, "samples": samples, "cache": stats() if stats else None,
            "pss_in_run_mb": max(pss, default=None)}


def _child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    out = Path(spec.pop("out"))
    try:
        result = run_contender(spec.pop("name"), Prepared.load(Path(spec.pop("prep"))), **spec)
    except PeerUnavailable as exc:  # reported as a skipped row, with the reason
        result = {"skipped": str(exc)}
    except Exception as exc:  # reported as a failed row, with its message
        result = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))


@dataclass(frozen=True)
class Settings:
    """How each contender is run (see the module docstring)."""

    warmup: int = 3
    batches: int = 30
    repeats: int = 3
    max_pass_s: float | None = 10.0
    device: str = "cpu"
    batch_size: int = BATCH_SIZE
    timeout: float = 1800.0


SERVER_MODULES = {"base": ["medload.bench.loading"],
                  "monai": ["medload.bench.loading", "medload.bench.counted", "medload.bench.monai_peers"]}
"""What each fork server imports: contenders that need neither MONAI nor medload.data run from ``base``."""
BASE_CONTENDERS = ("npy_memmap", "ceiling_float32", "ceiling_int16")


def server_group(name: str) -> str:
    return "base" if name in BASE_CONTENDERS else "monai"


class Servers:
    """The fork servers of a benchmark, at most one alive at a time (two would share library pages and
    lower each other's PSS); :meth:`get` starts the one a contender needs, closing the other."""

    def __init__(self) -> None:
        self.group: str | None = None
        self.server = None

    def get(self, group: str):
        from medload.bench.forkserver import ForkServer

        if group != self.group or self.server is None or self.server.proc.poll() is not None:
            self.close()
            self.server, self.group = ForkServer(SERVER_MODULES[group]), group
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.server = self.group = None

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run_in_child(prep: Prepared, prep_path: Path, name: str, workers: int, settings: Settings, log_dir: Path,
                  servers: Servers) -> dict:
    tag = name.replace("/", "_").replace(":", "_").replace(".", "_")
    out = log_dir / f"{tag}-w{workers}.json"
    log = log_dir / f"{tag}-w{workers}.log"
    spec = {"name": name, "prep": str(prep_path), "out": str(out), "batch_size": settings.batch_size,
            "num_workers": workers, "device": settings.device, "warmup": settings.warmup, "batches": settings.batches,
            "repeats": settings.repeats, "max_pass_s": settings.max_pass_s}
    server = servers.get(server_group(name))
    spec["pss_root"] = server.pid
    _warm_page_cache(prep)
    with peak_pss(server.pid) as peak:  # the server and its child: shared import pages count once
        code, timed_out = server.run("medload.bench.loading:_child", json.dumps(spec), log, settings.timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    if not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        why = f"timed out after {settings.timeout:g} s" if timed_out else f"exit status {code}"
        result = {"error": f"{why}: {' | '.join(tail)}"}
    result["peak_pss_mb"] = max(peak.mb, result.pop("pss_in_run_mb", None) or 0.0)
    return result


def _row(name: str, workers: int, threads: int | None, res: dict, settings: Settings, prep: Prepared) -> dict:
    row = {"contender": name, "kind": prep.kind, "num_workers": None if threads else workers, "threads": threads,
           "status": "ok", "error": None, "dtype": "int16" if name == "ceiling_int16" else "float32",
           "peak_pss_mb": res.get("peak_pss_mb"), "setup_s": res.get("setup_s"), "cache": res.get("cache")}
    if "skipped" in res:
        row.update(status="skipped", reason=res["skipped"], peak_pss_mb=None)
    elif "error" in res:
        row.update(status="failed", error=res["error"])
    else:
        rates = [n / s for n, s in zip(res["samples"], res["seconds"])]
        s = spread(rates)
        row.update(seconds=res["seconds"], samples=res["samples"], samples_per_s=s["median"],
                   samples_per_s_min=s["min"], samples_per_s_max=s["max"])
        if min(res["samples"]) < settings.batches * settings.batch_size:
            row["capped"] = True  # some pass stopped at max_pass_s
    return row


def _ratios(rows: list[dict]) -> None:
    """Every row's samples/s over each other contender's at the same num_workers (ceilings: 1 thread is
    compared with 0 workers, N threads with N workers); ``x_npy_memmap`` and ``pct_of_ceiling_float32``."""
    def workers(r: dict) -> int:
        return r["num_workers"] if r["threads"] is None else (0 if r["threads"] == 1 else r["threads"])

    rate = {(r["contender"], workers(r)): r.get("samples_per_s") for r in rows}
    names = list(dict.fromkeys(r["contender"] for r in rows))
    for r in rows:
        own, w = r.get("samples_per_s"), workers(r)
        r["ratios"] = {}
        for peer in names:
            theirs = rate.get((peer, w))
            if peer != r["contender"] and own and theirs:
                r["ratios"][peer] = own / theirs
        npy, ceiling = rate.get((REFERENCE, w)), rate.get(("ceiling_float32", w))
        r["x_npy_memmap"] = own / npy if own and npy else None
        r["pct_of_ceiling_float32"] = 100 * own / ceiling if own and ceiling else None


def run_loading(prep: Prepared, work: Path, *, contenders: Sequence[str] = tuple(CONTENDERS),
                workers: Sequence[int] = (0, 2), settings: Settings = Settings(), progress: bool = True,
                label: str = "", servers: Servers | None = None) -> dict:
    """Run every contender at every ``workers`` (ceilings: at 1 and max(workers) threads) in fresh
    processes on ``prep``; every figure, as a dict. ``work``: scratch space (logs, the saved sample list);
    ``servers``: the fork servers to run from (default: started here, closed at the end)."""
    from medload.progress import progress_bar

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    prep_path = work / f"prepared-{prep.kind}.json"
    prep.save(prep_path)
    log_dir = work / f"logs-{prep.kind}"
    log_dir.mkdir(exist_ok=True)
    names = [n for n in contenders if n not in CEILINGS]
    ceilings = [n for n in contenders if n in CEILINGS]
    threads = sorted({max(1, w) for w in workers})
    plan = [(n, w, None) for w in workers for n in names] + [(n, t, t) for t in threads for n in ceilings]
    own = servers is None
    servers = servers or Servers()
    # runs grouped by fork server, starting with the one already running; rows keep the plan's order
    first = servers.group
    order = sorted(range(len(plan)), key=lambda i: (server_group(plan[i][0]) != first, server_group(plan[i][0]), i))
    rows: list[dict | None] = [None] * len(plan)
    try:
        with progress_bar(f"loading {prep.kind}{label}", len(plan), enabled=progress) as advance:
            for i in order:
                name, w, nthreads = plan[i]
                res = _run_in_child(prep, prep_path, name, w, settings, log_dir, servers)
                rows[i] = _row(name, w, nthreads, res, settings, prep)
                advance(1)
    finally:
        if own:
            servers.close()
    _ratios(rows)
    return {"status": "ok", "kind": prep.kind, "sample_shape": list(prep.sample_shape), "depth": prep.depth,
            "rows_px": prep.rows, "cols_px": prep.cols, "batch_size": settings.batch_size,
            "series": len(prep.series), "slices": [s.depth for s in prep.series],
            "samples_per_pass": len(prep.z0), "warmup": settings.warmup, "batches": settings.batches,
            "repeats": settings.repeats, "max_pass_s": settings.max_pass_s, "device": settings.device,
            "window": "soft_tissue 400/40", "monai_note": prep.monai_note, "note": prep.note,
            "data_mb": {"store": tree_bytes(prep.store) / 1e6,
                        "store_u8": tree_bytes(prep.store_u8) / 1e6 if prep.store_u8 else None,
                        "npy": sum(tree_bytes(s.npy) for s in prep.series if s.npy) / 1e6},
            "medload": list(MEDLOAD), "rows": rows}


# ---- the command-line script (benchmarks/loading.py) ---------------------------------------------
FULL = {"series": 4, "slices": 48, "batches": 30, "warmup": 3}
QUICK = {"series": 3, "slices": 24, "batches": 8, "warmup": 2}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/loading.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"smaller data and fewer batches ({QUICK})")
    ap.add_argument("--kind", choices=list(KINDS), default="2.5d", help="2.5D stacks of 3 or 3D slabs of 32 slices")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--workers", default="0,2", help="DataLoader num_workers values, comma-separated (default 0,2)")
    ap.add_argument("--batches", type=int, help=f"timed batches of {BATCH_SIZE} per pass")
    ap.add_argument("--warmup", type=int, help="untimed batches before each timed pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-pass-s", type=float, default=10.0, help="stop a pass's timed batches after this long")
    ap.add_argument("--series", type=int)
    ap.add_argument("--slices", type=int)
    ap.add_argument("--size", type=int, help="rows = columns of the synthetic series (default 512; 3D: 256)")
    ap.add_argument("--device", default="cpu", help="where batches must land (cpu, cuda, cuda:1...)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated subset, in table order (or module:function of your own)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed and marked failed")
    args = ap.parse_args(argv)
    depth = KINDS[args.kind]
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, max(value, depth + 4) if key == "slices" else value)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(c for c in args.contenders if c not in CONTENDERS and ":" not in c)
    if unknown:
        ap.error(f"unknown contenders {unknown}: choose from {', '.join(CONTENDERS)}")
    if args.slices < depth or args.series < 1 or args.batches < 1 or args.repeats < 1 or min(args.workers) < 0:
        ap.error(f"need --slices >= {depth}, --series >= 1, --batches >= 1, --repeats >= 1, --workers >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1])
        return
    args = _parse(argv)
    from medload.bench.common import machine
    from medload.bench.report import print_tables, section_tables

    size = args.size or (256 if args.kind == "3d" else 512)
    settings = Settings(warmup=args.warmup, batches=args.batches, repeats=args.repeats, max_pass_s=args.max_pass_s,
                        device=args.device, timeout=args.timeout)
    with tempfile.TemporaryDirectory(prefix="medload-bench-") as tmp:
        prep = prepare(Path(tmp) / "data", series=args.series, slices=args.slices, rows=size, cols=size,
                       samples=(args.warmup + args.batches) * BATCH_SIZE, kind=args.kind)
        section = run_loading(prep, Path(tmp) / "work", contenders=args.contenders, workers=args.workers,
                              settings=settings)
    results = {"loading": {args.kind: section}, "config": {"machine": machine()}}
    print_tables(section_tables(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()

"""2.5D loading benchmark harness: data, one fresh process per contender, timing, peak memory, table and JSON.

Every contender of :mod:`medload.bench.peers` turns the same random list of (series, z) samples into
batches of ``(B, 3, rows, columns)`` windowed float32 on the target device. Each run is a fresh
subprocess (memory and allocator state never leak from one contender to the next) started with the
data in the page cache; it sets up (fills its caches), then makes ``repeats`` passes of ``warmup``
batches followed by ``batches`` timed ones (a fresh iterator each pass, so DataLoader workers start in
the warm-up). A batch counts once it is checked (shape, dtype, device) and, on a GPU, synchronised.
Meanwhile a thread of this process samples the proportional set size (PSS, from
``/proc/<pid>/smaps_rollup``) of the run's whole process tree: the peak is what the contender costs
in memory, DataLoader workers included, shared pages counted once. A contender that fails is reported
with its error, never dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

import numpy as np

from medload.bench.peers import CEILINGS, CONTENDERS

__all__ = ["Prepared", "PreparedSeries", "prepare", "run_contender", "peak_pss", "main"]

BATCH_SIZE = 8
FULL = {"series": 4, "slices": 48, "batches": 30, "warmup": 3}
QUICK = {"series": 3, "slices": 24, "batches": 8, "warmup": 2}
REFERENCE = "npy_memmap"


# ---- data ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PreparedSeries:
    """One series in every form the contenders read: its store key, DICOM folder, .npy volume."""

    key: str
    dicom_dir: str
    npy: str
    depth: int


@dataclass
class Prepared:
    """The benchmark's data, and the sample list: sample ``i`` is slices ``z[i]-1 .. z[i]+1`` of
    ``series[series_index[i]]``. ``truth`` (ground-truth HU by series position) is not saved."""

    root: str
    store: str
    store_u8: str
    rows: int
    cols: int
    series: tuple[PreparedSeries, ...]
    series_index: np.ndarray
    z: np.ndarray
    truth: list[np.ndarray] | None = field(default=None, repr=False)

    def cache_dir(self, name: str) -> Path:
        """A directory for a contender's own cache files, under the benchmark's temporary root."""
        return Path(self.root) / "cache" / name

    def save(self, path: Path) -> None:
        doc = {k: getattr(self, k) for k in ("root", "store", "store_u8", "rows", "cols")}
        doc.update(series=[asdict(s) for s in self.series], series_index=self.series_index.tolist(),
                   z=self.z.tolist())
        path.write_text(json.dumps(doc))

    @classmethod
    def load(cls, path: Path) -> Prepared:
        doc = json.loads(path.read_text())
        return cls(**{**doc, "series": tuple(PreparedSeries(**s) for s in doc["series"]),
                      "series_index": np.asarray(doc["series_index"], np.int64), "z": np.asarray(doc["z"], np.int64)})


def prepare(root: str | os.PathLike, *, series: int, slices: int, samples: int, rows: int = 512, cols: int = 512,
            seed: int = 0) -> Prepared:
    """Write ``series`` synthetic CT series as DICOM folders (one per series), ingest them into a medload
    store (HU) and a second one with soft-tissue uint8 planes, save each volume as int16 .npy, and
    draw ``samples`` (series, z) pairs, z in ``1 .. depth-2``."""
    from medload.config import IngestConfig
    from medload.ingest import ingest
    from medload.storage.store import open_store
    from medload.synthetic import SeriesSpec, make_series

    root = Path(root)
    spec = SeriesSpec(n_slices=slices, rows=rows, cols=cols, slice_spacing=1.0)
    # shuffle=False: InstanceNumber follows position, since MONAI's PydicomReader stacks by InstanceNumber
    generated = [make_series(root / "dicom" / f"series{i:02d}", spec, seed=seed + i, series_number=i + 1,
                             shuffle=False) for i in range(series)]
    key_file = root / "bench.key"
    ingest(root / "dicom", root / "store", config=IngestConfig(workers=1), key_file=key_file)
    ingest(root / "dicom", root / "store_u8", config=IngestConfig(workers=1, windows=("soft_tissue",)),
           key_file=key_file)
    store = open_store(root / "store", cache=0)
    (root / "npy").mkdir()
    by_position: dict[int, PreparedSeries] = {}
    for rec in store.series():
        volume = store.read(rec.key)
        match = [i for i, g in enumerate(generated) if np.array_equal(g.hu, volume)]
        if len(match) != 1:
            raise RuntimeError(f"stored series {rec.key[:12]} matches {len(match)} generated series, expected 1")
        np.save(root / "npy" / f"{rec.key}.npy", volume)
        by_position[match[0]] = PreparedSeries(rec.key, str(root / "dicom" / f"series{match[0]:02d}"),
                                               str(root / "npy" / f"{rec.key}.npy"), rec.shape[0])
    if sorted(by_position) != list(range(series)):
        raise RuntimeError(f"ingest stored {len(by_position)} of {series} series")
    chosen = tuple(by_position[i] for i in range(series))
    rng = np.random.default_rng(seed)
    index = rng.integers(series, size=samples)
    z = np.array([1 + rng.integers(chosen[s].depth - 2) for s in index], np.int64)
    return Prepared(str(root), str(root / "store"), str(root / "store_u8"), rows, cols, chosen, index, z,
                    truth=[g.hu for g in generated])


def _warm_page_cache(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file() and "cache" not in path.relative_to(root).parts:
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
                  batches: int, repeats: int) -> dict:
    """Set up contender ``name`` and time ``repeats`` passes; returns ``setup_s`` and ``seconds`` per pass."""
    import torch

    dev = torch.device(device)
    dtype = torch.int16 if name == "ceiling_int16" else torch.float32
    shape = (batch_size, 3, prep.rows, prep.cols)
    t0 = time.perf_counter()
    loader = CONTENDERS[name](prep, batch_size, num_workers, device)
    setup = time.perf_counter() - t0
    seconds = []
    for _ in range(repeats):
        it = iter(loader)
        try:
            for n in range(warmup + batches):
                if n == warmup:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    raise RuntimeError(f"yielded {n} batches, expected {warmup + batches}") from None
                _check(batch, shape, dtype, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds.append(time.perf_counter() - t0)
        finally:
            getattr(it, "close", lambda: None)()
            del it
    return {"setup_s": setup, "seconds": seconds}


def _child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    out = Path(spec.pop("out"))
    try:
        result = run_contender(spec.pop("name"), Prepared.load(Path(spec.pop("prep"))), **spec)
    except Exception as exc:  # reported as a failed row, with its message
        result = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))


# ---- memory: PSS of a process tree, sampled by a thread ------------------------------------------
def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # the process (or thread) ended meanwhile
    return pids


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class peak_pss:  # noqa: N801 - used like a function
    """``with peak_pss(pid) as peak:`` samples the PSS of ``pid`` and its descendants every ``interval``
    seconds in a thread; ``peak.mb`` is the largest sum seen (MB)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval, self.kib = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.kib = max(self.kib, sum(_pss_kib(p) for p in _tree(self.pid)))
            self._stop.wait(self.interval)

    @property
    def mb(self) -> float:
        return self.kib * 1024 / 1e6

    def __enter__(self) -> peak_pss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _run_in_child(prep_path: Path, name: str, workers: int, args: argparse.Namespace, log_dir: Path) -> dict:
    out = log_dir / f"{name}-w{workers}.json"
    log = log_dir / f"{name}-w{workers}.log"
    spec = {"name": name, "prep": str(prep_path), "out": str(out), "batch_size": BATCH_SIZE, "num_workers": workers,
            "device": args.device, "warmup": args.warmup, "batches": args.batches, "repeats": args.repeats}
    _warm_page_cache(prep_path.parent)
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "medload.bench.loading", "--child", json.dumps(spec)],
                                stdout=logf, stderr=subprocess.STDOUT)
        timed_out = False
        with peak_pss(proc.pid) as peak:
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
    result = json.loads(out.read_text()) if out.exists() else {}
    if not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        why = f"timed out after {args.timeout:g} s" if timed_out else f"exit status {proc.returncode}"
        result = {"error": f"{why}: {' | '.join(tail)}"}
    result["peak_pss_mb"] = peak.mb
    return result


# ---- the run -------------------------------------------------------------------------------------
def _rows(args: argparse.Namespace, prep_path: Path, log_dir: Path) -> list[dict]:
    from medload.progress import progress_bar

    names = [n for n in args.contenders if n not in CEILINGS]
    ceilings = [n for n in args.contenders if n in CEILINGS]
    threads = sorted({max(1, w) for w in args.workers})
    plan = [(n, w, None) for w in args.workers for n in names] + [(n, t, t) for t in threads for n in ceilings]
    rows = []
    samples = args.batches * BATCH_SIZE
    with progress_bar("contenders", len(plan), enabled=True) as advance:
        for name, workers, nthreads in plan:
            res = _run_in_child(prep_path, name, workers, args, log_dir)
            row = {"contender": name, "num_workers": None if nthreads else workers, "threads": nthreads,
                   "status": "failed" if "error" in res else "ok", "error": res.get("error"),
                   "setup_s": res.get("setup_s"), "seconds": res.get("seconds"), "peak_pss_mb": res["peak_pss_mb"],
                   "dtype": "int16" if name == "ceiling_int16" else "float32"}
            if row["status"] == "ok":
                rates = [samples / s for s in res["seconds"]]
                row.update(samples_per_s=statistics.median(rates), samples_per_s_min=min(rates),
                           samples_per_s_max=max(rates))
            rows.append(row)
            advance(1)
    # ratios: to npy_memmap at the same num_workers; to ceiling_float32 with 1 thread (workers 0) or N threads
    rate = {(r["contender"], r["num_workers"] if r["threads"] is None else r["threads"]): r.get("samples_per_s")
            for r in rows}
    for r in rows:
        workers = r["num_workers"] if r["threads"] is None else (0 if r["threads"] == 1 else r["threads"])
        npy, ceiling = rate.get((REFERENCE, workers)), rate.get(("ceiling_float32", max(1, workers)))
        own = r.get("samples_per_s")
        r["x_npy_memmap"] = own / npy if own and npy else None
        r["pct_of_ceiling_float32"] = 100 * own / ceiling if own and ceiling else None
    return rows


def _label(row: dict) -> str:
    """The num_workers cell: DataLoader workers, or a ceiling's threads."""
    if row["threads"]:
        return f"{row['threads']} thread{'s' if row['threads'] > 1 else ''}"
    return str(row["num_workers"])


def _table(rows: list[dict], title: str):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for col in ("contender", "num_workers", "samples/s (min-max)", "x npy_memmap", "% of ceiling_float32",
                "peak PSS MB", "setup s"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    order = sorted(range(len(rows)), key=lambda i: (max(1, rows[i]["num_workers"] or 0) if rows[i]["threads"] is None
                                                    else rows[i]["threads"], rows[i]["threads"] is not None, i))
    for i in order:
        r = rows[i]
        label = _label(r)
        name = r["contender"] + (" (int16)" if r["dtype"] == "int16" else "")
        if r["status"] != "ok":
            msg = r["error"] if len(r["error"]) <= 70 else r["error"][:67] + "..."
            table.add_row(name, label, f"[red]failed: {escape(msg)}", "", "", f"{r['peak_pss_mb']:.0f}", "")
            continue
        ratio = f"{r['x_npy_memmap']:.2f}" if r["x_npy_memmap"] is not None else "-"
        pct = f"{r['pct_of_ceiling_float32']:.0f}" if r["pct_of_ceiling_float32"] is not None else "-"
        table.add_row(name, label, f"{r['samples_per_s']:.1f} ({r['samples_per_s_min']:.1f}-{r['samples_per_s_max']:.1f})",
                      ratio, pct, f"{r['peak_pss_mb']:.0f}", f"{r['setup_s']:.1f}")
    return table


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/loading.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"smaller data and fewer batches ({QUICK})")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--workers", default="0,2", help="DataLoader num_workers values, comma-separated (default 0,2)")
    ap.add_argument("--batches", type=int, help=f"timed batches of {BATCH_SIZE} per pass")
    ap.add_argument("--warmup", type=int, help="untimed batches before each timed pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--series", type=int)
    ap.add_argument("--slices", type=int)
    ap.add_argument("--device", default="cpu", help="where batches must land (cpu, cuda, cuda:1...)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset, in table order")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed and marked failed")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        ap.error(f"unknown contenders {unknown}: choose from {', '.join(CONTENDERS)}")
    if args.slices < 3 or args.series < 1 or args.batches < 1 or args.repeats < 1 or min(args.workers) < 0:
        ap.error("need --slices >= 3, --series >= 1, --batches >= 1, --repeats >= 1, --workers >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1])
        return
    args = _parse(argv)
    import monai
    import torch
    from rich.console import Console
    from rich.markup import escape

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="medload-bench-") as tmp:
        root = Path(tmp) / "data"
        root.mkdir()
        prep = prepare(root, series=args.series, slices=args.slices, samples=(args.warmup + args.batches) * BATCH_SIZE)
        prep_path = root / "prepared.json"
        prep.save(prep_path)
        sizes = {name: sum(p.stat().st_size for p in (root / name).rglob("*") if p.is_file()) / 1e6
                 for name in ("dicom", "store", "store_u8", "npy")}
        log_dir = Path(tmp) / "logs"
        log_dir.mkdir()
        rows = _rows(args, prep_path, log_dir)
    title = (f"2.5D loading: batches of {BATCH_SIZE} x (3, {prep.rows}, {prep.cols}) float32, soft-tissue window, on {args.device}; "
             f"{args.series} series x {args.slices} slices; {args.batches} timed batches after {args.warmup} "
             f"warm-up, median of {args.repeats} (min-max); {cores} cores")
    console = Console(width=170)
    console.print(_table(rows, title))
    for r in rows:
        if r["status"] != "ok":
            console.print(f"[red]{r['contender']} ({_label(r)}) failed:[/red] {escape(r['error'])}", highlight=False)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config.update(batch_size=BATCH_SIZE, rows=prep.rows, cols=prep.cols, window="soft_tissue 400/40", cores=cores,
                      data_mb=sizes, date=date.today().isoformat(), python=platform.python_version(),
                      torch=torch.__version__, monai=monai.__version__, numpy=np.__version__,
                      machine=platform.machine())
        args.json.write_text(json.dumps({"config": config, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()

"""``medload bench``: one command that builds the same data for every contender and prints tables of ratios.

Sections (each measured in this run, on this machine, against peers measured in the same run):

- ``ingest``: DICOM -> something a training job can read: medload ingest at 1 and N workers against
  bare pydicom read+decode, dcm2niix and SimpleITK's ImageSeriesReader; files/s, MB/s, per core,
  ratios, and the size of the store against the DICOM (:mod:`medload.bench.ingest`).
- ``loading``: batches of windowed float32 on the device, 2.5D ``(8, 3, 512, 512)`` and 3D slabs
  ``(8, 1, 32, 256, 256)``, at ``num_workers`` 0 and 2: MONAI's LoadImaged / CacheDataset /
  PersistentDataset / LMDBDataset, .npy memmaps, the store's read ceilings and medload (256 MB L1);
  samples/s, peak PSS of the process tree, medload's L1 hit rate (:mod:`medload.bench.loading`,
  :mod:`medload.bench.peers`).
- ``scaling``: medload 2.5D samples/s and PSS at 2 workers, 256 MB L1, as the store grows from 1 to
  16 series: flat is the goal.
- ``gpu`` (only with a CUDA device; otherwise reported as skipped): H2D bandwidth, GPU utilisation of
  a UNet training step fed by the loader, BatchAugment throughput (:mod:`medload.bench.gpu`).
- ``autotune`` (only when asked for): ``make_loader(num_workers="auto")`` against a grid of workers x
  prefetch, samples/s of each (:mod:`medload.bench.autotune`).

Synthetic CT by default (realistic HU from :mod:`medload.synthetic`, written with InstanceNumbers in
slice order because MONAI's PydicomReader stacks a folder by InstanceNumber); ``data=DIR`` runs on a
user's DICOM instead (contenders that cannot apply are reported as skipped, with the reason). Every
timed run is a fresh process. Medians over repeats, with min-max. A contender that fails is reported
as failed with its error, never dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from medload.errors import ConfigError

__all__ = ["run_bench", "BenchConfig", "FULL", "QUICK", "SECTIONS", "readme_tables"]

SECTIONS = ("ingest", "loading", "scaling", "gpu")
EXTRA_SECTIONS = ("autotune",)  # run only when named


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repeats of a benchmark run (``FULL`` and ``QUICK`` are the two ``medload bench`` uses)."""

    # synthetic data: 2.5D and ingest share one set of series, 3D has its own (smaller matrix)
    series_25d: int = 8
    slices_25d: int = 64
    size_25d: int = 512
    series_3d: int = 4
    slices_3d: int = 96
    size_3d: int = 256
    depth_3d: int = 32
    # ingest
    ingest_repeats: int = 5
    ingest_warmup: int = 1
    # loading
    workers: tuple[int, ...] = (0, 2)
    workers_3d: tuple[int, ...] | None = None  # None: as ``workers``
    warmup: int = 3
    batches: int = 30
    # 5: the first pass of medload fills its L1 (CacheDataset fills its cache before timing), so of 3 passes
    # the median was the slower of two warm ones; of 5 it is the second slowest of four
    repeats: int = 5
    max_pass_s: float | None = 10.0
    batch_size: int = 8
    contenders: tuple[str, ...] | None = None  # None: every contender of medload.bench.peers
    extra_contenders: tuple[str, ...] = ()     # "module:function" or "file.py:function": your own loaders
    # scaling
    scaling: tuple[int, ...] = (1, 4, 16)
    scaling_workers: int = 2
    # user data (--data): at most this many series per loading benchmark
    user_max_series: int = 8
    # gpu
    gpu_steps: int = 20
    timeout: float = 1800.0


FULL = BenchConfig()
QUICK = BenchConfig(series_25d=3, slices_25d=16, series_3d=2, slices_3d=36, ingest_repeats=3, ingest_warmup=0,
                    workers_3d=(2,), warmup=2, batches=8, repeats=3, max_pass_s=1.0, scaling=(1, 4), user_max_series=3,
                    gpu_steps=10, timeout=300.0)
"""``--quick``: the same contenders on less data with fewer batches, 3D at 2 workers only, no ingest warm-up
run (the files were just written): under 3 minutes on a 2-core machine."""


def _say(progress: bool, text: str) -> None:
    if progress:
        from rich.console import Console

        Console(stderr=True, highlight=False).print(f"[dim]{text}[/dim]")


class _Clock:
    """Wall time of the named phases of a run (``results["timings_s"]``)."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings

    def __call__(self, name: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                clock.timings[name] = clock.timings.get(name, 0.0) + time.perf_counter() - self.t0

        return _Phase()


def _section(fn, *args, **kwargs) -> dict:
    """Run one section; a section that breaks is reported as failed, the suite goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        from medload.bench.peers import PeerUnavailable

        if isinstance(exc, PeerUnavailable):
            return {"status": "skipped", "reason": str(exc)}
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}


def _settings(cfg: BenchConfig, device: str):
    from medload.bench.loading import Settings

    return Settings(warmup=cfg.warmup, batches=cfg.batches, repeats=cfg.repeats, max_pass_s=cfg.max_pass_s,
                    device=device, batch_size=cfg.batch_size, timeout=cfg.timeout)


def _samples(cfg: BenchConfig) -> int:
    return (cfg.warmup + cfg.batches) * cfg.batch_size


# ---- the sections -----------------------------------------------------------------------------------
def _ingest_section(src: Path, work: Path, cfg: BenchConfig, progress: bool, label: str) -> dict:
    from medload.bench.ingest import run_ingest

    return run_ingest(src, work, repeats=cfg.ingest_repeats, warmup=cfg.ingest_warmup, timeout=cfg.timeout,
                      progress=progress, source=label)


def _loading_section(prep_fn, work: Path, cfg: BenchConfig, device: str, progress: bool, servers) -> tuple[dict, object]:
    from medload.bench.loading import run_loading
    from medload.bench.peers import CONTENDERS

    prep = prep_fn()
    contenders = tuple(cfg.contenders or CONTENDERS) + tuple(cfg.extra_contenders)
    workers = cfg.workers_3d if prep.kind == "3d" and cfg.workers_3d is not None else cfg.workers
    sec = run_loading(prep, work, contenders=contenders, workers=workers, settings=_settings(cfg, device),
                      progress=progress, servers=servers)
    return sec, prep


def _scaling_section(points: list[tuple[int, object]], work: Path, cfg: BenchConfig, device: str, progress: bool,
                     notes: list[str], servers) -> dict:
    """``points``: (number of series, a zero-argument function preparing its store), in growing order."""
    from medload.bench.common import tree_bytes
    from medload.bench.loading import run_loading

    rows = []
    for n, prep_fn in points:
        try:
            prep = prep_fn()
        except Exception as exc:
            rows.append({"series": n, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
            continue
        sec = run_loading(prep, work / f"n{n}", contenders=("medload",), workers=(cfg.scaling_workers,),
                          settings=_settings(cfg, device), progress=progress, label=f", {n} series",
                          servers=servers)
        row = dict(sec["rows"][0])
        row.update(series=n, slices=sum(s.depth for s in prep.series), store_mb=tree_bytes(prep.store) / 1e6)
        rows.append(row)
    first = next((r.get("samples_per_s") for r in rows if r.get("samples_per_s")), None)
    for r in rows:
        r["x_first"] = r["samples_per_s"] / first if first and r.get("samples_per_s") else None
    from medload.bench.peers import L1_BUDGET

    return {"status": "ok", "kind": "2.5d", "num_workers": cfg.scaling_workers, "l1": L1_BUDGET.replace("MB", " MB"),
            "samples_per_pass": _samples(cfg), "repeats": cfg.repeats, "batches": cfg.batches, "warmup": cfg.warmup,
            "notes": notes, "rows": rows}


def _gpu_section(prep, work: Path, cfg: BenchConfig, device: str) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device (torch.cuda.is_available() is False)"}
    if prep is None:
        return {"status": "skipped", "reason": "needs the 2.5D data of the loading section, which was not prepared"}
    work.mkdir(parents=True, exist_ok=True)
    prep_path = work / "prepared-gpu.json"
    prep.save(prep_path)
    out = work / "gpu.json"
    spec = {"out": str(out), "prep": str(prep_path), "device": device if device.startswith("cuda") else "cuda",
            "batch_size": cfg.batch_size, "num_workers": 2, "warmup": cfg.warmup, "steps": cfg.gpu_steps}
    try:
        proc = subprocess.run([sys.executable, "-m", "medload.bench.gpu", "--child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=cfg.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {cfg.timeout:g} s"}
    if not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"status": "failed", "error": tail[-1]}
    return json.loads(out.read_text())


def _targets(results: dict) -> list[dict]:
    from medload.bench.report import PSS_TARGET_MB

    out = []
    for sec in (results.get("loading") or {}).values():
        for r in sec.get("rows", []):
            if r["contender"] in sec.get("medload", ()) and r.get("num_workers") == 2 and r["status"] == "ok":
                out.append({"run": f"{sec['kind']} {r['contender']}, 2 workers", "peak_pss_mb": r["peak_pss_mb"],
                            "target_mb": PSS_TARGET_MB, "met": r["peak_pss_mb"] <= PSS_TARGET_MB})
    sc = results.get("scaling") or {}
    if sc.get("num_workers") == 2:
        for r in sc.get("rows", []):
            if r.get("status") == "ok":
                out.append({"run": f"scaling, {r['series']} series, 2 workers", "peak_pss_mb": r["peak_pss_mb"],
                            "target_mb": PSS_TARGET_MB, "met": r["peak_pss_mb"] <= PSS_TARGET_MB})
    return out


#: The loader's speed targets on 2.5D batches (8 x 3 x 512 x 512 in the full run), each read from one row
#: of the run: (contender, num_workers, field of the row, at least, what the field measures).
SPEED_TARGETS = (
    ("medload", 0, "x_npy_memmap", 2.5, "x npy memmap loader"),
    ("medload", 2, "x_npy_memmap", 3.0, "x npy memmap loader"),
    ("medload", 0, "pct_of_ceiling", 70.0, "% of ceiling_float32 (1 thread)"),
    ("medload", 2, "pct_of_ceiling", 70.0, "% of ceiling_float32 (2 threads)"),
    ("medload_int16", 0, "pct_of_ceiling", 70.0, "% of ceiling_int16 (1 thread): int16 passthrough"),
    ("medload_int16", 2, "pct_of_ceiling", 70.0, "% of ceiling_int16 (2 threads): int16 passthrough"),
)


def _speed_targets(results: dict) -> list[dict]:
    """:data:`SPEED_TARGETS` against the 2.5D rows of this run (``met`` None where a row is missing)."""
    sec = (results.get("loading") or {}).get("2.5d") or {}
    rows = {(r["contender"], r["num_workers"]): r for r in sec.get("rows", []) if r.get("threads") is None}
    out = []
    for name, workers, field, least, measure in SPEED_TARGETS:
        value = (rows.get((name, workers)) or {}).get(field)
        out.append({"run": f"2.5d {name}, {workers} workers, on {sec.get('device', '?')}", "field": field,
                    "measure": measure, "value": value, "target": least,
                    "met": None if value is None else value >= least})
    return out


def _command(quick: bool, data: Path | None, sections: Sequence[str], device: str) -> str:
    parts = ["medload bench"]
    if quick:
        parts.append("--quick")
    if data is not None:
        parts.append(f"--data {data}")
    if tuple(sections) != SECTIONS:
        parts.append(f"--sections {','.join(sections)}")
    if device != "cpu":
        parts.append(f"--device {device}")
    return " ".join(parts)


# ---- the run ------------------------------------------------------------------------------------------
def run_bench(*, quick: bool = False, json_out: Path | None = None, data: Path | None = None,
              plot: Path | None = None, sections: Sequence[str] = SECTIONS, device: str = "cpu",
              progress: bool = True, config: BenchConfig | None = None) -> dict:
    """Run the benchmark sections, print their tables, and return every figure printed (also written to
    ``json_out``; ``plot``: a PNG of samples/s per contender).

    Args:
        quick: less data and fewer batches (:data:`QUICK`; under 3 minutes on a 2-core machine).
        data: a folder of the user's DICOM to ingest and load instead of synthetic CT.
        sections: any of ``ingest``, ``loading``, ``scaling``, ``gpu`` (the last runs only where CUDA is
            available and is reported as skipped elsewhere).
        device: where loading batches must land (``cpu``, ``cuda``, ``cuda:1``).
        progress: progress bars and status lines on stderr.
        config: sizes and repeats (default :data:`FULL`, or :data:`QUICK` with ``quick``).

    Example:
        >>> results = run_bench(quick=True, json_out=Path("bench.json"), plot=Path("bench.png"))  # doctest: +SKIP

        ``results["loading"]["2.5d"]["rows"]`` then holds one dict per contender and ``num_workers``
        (samples/s median, min, max; peak PSS; ratios to every peer; medload's cache counters).
    """
    import torch
    from rich.console import Console

    from medload.bench.common import machine
    from medload.bench.report import plot as draw
    from medload.bench.report import print_tables, section_tables

    started = time.perf_counter()
    sections = tuple(dict.fromkeys(s.strip().lower() for s in sections if s.strip()))
    unknown = [s for s in sections if s not in SECTIONS + EXTRA_SECTIONS]
    if unknown or not sections:
        raise ConfigError(f"unknown benchmark sections {unknown or '(none)'}: choose from "
                          f"{', '.join(SECTIONS + EXTRA_SECTIONS)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device: use --device cpu, or "
                          "install a CUDA build of torch (see the README's set-up)")
    if data is not None and not Path(data).is_dir():
        raise ConfigError(f"--data {data}: not a folder of DICOM files")
    cfg = config or (QUICK if quick else FULL)
    if not cfg.workers or min(cfg.workers) < 0 or cfg.scaling_workers < 0:
        raise ConfigError(f"num_workers must be >= 0, got {cfg.workers} and {cfg.scaling_workers}")
    results: dict = {"config": {"command": _command(quick, data, sections, device), "quick": quick,
                                "sections": list(sections), "device": device,
                                "data": "synthetic CT" if data is None else str(data), "date": date.today().isoformat(),
                                "machine": machine(), "settings": asdict(cfg)}}
    key_env = os.environ.get("MEDLOAD_KEY_FILE")
    with tempfile.TemporaryDirectory(prefix="medload-bench-") as tmp:
        root = Path(tmp)
        os.environ["MEDLOAD_KEY_FILE"] = str(root / "bench.key")  # never the user's own key
        try:
            _run_sections(results, root, cfg, sections, data, device, progress)
        finally:
            if key_env is None:
                os.environ.pop("MEDLOAD_KEY_FILE", None)
            else:
                os.environ["MEDLOAD_KEY_FILE"] = key_env
    results["wall_s"] = time.perf_counter() - started
    console = Console(width=None if sys.stdout.isatty() else 250, highlight=False)
    print_tables(section_tables(results), console)
    if (results.get("autotune") or {}).get("status") == "ok":
        from medload.bench.autotune import autotune_table

        console.print(autotune_table(results["autotune"]))
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("timings_s", {}).items())
    console.print(f"wall time {results['wall_s']:.0f} s ({phases}): {results['config']['command']}", soft_wrap=True)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(results, indent=2, default=str))
    if plot is not None:
        try:
            results["plot"] = str(draw(results, plot))
        except ImportError as exc:
            results["plot"] = f"failed: {exc} (pip install matplotlib)"
        if json_out is not None:
            Path(json_out).write_text(json.dumps(results, indent=2, default=str))
    return results


def _run_sections(results: dict, root: Path, cfg: BenchConfig, sections: tuple[str, ...], data: Path | None,
                  device: str, progress: bool) -> None:
    from medload.bench.loading import Servers
    from medload.bench.loading_data import choose_series, ingest_into, make_synthetic, prepare_from, series_folders

    samples = _samples(cfg)
    key = Path(os.environ["MEDLOAD_KEY_FILE"])
    clock = _Clock(results.setdefault("timings_s", {}))
    need_25d = "loading" in sections or "gpu" in sections
    scaling_points = [n for n in cfg.scaling if n >= 1]
    prep_25d = None
    if data is None:
        n_pool = max([cfg.series_25d, *scaling_points]) if "scaling" in sections else cfg.series_25d
        gen = []
        if "ingest" in sections or need_25d or "scaling" in sections or "autotune" in sections:
            _say(progress, f"writing synthetic CT: {n_pool} series x {cfg.slices_25d} slices, "
                           f"{cfg.size_25d}x{cfg.size_25d}" + (f"; {cfg.series_3d} series x {cfg.slices_3d} slices, "
                                                               f"{cfg.size_3d}x{cfg.size_3d}"
                                                               if "loading" in sections else ""))
            kw = {"slices": cfg.slices_25d, "rows": cfg.size_25d, "cols": cfg.size_25d}
            with clock("synthetic data"):
                gen = make_synthetic(root / "dicom", series=cfg.series_25d, **kw)
                if n_pool > cfg.series_25d:
                    gen += make_synthetic(root / "dicom_extra", series=n_pool - cfg.series_25d, first=cfg.series_25d,
                                          **kw)
        folders = [g.paths[0].parent for g in gen]
        if "ingest" in sections:
            label = f"synthetic CT, {cfg.series_25d} series x {cfg.slices_25d} slices, {cfg.size_25d}x{cfg.size_25d}"
            with clock("ingest"):
                results["ingest"] = _section(_ingest_section, root / "dicom", root / "ingest", cfg, progress, label)

        def prep_25d_fn():
            return prepare_from(root / "l25", [root / "dicom"], samples=samples, kind="2.5d",
                                generated=gen[: cfg.series_25d], key_file=key)

        def prep_3d_fn():
            gen3 = make_synthetic(root / "dicom3d", series=cfg.series_3d, slices=cfg.slices_3d, rows=cfg.size_3d,
                                  cols=cfg.size_3d, seed=1000)
            return prepare_from(root / "l3d", [root / "dicom3d"], samples=samples, kind="3d", depth=cfg.depth_3d,
                                generated=gen3, key_file=key)

        def scaling_point(n: int):
            return lambda: prepare_from(root / f"scale{n}", folders[:n], samples=samples, kind="2.5d",
                                        generated=gen[:n], u8=False, npy=False, monai=False, key_file=key)

        points = [(n, scaling_point(n)) for n in scaling_points]
        notes = []
    else:
        data = Path(data)
        if "ingest" in sections:
            with clock("ingest"):
                results["ingest"] = _section(_ingest_section, data, root / "ingest", cfg, progress, str(data))
        stores = (root / "store", root / "store_u8")
        if need_25d or "scaling" in sections:
            _say(progress, f"ingesting {data} for the loading benchmarks")
            with clock("stores of the user's data"):
                ingest_into([data], stores[0], key)
                if "loading" in sections:
                    ingest_into([data], stores[1], key, windows=("soft_tissue",))

        def _stores():
            return stores[0], stores[1] if stores[1].exists() else None

        def prep_25d_fn():
            return prepare_from(root / "l25", [data], samples=samples, kind="2.5d", stores=_stores(),
                                max_series=cfg.user_max_series, key_file=key)

        def prep_3d_fn():
            return prepare_from(root / "l3d", [data], samples=samples, kind="3d", depth=cfg.depth_3d, stores=_stores(),
                                max_series=cfg.user_max_series, key_file=key)

        points, notes = [], []
        if "scaling" in sections:
            from medload.storage.store import open_store

            chosen, note = choose_series(open_store(stores[0], cache=0).series(), 3, max(scaling_points, default=1))
            folders_by_key, _ = series_folders(chosen, [data], root / "series") if chosen else ({}, None)
            usable = [folders_by_key[r.key] for r in chosen if r.key in folders_by_key]
            if note:
                notes.append(note)
            for n in scaling_points:
                if n > len(usable):
                    notes.append(f"{n} series: skipped, {data} has {len(usable)} usable series")
                    continue
                points.append((n, (lambda n=n: prepare_from(root / f"scale{n}", usable[:n], samples=samples,
                                                            kind="2.5d", u8=False, npy=False, monai=False,
                                                            key_file=key))))
    with Servers() as servers:
        if "loading" in sections:
            results["loading"] = {}
            for kind, fn in (("2.5d", prep_25d_fn), ("3d", prep_3d_fn)):
                _say(progress, f"preparing the {kind} loading data")
                with clock(f"loading {kind}"):
                    out = _section(_loading_section, fn, root / f"work-{kind}", cfg, device, progress, servers)
                if isinstance(out, tuple):
                    results["loading"][kind], prep = out
                    if kind == "2.5d":
                        prep_25d = prep
                else:
                    results["loading"][kind] = {**out, "kind": kind}
        if "scaling" in sections:
            _say(progress, "scaling: one store per size")
            with clock("scaling"):
                results["scaling"] = _section(_scaling_section, points, root / "work-scaling", cfg, device, progress,
                                              notes, servers)
    results["targets"] = _targets(results)
    if "loading" in results:
        results["speed_targets"] = _speed_targets(results)
    if "gpu" in sections:
        if prep_25d is None and need_25d:
            import torch

            if torch.cuda.is_available():
                prep_25d = _section(prep_25d_fn)
                prep_25d = None if isinstance(prep_25d, dict) else prep_25d
        with clock("gpu"):
            results["gpu"] = _section(_gpu_section, prep_25d, root / "work-gpu", cfg, device)
    if "autotune" in sections:
        from medload.bench.autotune import bench_section

        with clock("autotune"):
            results["autotune"] = _section(bench_section, root / "dicom" if data is None else Path(data),
                                           root / "work-autotune", key_file=key, quick=cfg is QUICK, device=device,
                                           timeout=cfg.timeout)


def readme_tables(results: dict) -> str:
    """The markdown tables of ``results`` for the README's results section (command, date, machine)."""
    from medload.bench.report import readme_tables as tables

    return tables(results)

"""``medload bench``: one command that builds the same data for every contender and prints tables of ratios.

Sections (each measured in this run, on this machine, against peers measured in the same run):

- ``ingest``: DICOM -> something a training job can read: medload ingest at 1 and N workers against
  bare pydicom read+decode, dcm2niix and SimpleITK's ImageSeriesReader, on 2,048 files (16 series x 128
  slices of 512 x 512; ``--quick``: the 2.5D set); files/s, MB/s, per core, ratios, and the size of the
  store against the DICOM (:mod:`medload.bench.ingest`).
- ``loading``: batches of windowed float32 on the device, 2.5D ``(8, 3, 512, 512)`` and 3D slabs
  ``(8, 1, 32, 256, 256)``, at ``num_workers`` 0 and 2: MONAI's LoadImaged / CacheDataset /
  PersistentDataset / LMDBDataset, .npy memmaps, the store's read ceilings and medload (256 MB L1);
  samples/s, peak PSS of the process tree, medload's L1 hit rate (:mod:`medload.bench.loading`,
  :mod:`medload.bench.peers`).
- ``scaling``: medload 2.5D samples/s and PSS at 2 workers, 256 MB L1, as the store grows from 1 to
  16 series: flat is the goal. Everything above fits in the L1: the next section is the archive case.
- ``scale``: a store far larger than the L1 (100 series x 128 slices of 512 x 512 by default: 3 GB, 12x
  the 256 MB L1), random 2.5D samples, page cache warm and cold: medload against .npy memmaps, zarr,
  HDF5, MONAI's CacheDataset + ThreadDataLoader and nnU-Net's loader; samples/s, MB read from disk per
  sample, L1 hit rate, peak PSS (:mod:`medload.bench.scale`). Always synthetic CT, even with ``data``.
- ``gpu`` (only with a CUDA device; otherwise reported as skipped): a MONAI 2D UNet (32-512 channels,
  bf16) trained on batches of 16 x 3 x 512 x 512 from medload (with and without BatchAugment), MONAI's
  CacheDataset, MONAI's GPU-cache recipe and per-file pydicom, page cache warm and cold: samples/s as a
  share of the same model on a resident batch, GPU busy time, the training thread's time in ``next()``
  (:mod:`medload.bench.gpu`).
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
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from medload.bench.sections import (
    Clock,
    gpu_section,
    guarded,
    ingest_section,
    loading_section,
    samples_per_pass,
    say,
    scale_section,
    scaling_section,
)
from medload.errors import ConfigError

__all__ = ["run_bench", "BenchConfig", "FULL", "QUICK", "SECTIONS", "readme_tables"]

SECTIONS = ("ingest", "loading", "scaling", "scale", "gpu")
EXTRA_SECTIONS = ("autotune", "patches")  # run only when named


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repeats of a benchmark run (``FULL`` and ``QUICK`` are the two ``medload bench`` uses)."""

    # synthetic data: one set of series for 2.5D (and ingest where its sizes are the same), 3D has its own
    series_25d: int = 8
    slices_25d: int = 64
    size_25d: int = 512
    series_3d: int = 4
    slices_3d: int = 96
    size_3d: int = 256
    depth_3d: int = 32
    # ingest: its own synthetic series where these differ from the 2.5D set's. The full run ingests the 2,048
    # files of the scaling issue's own measurement: at 512 each run's fixed costs (process starts, imports,
    # about 0.1 s of a 0.7 s ingest) hide what more workers gain
    ingest_series: int = 16
    ingest_slices: int = 128
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
    # scale: a store far larger than the L1, page cache warm and cold (medload.bench.scale)
    scale_series: int = 100
    scale_slices: int = 128
    scale_size: int = 512
    scale_warmup: int = 6
    scale_batches: int = 30
    scale_repeats: int = 3
    scale_max_pass_s: float = 10.0
    # gpu (medload.bench.gpu): its own synthetic series (of slices_25d x size_25d), batches, steps, workers
    gpu_series: int = 24
    gpu_batch_size: int = 16
    gpu_warmup: int = 8
    gpu_steps: int = 60
    gpu_workers: tuple[int | str, ...] = (4, "auto")
    # patches: 3D training patches from anisotropic oblique labelled series (medload.bench.patches)
    patch_series: int = 64
    patch_slices: int = 96
    patch_matrix: int = 384
    patch_edge: int = 128
    patch_spacing: float = 1.5
    patch_warmup: int = 2
    patch_batches: int = 10
    patch_repeats: int = 2
    timeout: float = 1800.0


FULL = BenchConfig()
QUICK = BenchConfig(series_25d=3, slices_25d=16, series_3d=2, slices_3d=36, ingest_series=3, ingest_slices=16,
                    ingest_repeats=3, ingest_warmup=0,
                    workers_3d=(2,), warmup=2, batches=8, repeats=3, max_pass_s=1.0, scaling=(1, 4), user_max_series=3,
                    scale_series=12, scale_slices=48, scale_warmup=4, scale_batches=6, scale_repeats=2,
                    scale_max_pass_s=2.0, gpu_series=16, gpu_warmup=4, gpu_steps=20, patch_series=3,
                    patch_slices=24, patch_matrix=96, patch_edge=48, patch_spacing=3.0, patch_warmup=1,
                    patch_batches=3, patch_repeats=1, timeout=300.0)
"""``--quick``: the same contenders on less data with fewer batches, 3D at 2 workers only, no ingest warm-up
run (the files were just written), a scale section on a store that is no larger than the L1 (a check
that it runs, not a measurement at scale): under 5 minutes on a 2-core machine."""


def _command(quick: bool, data: Path | None, sections: Sequence[str], device: str, cfg: BenchConfig) -> str:
    parts = ["medload bench"]
    if quick:
        parts.append("--quick")
    if "scale" in sections and cfg.scale_series != (QUICK if quick else FULL).scale_series:
        parts.append(f"--scale {cfg.scale_series}")
    if "patches" in sections and cfg.patch_series != (QUICK if quick else FULL).patch_series:
        parts.append(f"--patch-series {cfg.patch_series}")
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
              progress: bool = True, config: BenchConfig | None = None, scale_dir: Path | None = None) -> dict:
    """Run the benchmark sections, print their tables, and return every figure printed (also written to
    ``json_out``; ``plot``: a PNG of samples/s per contender).

    Args:
        quick: less data and fewer batches (:data:`QUICK`; under 3 minutes on a 2-core machine).
        data: a folder of the user's DICOM to ingest and load instead of synthetic CT.
        sections: any of ``ingest``, ``loading``, ``scaling``, ``scale``, ``gpu`` (the last runs only where
            CUDA is available and is reported as skipped elsewhere).
        device: where loading batches must land (``cpu``, ``cuda``, ``cuda:1``).
        progress: progress bars and status lines on stderr.
        config: sizes and repeats (default :data:`FULL`, or :data:`QUICK` with ``quick``).
        scale_dir: where the scale section keeps its data (about 30 GB for the default 100 series), to
            reuse them in a later run with the same sizes; default: a temporary folder, deleted after.

    Examples:
        >>> results = run_bench(quick=True, json_out=Path("bench.json"), plot=Path("bench.png"))  # doctest: +SKIP

        ``results["loading"]["2.5d"]["rows"]`` then holds one dict per contender and ``num_workers``
        (samples/s median, min, max; peak PSS; ratios to every peer; medload's cache counters).
    """
    import torch
    from rich.console import Console

    from medload.bench.common import machine
    from medload.bench.report import plot as draw
    from medload.bench.report import print_tables, section_tables
    from medload.deid import create_key

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
    results: dict = {"config": {"command": _command(quick, data, sections, device, cfg), "quick": quick,
                                "sections": list(sections), "device": device,
                                "data": "synthetic CT" if data is None else str(data), "date": date.today().isoformat(),
                                "machine": machine(), "settings": asdict(cfg)}}
    key_env = os.environ.get("MEDLOAD_KEY_FILE")
    with tempfile.TemporaryDirectory(prefix="medload-bench-") as tmp:
        root = Path(tmp)
        os.environ["MEDLOAD_KEY_FILE"] = str(create_key(root / "bench.key"))  # never the user's own key
        try:
            _run_sections(results, root, cfg, sections, data, device, progress, scale_dir)
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


@dataclass
class _Inputs:
    """What the loading and scaling sections read: how to prepare the 2.5D and 3D data, the scaling points
    (series count, how to prepare them) and notes on the points left out."""

    prep_25d: Callable
    prep_3d: Callable
    points: list[tuple[int, Callable]]
    notes: list[str]


def _run_sections(results: dict, root: Path, cfg: BenchConfig, sections: tuple[str, ...], data: Path | None,
                  device: str, progress: bool, scale_dir: Path | None) -> None:
    from medload.bench.targets import gpu_targets, memory_targets, scale_targets, speed_targets

    key = Path(os.environ["MEDLOAD_KEY_FILE"])
    clock = Clock(results, progress)
    if data is None:
        inputs = _synthetic_inputs(results, root, cfg, sections, progress, clock, key)
    else:
        inputs = _user_inputs(results, root, cfg, sections, Path(data), progress, clock, key)
    prep_25d = _loading_and_scaling(results, root, cfg, sections, inputs, device, progress, clock)
    if "scale" in sections:
        with clock("scale"):
            results["scale"] = guarded(scale_section, scale_dir or root / "scale", root / "work-scale", cfg, device,
                                        progress, key)
        if results["scale"].get("status") == "ok":
            results["scale_targets"] = scale_targets(results["scale"])
    if "patches" in sections:
        from medload.bench.sections import patches_section
        from medload.bench.targets import patch_targets

        with clock("patches"):
            results["patches"] = guarded(patches_section, root / "patches", root / "work-patches", cfg, device,
                                          progress, key)
        if results["patches"].get("status") == "ok":
            results["patch_targets"] = patch_targets(results["patches"])
    results["targets"] = memory_targets(results)
    if "loading" in results:
        results["speed_targets"] = speed_targets(results)
    if "gpu" in sections:
        with clock("gpu"):
            results["gpu"] = guarded(gpu_section, _gpu_data(root, cfg, data, key, prep_25d, inputs), root / "work-gpu",
                                     cfg, device)
        if results["gpu"].get("status") == "ok":
            results["gpu_targets"] = gpu_targets(results["gpu"])
    if "autotune" in sections:
        from medload.bench.autotune import bench_section

        with clock("autotune"):
            results["autotune"] = guarded(bench_section, root / "dicom" if data is None else Path(data),
                                           root / "work-autotune", key_file=key, quick=results["config"]["quick"], device=device,
                                           timeout=cfg.timeout)


def _gpu_data(root: Path, cfg: BenchConfig, data: Path | None, key: Path, prep_25d, inputs: _Inputs) -> Callable:
    """How the GPU section gets its data: synthetic series of its own, or the user's 2.5D loading data."""
    from medload.bench.sections import gpu_settings

    if data is not None:
        return (lambda: prep_25d) if prep_25d is not None else inputs.prep_25d

    def synthetic():
        from medload.bench.gpu import gpu_data

        return gpu_data(root / "gpu", series=cfg.gpu_series, slices=cfg.slices_25d, size=cfg.size_25d,
                        samples=gpu_settings(cfg).samples, key_file=key)

    return synthetic


def _synthetic_inputs(results: dict, root: Path, cfg: BenchConfig, sections: tuple[str, ...], progress: bool,
                      clock: Clock, key: Path) -> _Inputs:
    """Synthetic CT for the sections (and the ingest section on it)."""
    from medload.bench.loading_data import make_synthetic, prepare_from, write_synthetic

    samples = samples_per_pass(cfg)
    scaling_points = [n for n in cfg.scaling if n >= 1]
    n_pool = max([cfg.series_25d, *scaling_points]) if "scaling" in sections else cfg.series_25d
    gen = []
    own_ingest_set = (cfg.ingest_series, cfg.ingest_slices) != (cfg.series_25d, cfg.slices_25d)
    if {"loading", "scaling", "autotune"} & set(sections) or ("ingest" in sections and not own_ingest_set):
        say(progress, f"writing synthetic CT: {n_pool} series x {cfg.slices_25d} slices, "
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
        src = root / "dicom"
        if own_ingest_set:
            say(progress, f"writing synthetic CT to ingest: {cfg.ingest_series} series x {cfg.ingest_slices} slices")
            src = root / "dicom_ingest"
            with clock("synthetic data to ingest"):
                write_synthetic(src, series=cfg.ingest_series, slices=cfg.ingest_slices, rows=cfg.size_25d,
                                cols=cfg.size_25d, seed=2000)
        label = f"synthetic CT, {cfg.ingest_series} series x {cfg.ingest_slices} slices, {cfg.size_25d}x{cfg.size_25d}"
        with clock("ingest"):
            results["ingest"] = guarded(ingest_section, src, root / "ingest", cfg, progress, label)
            shutil.rmtree(root / "dicom_ingest", ignore_errors=True)

    def prep_25d():
        return prepare_from(root / "l25", [root / "dicom"], samples=samples, kind="2.5d",
                            generated=gen[: cfg.series_25d], key_file=key)

    def prep_3d():
        gen3 = make_synthetic(root / "dicom3d", series=cfg.series_3d, slices=cfg.slices_3d, rows=cfg.size_3d,
                              cols=cfg.size_3d, seed=1000)
        return prepare_from(root / "l3d", [root / "dicom3d"], samples=samples, kind="3d", depth=cfg.depth_3d,
                            generated=gen3, key_file=key)

    def scaling_point(n: int):
        return lambda: prepare_from(root / f"scale{n}", folders[:n], samples=samples, kind="2.5d",
                                    generated=gen[:n], u8=False, npy=False, monai=False, key_file=key)

    return _Inputs(prep_25d, prep_3d, [(n, scaling_point(n)) for n in scaling_points], [])


def _user_inputs(results: dict, root: Path, cfg: BenchConfig, sections: tuple[str, ...], data: Path, progress: bool,
                 clock: Clock, key: Path) -> _Inputs:
    """The user's DICOM under ``data`` for the sections (and the ingest section on it)."""
    from medload.bench.loading_data import choose_series, ingest_into, prepare_from, series_folders

    samples = samples_per_pass(cfg)
    scaling_points = [n for n in cfg.scaling if n >= 1]
    if "ingest" in sections:
        with clock("ingest"):
            results["ingest"] = guarded(ingest_section, data, root / "ingest", cfg, progress, str(data))
    stores = (root / "store", root / "store_u8")
    if {"loading", "gpu", "scaling"} & set(sections):
        say(progress, f"ingesting {data} for the loading benchmarks")
        with clock("stores of the user's data"):
            ingest_into([data], stores[0], key)
            if "loading" in sections:
                ingest_into([data], stores[1], key, windows=("soft_tissue",))

    def _stores():
        return stores[0], stores[1] if stores[1].exists() else None

    def prep_25d():
        return prepare_from(root / "l25", [data], samples=samples, kind="2.5d", stores=_stores(),
                            max_series=cfg.user_max_series, key_file=key)

    def prep_3d():
        return prepare_from(root / "l3d", [data], samples=samples, kind="3d", depth=cfg.depth_3d, stores=_stores(),
                            max_series=cfg.user_max_series, key_file=key)

    inputs = _Inputs(prep_25d, prep_3d, [], [])
    if "scaling" not in sections:
        return inputs
    from medload.storage.store import open_store

    chosen, note = choose_series(open_store(stores[0], cache=0).series(), 3, max(scaling_points, default=1))
    folders_by_key, _ = series_folders(chosen, [data], root / "series") if chosen else ({}, None)
    usable = [folders_by_key[r.key] for r in chosen if r.key in folders_by_key]
    if note:
        inputs.notes.append(note)
    for n in scaling_points:
        if n > len(usable):
            inputs.notes.append(f"{n} series: skipped, {data} has {len(usable)} usable series")
            continue
        inputs.points.append((n, (lambda n=n: prepare_from(root / f"scale{n}", usable[:n], samples=samples,
                                                            kind="2.5d", u8=False, npy=False, monai=False,
                                                            key_file=key))))
    return inputs


def _loading_and_scaling(results: dict, root: Path, cfg: BenchConfig, sections: tuple[str, ...], inputs: _Inputs,
                         device: str, progress: bool, clock: Clock):
    """The loading and scaling sections (with their peers' servers); the 2.5D data the loading section
    prepared, for the GPU section, or None."""
    from medload.bench.loading import Servers

    prep_25d = None
    with Servers() as servers:
        if "loading" in sections:
            results["loading"] = {}
            for kind, fn in (("2.5d", inputs.prep_25d), ("3d", inputs.prep_3d)):
                say(progress, f"preparing the {kind} loading data")
                with clock(f"loading {kind}"):
                    out = guarded(loading_section, fn, root / f"work-{kind}", cfg, device, progress, servers)
                if isinstance(out, tuple):
                    results["loading"][kind], prep = out
                    if kind == "2.5d":
                        prep_25d = prep
                else:
                    results["loading"][kind] = {**out, "kind": kind}
        if "scaling" in sections:
            say(progress, "scaling: one store per size")
            with clock("scaling"):
                results["scaling"] = guarded(scaling_section, inputs.points, root / "work-scaling", cfg, device,
                                              progress, inputs.notes, servers)
    return prep_25d


def readme_tables(results: dict) -> str:
    """The markdown tables of ``results`` for the README's results section (command, date, machine)."""
    from medload.bench.report import readme_tables as tables

    return tables(results)

"""The sections of ``medload bench`` (:mod:`medload.bench.run` runs them): each prepares what it needs,
measures, and returns its results as a dict; a section that breaks is reported, never raised."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from medload.bench.loading_data import Prepared
    from medload.bench.run import BenchConfig

__all__ = ["say", "Clock", "guarded", "loading_settings", "samples_per_pass", "ingest_section", "loading_section",
           "scaling_section", "scale_section", "patches_section", "gpu_settings", "gpu_section"]


def say(progress: bool, text: str) -> None:
    if progress:
        from rich.console import Console

        Console(stderr=True, highlight=False).print(f"[dim]{text}[/dim]")


class Clock:
    """Wall time of the named phases of a run (``results["timings_s"]``), and the share of the CPUs other
    processes used during each (``results["others_cpu"]``; a warning in ``results["busy"]`` past
    :data:`~medload.bench.common.BUSY_SHARE`)."""

    def __init__(self, results: dict, progress: bool) -> None:
        self.progress = progress
        self.timings = results.setdefault("timings_s", {})
        self.others = results.setdefault("others_cpu", {})
        self.busy = results.setdefault("busy", [])

    @contextmanager
    def __call__(self, name: str):
        from medload.bench.common import OtherLoad, load_note

        t0 = time.perf_counter()
        with OtherLoad() as watch:
            yield
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
        self.others[name] = watch.share
        note = load_note(name, watch.share)
        if note is not None:
            self.busy.append(note)
            say(self.progress, f"warning: {note}")


def guarded(fn, *args, **kwargs) -> dict:
    """Run one section; a section that breaks is reported as failed, the suite goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        from medload.bench.peers import PeerUnavailable

        if isinstance(exc, PeerUnavailable):
            return {"status": "skipped", "reason": str(exc)}
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}


def loading_settings(cfg: BenchConfig, device: str):
    from medload.bench.loading import Settings

    return Settings(warmup=cfg.warmup, batches=cfg.batches, repeats=cfg.repeats, max_pass_s=cfg.max_pass_s,
                    device=device, batch_size=cfg.batch_size, timeout=cfg.timeout)


def samples_per_pass(cfg: BenchConfig) -> int:
    return (cfg.warmup + cfg.batches) * cfg.batch_size


# ---- the sections -----------------------------------------------------------------------------------
def ingest_section(src: Path, work: Path, cfg: BenchConfig, progress: bool, label: str) -> dict:
    from medload.bench.ingest import run_ingest

    return run_ingest(src, work, repeats=cfg.ingest_repeats, warmup=cfg.ingest_warmup, timeout=cfg.timeout,
                      progress=progress, source=label)


def loading_section(prep_fn, work: Path, cfg: BenchConfig, device: str, progress: bool, servers) -> tuple[dict, object]:
    from medload.bench.loading import run_loading
    from medload.bench.peers import CONTENDERS

    prep = prep_fn()
    contenders = tuple(cfg.contenders or CONTENDERS) + tuple(cfg.extra_contenders)
    workers = cfg.workers_3d if prep.kind == "3d" and cfg.workers_3d is not None else cfg.workers
    sec = run_loading(prep, work, contenders=contenders, workers=workers, settings=loading_settings(cfg, device),
                      progress=progress, servers=servers)
    return sec, prep


def scaling_section(points: list[tuple[int, Callable[[], Prepared]]], work: Path, cfg: BenchConfig, device: str,
                    progress: bool, notes: list[str], servers) -> dict:
    """``points``: (number of series, a zero-argument function preparing its store), in growing order."""
    from medload.bench.common import tree_bytes
    from medload.bench.loading import run_loading

    rows: list[dict[str, Any]] = []
    for n, prep_fn in points:
        try:
            prep = prep_fn()
        except Exception as exc:
            rows.append({"series": n, "status": "failed", "error": f"{type(exc).__name__}: {exc}"})
            continue
        sec = run_loading(prep, work / f"n{n}", contenders=("medload",), workers=(cfg.scaling_workers,),
                          settings=loading_settings(cfg, device), progress=progress, label=f", {n} series",
                          servers=servers)
        row = dict(sec["rows"][0])
        row.update(series=n, slices=sum(s.depth for s in prep.series), store_mb=tree_bytes(prep.store) / 1e6)
        rows.append(row)
    first = next((r.get("samples_per_s") for r in rows if r.get("samples_per_s")), None)
    for r in rows:
        r["x_first"] = r["samples_per_s"] / first if first and r.get("samples_per_s") else None
    from medload.bench.peers import L1_BUDGET

    return {"status": "ok", "kind": "2.5d", "num_workers": cfg.scaling_workers, "l1": L1_BUDGET.replace("MB", " MB"),
            "samples_per_pass": samples_per_pass(cfg), "repeats": cfg.repeats, "batches": cfg.batches, "warmup": cfg.warmup,
            "notes": notes, "rows": rows}


def scale_section(root: Path, work: Path, cfg: BenchConfig, device: str, progress: bool, key: Path) -> dict:
    from medload.bench.scale import ScaleSettings, run_scale

    settings = ScaleSettings(series=cfg.scale_series, slices=cfg.scale_slices, size=cfg.scale_size,
                             workers=tuple(cfg.workers),
                             warmup=cfg.scale_warmup, batches=cfg.scale_batches, repeats=cfg.scale_repeats,
                             max_pass_s=cfg.scale_max_pass_s, batch_size=cfg.batch_size, timeout=cfg.timeout)
    say(progress, f"scale: {settings.series} series x {settings.slices} slices of {settings.size}x{settings.size} "
                   f"under {root} (kept for the next run there)" if root.exists() else
                   f"scale: writing {settings.series} series x {settings.slices} slices and their peers' formats")
    return run_scale(root, work, settings, key_file=key, device=device, progress=progress)


def patches_section(root: Path, work: Path, cfg: BenchConfig, device: str, progress: bool, key: Path) -> dict:
    """3D patches against nnU-Net's and MONAI's loaders (:mod:`medload.bench.patches`); with CUDA on
    ``device``, also the training rows of its GPU variant."""
    from medload.bench.patches import run_patches
    from medload.bench.patches_data import PatchSettings

    edge = cfg.patch_edge
    settings = PatchSettings(series=cfg.patch_series, slices=cfg.patch_slices, size=cfg.patch_matrix,
                             patch=(edge, edge, edge), spacing=cfg.patch_spacing, workers=tuple(cfg.workers),
                             warmup=cfg.patch_warmup, batches=cfg.patch_batches, repeats=cfg.patch_repeats,
                             timeout=cfg.timeout, train=device.startswith("cuda"), train_steps=cfg.gpu_steps)
    say(progress, f"patches: {settings.series} series x {settings.slices} slices of {settings.size}x{settings.size}, "
                   f"batches of {settings.batch_size} x {edge}^3 at {settings.spacing:g} mm")
    return run_patches(root, work, settings, key_file=key, device=device, progress=progress)


def gpu_settings(cfg: BenchConfig):
    """The GPU section's settings from a run's :class:`~medload.bench.run.BenchConfig`."""
    from medload.bench.gpu import GpuSettings

    return GpuSettings(batch_size=cfg.gpu_batch_size, steps=cfg.gpu_steps, warmup=cfg.gpu_warmup,
                       workers=tuple(cfg.gpu_workers))


def gpu_section(prep_fn: Callable[[], Prepared], work: Path, cfg: BenchConfig, device: str) -> dict:
    """The GPU section (:mod:`medload.bench.gpu`) in a fresh process, on the data ``prep_fn`` prepares."""
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device (torch.cuda.is_available() is False)"}
    prep = prep_fn()
    work.mkdir(parents=True, exist_ok=True)
    prep_path = work / "prepared-gpu.json"
    prep.save(prep_path)
    out = work / "gpu.json"
    spec = {"out": str(out), "prep": str(prep_path), "device": device if device.startswith("cuda") else "cuda",
            "settings": dataclasses.asdict(gpu_settings(cfg))}
    try:
        proc = subprocess.run([sys.executable, "-m", "medload.bench.gpu", "--child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=cfg.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {cfg.timeout:g} s"}
    if not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"status": "failed", "error": tail[-1]}
    return json.loads(out.read_text())

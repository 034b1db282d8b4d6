"""``num_workers="auto"`` against a small grid of hand-picked settings, measured in one run.

Each setting is measured in a fresh process (``python -m medload.bench.autotune --child SPEC``): open
the store, build a 2.5D :class:`~medload.data.SliceDataset` loader (``window="soft_tissue"``, no
model step, so the loader's own pace), read ``warmup`` batches (default: one epoch, so every setting is
timed in its steady state -- the auto run's own measurement has already filled the trainer's L1 cache),
then time ``batches`` batches (several epochs if need be: persistent workers keep their caches); the
median of ``repeats`` runs with min-max,
the settings taking turns (so load from other processes falls on all of them alike).
The grid is ``num_workers`` 0, 1, 2 x ``prefetch_factor`` 2, 4 (0 workers has no prefetch, so it is
one setting). The auto run's own measurement (``tune_s``) is reported, not timed.

    python -m medload.bench.autotune STORE [--batch-size 8] [--batches 60] [--repeats 3]
    medload bench --sections autotune [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter

from medload.bench.common import machine, spread

__all__ = ["run_autotune", "autotune_table", "GRID"]

GRID = ((0, 2), (1, 2), (1, 4), (2, 2), (2, 4))
"""(num_workers, prefetch_factor) of the grid; prefetch means nothing without workers."""


def _child(spec: dict) -> dict:
    """One timed run (in a fresh process): samples/s of a loader with the given (or auto) settings."""
    from medload.allocator import keep_large_buffers_in_heap
    from medload.data import SliceDataset, make_loader
    from medload.storage.store import open_store

    keep_large_buffers_in_heap()  # as in the medload command: the same allocator for every setting
    dataset = SliceDataset(open_store(spec["store"]), context=spec["context"])
    t0 = perf_counter()
    loader = make_loader(dataset, spec["batch_size"], spec["num_workers"], spec["device"], window="soft_tissue", shuffle=True,
                         prefetch_factor=spec["prefetch_factor"], drop_last=True)
    tune_s = perf_counter() - t0 if spec["num_workers"] == "auto" else None
    warmup = len(loader) if spec["warmup"] is None else spec["warmup"]
    seen, samples, started = 0, 0, perf_counter()
    while seen < warmup + spec["batches"]:
        for batch in loader:
            seen += 1
            if seen == warmup:
                started = perf_counter()
            elif seen > warmup:
                samples += batch["image"].shape[0]
            if seen == warmup + spec["batches"]:
                break
    elapsed = perf_counter() - started
    tuning = loader.tuning.to_dict() if loader.tuning is not None else None
    return {"samples_per_s": samples / elapsed, "tune_s": tune_s, "tuning": tuning,
            "num_workers": loader.loader.num_workers, "prefetch_factor": loader.loader.prefetch_factor or 0}


def _measure(spec: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "medload.bench.autotune", "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise RuntimeError(tail[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_autotune(store: str | Path, *, batch_size: int = 8, context: int = 1, warmup: int | None = None,
                 batches: int = 60, repeats: int = 3, device: str = "cpu", grid: Sequence[tuple[int, int]] = GRID,
                 timeout: float = 600.0) -> dict:
    """Samples/s of ``num_workers="auto"`` and of each grid setting on ``store``; ``auto_vs_best`` is the
    auto median over the best grid median.

    Examples:
        >>> sec = run_autotune("stores/sample", batches=20)        # doctest: +SKIP
        >>> sec["auto_vs_best"] >= 0.8   # doctest: +SKIP
        True
    """
    base = {"store": str(store), "batch_size": batch_size, "context": context, "warmup": warmup, "batches": batches,
            "device": device}
    settings = [("auto", None), *grid]
    runs_of: dict[int, list[dict]] = {i: [] for i in range(len(settings))}
    for _ in range(repeats):  # round robin: other load on the machine falls on every setting alike
        for i, (workers, prefetch) in enumerate(settings):
            runs_of[i].append(_measure({**base, "num_workers": workers, "prefetch_factor": prefetch}, timeout))
    rows = []
    for i, (workers, prefetch) in enumerate(settings):
        runs = runs_of[i]
        rates = [r["samples_per_s"] for r in runs]
        last = runs[-1]
        rows.append({"setting": "auto" if workers == "auto" else f"{workers} workers, prefetch {prefetch}"
                     if workers else "0 workers", "num_workers": last["num_workers"],
                     "prefetch_factor": last["prefetch_factor"], "samples_per_s": spread(rates),
                     "chosen": [f"{r['num_workers']} workers, prefetch {r['prefetch_factor']}" if r["num_workers"]
                                else "0 workers" for r in runs] if workers == "auto" else None,
                     "tune_s": spread([r["tune_s"] for r in runs]) if workers == "auto" else None,
                     "reason": last["tuning"]["reason"] if last["tuning"] else None})
    best = max(rows[1:], key=lambda r: r["samples_per_s"]["median"])
    ratio = rows[0]["samples_per_s"]["median"] / best["samples_per_s"]["median"]
    return {"status": "ok", "store": str(store), "batch_size": batch_size, "context": context, "batches": batches,
            "warmup": warmup, "repeats": repeats, "device": device, "machine": machine(), "rows": rows,
            "best_grid": best["setting"], "auto_vs_best": ratio, "within_20pct": ratio >= 0.8}


def autotune_table(section: dict):
    """A rich Table of :func:`run_autotune`'s result."""
    from rich.table import Table

    table = Table(title=f"num_workers=\"auto\" vs a grid: 2.5D batches of {section['batch_size']} on "
                        f"{section['device']}, {section['batches']} batches x {section['repeats']} runs",
                  caption=f"auto / best grid ({section['best_grid']}): {section['auto_vs_best']:.2f}")
    for name in ("setting", "samples/s (median)", "min-max", "chosen"):
        table.add_column(name, justify="left" if name in ("setting", "chosen") else "right")
    for r in section["rows"]:
        s = r["samples_per_s"]
        chosen = ", ".join(sorted(set(r["chosen"]))) if r["chosen"] else ""
        table.add_row(r["setting"], f"{s['median']:.1f}", f"{s['min']:.1f}-{s['max']:.1f}", chosen,
                      style="bold" if r["setting"] in ("auto", section["best_grid"]) else None)
    return table


def bench_section(src: Path, root: Path, *, key_file: Path, quick: bool, device: str, timeout: float) -> dict:
    """The ``autotune`` section of ``medload bench``: ingest ``src`` into a store under ``root``, then
    :func:`run_autotune` on it."""
    from medload.bench.loading_data import ingest_into

    root.mkdir(parents=True, exist_ok=True)
    store = root / "autotune-store"
    ingest_into([src], store, key_file)
    return run_autotune(store, batches=20 if quick else 60, device=device, timeout=timeout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=1)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=None, help="batches before timing (default: one epoch)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    if args.store is None:
        ap.error("give a STORE")
    from rich.console import Console

    section = run_autotune(args.store, batch_size=args.batch_size, context=args.context, warmup=args.warmup,
                           batches=args.batches, repeats=args.repeats, device=args.device)
    Console(width=None if sys.stdout.isatty() else 200).print(autotune_table(section))
    for r in section["rows"][:1]:
        print(f"auto's reason (last run): {r['reason']}")
    if args.json is not None:
        args.json.write_text(json.dumps(section, indent=2))


if __name__ == "__main__":
    main()

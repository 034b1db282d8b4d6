"""What exact mid-epoch resume costs a loader: samples/s with and without saving its state after every batch,
in the same run, and the time of one ``state_dict()`` / ``load_state_dict()``.

Usage: python benchmarks/resume_state.py [--epochs 3] [--workers 2]

Ingests sixteen synthetic CT series (patients) of 16 slices of 256 x 256 into a temporary store and loads 2.5D batches
of 8 x 3 x 256 x 256 (soft-tissue window, BatchAugment) with ``--workers`` workers on the CPU. Each repeat
times one epoch plain and one epoch that also takes ``loader.state_dict()`` and serialises it to JSON after
every batch (what a checkpoint every step would keep), alternating, so load on the machine hits both alike;
the medians are printed. Then: a state's size, and the time to take one and to restore one (the restore of
a DistributedPatientSampler loader saved on 8 ranks onto 6, which replays every rank's consumed batches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from medload.config import IngestConfig
from medload.data import BatchAugment, DistributedPatientSampler, SliceDataset, make_loader
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

BATCH = 8


def build(root: Path) -> Path:
    for p in range(16):
        make_series(root / "src" / f"p{p}", SeriesSpec(n_slices=16, rows=256, cols=256), seed=p, patient_id=f"B-{p}")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


def epoch_rate(loader, epoch: int, save: bool) -> float:
    """Samples/s of one epoch; with ``save``, the state taken and serialised after every batch."""
    loader.set_epoch(epoch)
    samples, start = 0, time.perf_counter()
    for batch in loader:
        samples += len(batch["index"])
        if save:
            json.dumps(loader.state_dict())
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="repeats of each mode (default 3)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ds = SliceDataset(open_store(build(Path(tmp))), context=1)
        loader = make_loader(ds, BATCH, args.workers, window="soft_tissue", shuffle=True, seed=0,
                             augment=BatchAugment(seed=0), persistent_workers=True)
        epoch_rate(loader, 0, False)  # warm-up: workers start, caches fill
        plain, saving = [], []
        for e in range(args.epochs):
            plain.append(epoch_rate(loader, 2 * e + 1, False))
            saving.append(epoch_rate(loader, 2 * e + 2, True))
        state = loader.state_dict()
        start = time.perf_counter()
        for _ in range(1000):
            loader.state_dict()
        take_us = (time.perf_counter() - start) * 1e3

        def distributed(rank: int, world: int):
            sampler = DistributedPatientSampler.from_dataset(ds, rank=rank, world_size=world, seed=0)
            return make_loader(ds, BATCH, 0, sampler=sampler, window="soft_tissue")

        saved = distributed(0, 8)
        saved.set_epoch(1)
        batches = iter(saved)
        next(batches)
        next(batches)
        elastic = saved.state_dict()
        target = distributed(0, 6)
        start = time.perf_counter()
        target.load_state_dict(elastic)
        restore_ms = (time.perf_counter() - start) * 1e3
    print(f"{len(ds)} samples, batches of {BATCH}, {args.workers} workers, {args.epochs} epochs each (median)")
    print(f"without saving the state: {statistics.median(plain):8.1f} samples/s  {[round(r) for r in plain]}")
    print(f"state saved every batch:  {statistics.median(saving):8.1f} samples/s  {[round(r) for r in saving]}")
    print(f"state: {len(json.dumps(state))} bytes of JSON; state_dict() {take_us:.1f} us; elastic restore 8 -> 6 "
          f"ranks {restore_ms:.1f} ms")


if __name__ == "__main__":
    main()

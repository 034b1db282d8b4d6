"""How batches cross from a loader's workers to the trainer: the slice loader's shared slots, and the 3D
patch loader through /dev/shm or through its workers' pipes (the fallback where /dev/shm is too small).

Usage: PYTHONPATH=. python benchmarks/loader_transfer.py STORE [--workers 2] [--epochs 3] [--side 96]

Each loader runs ``--epochs`` epochs on the CPU; the first is a warm-up, the others are timed and printed:
the slice loader (2.5D, 3 slices, batches of 8, soft_tissue window) in samples/s, then the patch loader
(``--side``^3 patches at the series' own spacing, batches of 2, 64 a epoch) in patches/s, once as
``make_loader`` chooses (through /dev/shm where the batches in flight fit) and once with the pipes forced.
Run it with ``PYTHONPATH`` set to two checkouts, alternating, to compare them.
"""

from __future__ import annotations

import argparse
import time

import medload
import medload.data.patch_loader as patch_loader
from medload.data import PatchDataset, SliceDataset, make_loader


def _epochs(loader, epochs: int) -> list[float]:
    """Items per second of each epoch after the first."""
    rates = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for batch in loader:
            n += batch["image"].shape[0]
        if epoch:
            rates.append(n / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--side", type=int, default=96)
    args = ap.parse_args()
    store = medload.open_store(args.store)
    slices = make_loader(SliceDataset(store, context=1), batch_size=8, window="soft_tissue", shuffle=True, seed=0,
                         num_workers=args.workers)
    print("slice loader:", ", ".join(f"{r:,.0f}" for r in _epochs(slices, args.epochs)), "samples/s")
    side = args.side
    for label in ("as chosen", "pipes forced"):
        if label == "pipes forced":
            patch_loader.batches_in_flight_fit = lambda batch_bytes, batches: False
        patches = make_loader(PatchDataset(store, patch=(side, side, side), samples_per_epoch=64, seed=0),
                              batch_size=2, num_workers=args.workers)
        print(f"patch loader ({label}):", ", ".join(f"{r:.1f}" for r in _epochs(patches, args.epochs)), "patches/s")


if __name__ == "__main__":
    main()

"""One patch worker's cost per batch: ``_PatchCrops.__getitems__`` (read the boxes, resample on the CPU)
on a store made by ``medload bench --sections patches`` (its ``store`` folder), torch on one thread as
in a DataLoader worker, the section's settings and augmentation; optionally cProfile's top entries.

    PYTHONPATH=. python benchmarks/patch_worker.py STORE [--batches 20] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from medload.bench.patches_data import PatchSettings
from medload.bench.patches_peers import medload_augmentation
from medload.data import PatchDataset
from medload.data.patch_loader import _PatchBatch, _PatchCrops
from medload.storage.store import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    s = PatchSettings()
    ds = PatchDataset(open_store(args.store), s.patch, (s.spacing,) * 3, "RAS", foreground=s.foreground,
                      samples_per_epoch=2 * (args.batches + 3), seed=0, labels=True)
    crops = _PatchCrops(ds, medload_augmentation(), resample=True)
    batches = [_PatchBatch([2 * b, 2 * b + 1], 0) for b in range(args.batches + 3)]
    for b in batches[:3]:  # warm-up: the first reads open the shards
        crops.__getitems__(b)
    profile = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    for b in batches[3:]:
        crops.__getitems__(b)
    if profile:
        profile.disable()
    print(f"{(time.perf_counter() - t0) / args.batches * 1e3:.1f} ms per batch of {s.batch_size} x {s.patch}")
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()

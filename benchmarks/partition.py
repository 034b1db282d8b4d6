"""Rank partition figures (README, "Training input"): balance, shards per rank and time of ``assign_ranks``.

Usage: python benchmarks/partition.py

Simulated archives, seeded: 2,000 patients of 1-3 series of 100-600 slices in ~81 shards (16 ranks);
the same with lognormal slice counts and four patients 40 times larger (2-16 ranks), against the
locality cut alone; and 10 million samples (one per slice) of 20,000 patients, timed.
"""

from __future__ import annotations

import time

import numpy as np

from medload.data.distributed import _cut, _patient_loads, _sequence, assign_ranks


def report(name: str, patients, shards, slices, world: int) -> None:
    t = time.perf_counter()
    ranks = assign_ranks(patients, world, seed=0, shards=shards, weights=slices)
    seconds = time.perf_counter() - t
    loads = np.bincount(ranks, weights=slices, minlength=world)
    _, _, home, load = _patient_loads(patients, shards, slices)
    cut = np.bincount(_cut(load, _sequence(home, 0), world), weights=load, minlength=world)
    per = [np.unique(shards[ranks == r]).size for r in range(world)]
    print(f"{name}: {world} ranks, cost spread {100 * (loads.max() - loads.min()) / loads.mean():.2f}% of the mean "
          f"(max/min {loads.max() / loads.min():.4f}; the cut alone {cut.max() / cut.min():.4f}), "
          f"{min(per)}-{max(per)} of {np.unique(shards).size} shards per rank, {seconds:.2f} s for {patients.size} "
          "entries")


def main() -> None:
    rng = np.random.default_rng(0)
    n_series = rng.integers(1, 4, 2000)
    patients = np.repeat(np.arange(2000), n_series)
    slices = rng.integers(100, 601, patients.size)
    report("uniform series", patients, np.cumsum(slices) // (np.sum(slices) // 81 + 1), slices, 16)
    skewed = np.maximum(1, np.round(rng.lognormal(5.5, 1.0, patients.size))).astype(np.int64)
    skewed[rng.choice(patients.size, 4, replace=False)] *= 40
    for world in (2, 4, 8, 16):
        report("skewed series", patients, np.cumsum(skewed) // (np.sum(skewed) // 81 + 1), skewed, world)
    many = np.repeat(np.arange(20000), rng.integers(200, 800, 20000))[:10_000_000].astype(np.int32)
    report("10M samples", many, (many // 250).astype(np.int32), None, 16)


if __name__ == "__main__":
    main()

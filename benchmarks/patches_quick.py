"""3D patches per second from PatchDataset -- ``ds[i]`` through a plain DataLoader, and the fast path
``make_loader(ds)`` -- and the bytes read and decoded per patch voxel.

Usage: python benchmarks/patches_quick.py [--patches 64] [--l1 0|256MB] [--size 256|512] [--slices 100]

Ingests one synthetic CT series of ``size`` x ``size`` x ``slices`` at 0.7 x 0.7 x 2.5 mm with a bone label
(> 300 HU) into a temporary store, then times batches of 2 patches of 96^3 at 1.5 mm (RAS, a third on the
label) with 0 and 2 workers (the first batch, worker start-up included, is left out). Read amplification:
the image and label bytes ``store.read``/``read_label`` return per patch (whole slices of the range the
patch reaches) over the patch's voxels. ``--l1 0`` turns the in-process slice cache off, so every one of
those bytes is decoded. ``--size 512`` adds, measured through ``Store.observe`` with 0 workers: stored
(compressed) and decoded bytes per patch voxel, ds[i] and fast path, the seconds spent decoding per patch
and the share of the decoded pixels inside the patch's rows and columns -- what in-plane tiles could save.

Measured with ``--size 512 --slices 100 --patches 32 --l1 0`` (same shared machine): ds[i] 3.7 / 5.8 patches/s
at 0 / 2 workers, fast path (resampled on the CPU) 4.0 / 5.1; 13.4 bytes stored and 44.6 decoded per patch
voxel either way, 13% of the decoded pixels in the patch's rows and columns; decoding 30 of 274 ms per
patch for ds[i], 24 of 41 ms for the fast path's read side (docs/training.md, "3D patches").

Measured with ``--patches 128 --l1 0`` on a 2-core machine shared with other jobs (rates varied 2x between
runs): 8-19 patches/s with 0 workers, 17-29 with 2; 9.8 MB read per patch, 11.0 bytes per patch voxel, of
which the rows and columns the patch reaches hold 4.8 (whole-slice reads: 2.3x; the rest is the series
being finer in-plane than 1.5 mm).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

from medload.config import IngestConfig
from medload.data import PatchDataset, make_loader
from medload.data.patch_geometry import source_box, voxel_to_voxel
from medload.ingest import ingest
from medload.storage.observe import ReadObserver
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

PATCH, SPACING = (96, 96, 96), (1.5, 1.5, 1.5)


def build(root: Path, size: int = 256, slices: int = 100) -> Path:
    make_series(root / "src", SeriesSpec(n_slices=slices, rows=size, cols=size, pixel_spacing=(0.7, 0.7),
                                         slice_spacing=2.5), seed=0, shuffle=False)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    store = open_store(root / "store")
    (rec,) = store.series()
    (root / "masks").mkdir()
    bone = (store.read(rec.key) > 300).astype(np.uint8).transpose(2, 1, 0)
    nib.save(nib.Nifti1Image(bone, np.asarray(rec.affine)), root / "masks" / f"{rec.key[:12]}.nii.gz")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1), labels=[root / "masks"])
    return root / "store"


def rate(ds: PatchDataset, workers: int, fast: bool = False) -> float:
    loader = iter(make_loader(ds, batch_size=2, num_workers=workers) if fast
                  else torch.utils.data.DataLoader(ds, batch_size=2, num_workers=workers))
    next(loader)  # start-up
    start, n = time.perf_counter(), 0
    for batch in loader:
        n += len(batch["index"])
    return n / (time.perf_counter() - start)


def bytes_read(ds: PatchDataset) -> tuple[float, float]:
    """Mean bytes the store returns per patch (image int16 + label uint8, whole slices), and of those the
    bytes in the rows and columns the patch reaches."""
    read = reached = 0
    for i in range(len(ds)):
        rec = ds.records[ds.draw(i).series]
        box = source_box(voxel_to_voxel(ds.item_affine(i), rec.affine), PATCH, rec.shape)
        if box is not None:
            (z0, r0, c0), (z1, r1, c1) = box
            read += int(z1 - z0) * rec.shape[1] * rec.shape[2] * (2 + 1)
            reached += int((z1 - z0) * (r1 - r0) * (c1 - c0)) * (2 + 1)
    return read / len(ds), reached / len(ds)


class Decoded(ReadObserver):
    """Stored bytes, slices and seconds of decoding, as the store reads them."""

    def __init__(self) -> None:
        self.stored = self.slices = 0
        self.decode_s = 0.0

    def range_read(self, tier: str, slices: int, nbytes: int, seconds: float) -> None:
        self.stored += nbytes
        self.slices += slices

    def decoded(self, seconds: float) -> None:
        self.decode_s += seconds


def observed(ds: PatchDataset, fast: bool) -> tuple[Decoded, float]:
    """What the store read and decoded for every patch of ``ds`` (0 workers), and the seconds it took: all
    of ``ds[i]``, or the fast path's read side (the crops a worker sends, before the device resamples)."""
    seen = ds.store.observe(Decoded())
    start = time.perf_counter()
    try:
        if fast:
            for _ in make_loader(ds, batch_size=2).loader:  # the torch DataLoader of crops
                pass
        else:
            for i in range(len(ds)):
                ds[i]
    finally:
        ds.store.unobserve(seen)
    return seen, time.perf_counter() - start


def amplification(ds: PatchDataset, rows: int, columns: int) -> None:
    voxels = len(ds) * float(np.prod(PATCH))
    for name, fast in (("ds[i]", False), ("fast path, read side", True)):
        seen, seconds = observed(ds, fast)
        # image int16 and label uint8 slices: the observer sees both (about as many of each; a foreground
        # centre reads one label slice more); decoded bytes are whole slices
        decoded = seen.slices * rows * columns * 1.5
        print(f"{name}: stored {seen.stored / voxels:.2f} B and decoded {decoded / voxels:.1f} B per patch voxel "
              f"(image + label); decoding {1e3 * seen.decode_s / len(ds):.0f} ms of {1e3 * seconds / len(ds):.0f} ms "
              "per patch (0 workers)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=64)
    parser.add_argument("--l1", default="0", help="the store's L1 cache budget (0: every read decodes)")
    parser.add_argument("--size", type=int, default=256, help="rows and columns of the series' slices")
    parser.add_argument("--slices", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(build(Path(tmp), args.size, args.slices), cache=args.l1)
        ds = PatchDataset(store, PATCH, SPACING, "RAS", samples_per_epoch=args.patches + 2, seed=0)
        read, reached = bytes_read(ds)
        for workers in (0, 2):
            for name, fast in (("ds[i] + DataLoader", False), ("make_loader (fast path)", True)):
                print(f"{name}, {workers} workers: {rate(ds, workers, fast):.1f} patches/s "
                      f"(batch 2 of {PATCH} at {SPACING} mm)")
        amplification(ds, args.size, args.size)
        print(f"read per patch: {read / 1e6:.1f} MB, {read / np.prod(PATCH):.1f} bytes per patch voxel (image int16 + "
              f"label uint8); the rows and columns the patch reaches: {reached / np.prod(PATCH):.1f} bytes per voxel "
              f"({reached / read:.0%} of the decoded pixels)")


if __name__ == "__main__":
    main()

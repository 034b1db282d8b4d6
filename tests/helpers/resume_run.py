"""A small training run over a store that logs every batch it trains on, saves its loader state every few
steps and can SIGKILL itself: what tests/data/test_resume.py kills and restores.

Each step appends one JSON line to the log -- the epoch, the sample indices, a checksum of the augmented
image and the augmentation parameters drawn for the batch -- and every ``--save-every`` steps the state
is written (atomically) beside it, with the number of log lines it covers. ``--kill-at N`` sends SIGKILL
to the process at step N (counted over the epochs), before it is logged. ``--resume`` starts from the
saved state.

Kinds: ``slice`` (2.5D), ``slab`` (3D) through make_loader with two workers, and ``patch`` (PatchDataset
through torch's DataLoader with two workers, restored from its sampler's and augmentation's states).
Orders: ``shuffle`` (make_loader's own), ``sampler`` (SeriesGroupedSampler) and ``buckets`` (a
UniformSampler over a store of two matrix sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from medload.data import (
    BatchAugment,
    PatchDataset,
    SeriesGroupedSampler,
    SlabDataset,
    SliceDataset,
    UniformSampler,
    make_loader,
)
from medload.storage.store import open_store

EPOCHS, BATCH = 2, 3


class RecordingAugment(BatchAugment):
    """BatchAugment that keeps the parameters of its last draw, to log them."""

    last: dict = {}

    def draw(self, batch_size: int):
        params = super().draw(batch_size)
        self.last = {"noise_seed": params.noise_seed, **{name: value.double().cpu().tolist() for name, value in
                                                         vars(params).items() if isinstance(value, torch.Tensor)}}
        return params


def _dataset(store, kind: str):
    if kind == "slice":
        return SliceDataset(store, context=1)
    if kind == "slab":
        return SlabDataset(store, depth=3, stride=2)
    return PatchDataset(store, patch=(4, 12, 12), spacing=(2.0, 1.5, 1.5), samples_per_epoch=12, seed=4)


def _loader(ds, kind: str, order: str, augment: BatchAugment):
    if kind == "patch":
        sampler = UniformSampler(len(ds), seed=9)
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2), sampler
    if order == "shuffle":
        return make_loader(ds, BATCH, 2, window="soft_tissue", shuffle=True, seed=7, augment=augment), None
    sampler = SeriesGroupedSampler.from_dataset(ds, seed=2, block=2) if order == "sampler" \
        else UniformSampler.from_dataset(ds, seed=2)
    return make_loader(ds, BATCH, 2, window="soft_tissue", sampler=sampler, augment=augment), sampler


def run(store_path: str, kind: str, order: str, log: Path, *, kill_at: int | None = None, save_every: int = 2,
        resume: bool = False) -> None:
    """Train ``EPOCHS`` epochs, logging each batch to ``log`` and its state to ``log.state.json``."""
    ds = _dataset(open_store(store_path), kind)
    augment = RecordingAugment(seed=5, spatial_dims=3 if kind == "patch" else None)
    loader, sampler = _loader(ds, kind, order, augment)
    state_path = log.with_suffix(".state.json")
    lines, start_epoch, state = 0, 0, None
    if resume:  # from the last saved state; killed before the first, from the start
        if state_path.exists():
            saved = json.loads(state_path.read_text())
            lines, state = saved["lines"], saved["state"]
            start_epoch = state["epoch"]
        with log.open("r+") as f:  # steps after the last saved state are redone, as a restored trainer redoes them
            f.truncate(sum(len(line) for line in f.readlines()[:lines]))
    step = lines
    with log.open("a") as out:
        for epoch in range(start_epoch, EPOCHS):
            if kind == "patch":
                ds.set_epoch(epoch)
                sampler.set_epoch(epoch)
                augment.set_epoch(epoch)
                if state is not None and state["epoch"] == epoch:
                    sampler.load_state_dict(state["sampler"])
                    augment.load_state_dict(state["augment"])
                    ds.load_state_dict(state["dataset"])
            else:
                if state is not None:
                    loader.load_state_dict(state)  # the state's epoch, from its batch
                loader.set_epoch(epoch)
            state = None
            consumed = sampler.position // BATCH if kind == "patch" else 0
            for batch in loader:
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "patch":  # the plain DataLoader's batches, augmented here as the loader would
                    image, _ = augment(((batch["image"] + 1024) / 2048).float(), None)
                else:
                    image = batch["image"]
                consumed += 1
                out.write(json.dumps({"epoch": epoch, "index": batch["index"].tolist(),
                                      "image": round(float(image.double().sum()), 3), "augment": augment.last}) + "\n")
                out.flush()
                step += 1
                if step % save_every == 0:
                    if kind == "patch":  # the DataLoader's sampler ran ahead of the steps: count the steps
                        state = {"epoch": epoch, "sampler": {**sampler.state_dict(), "position": consumed * BATCH},
                                 "augment": augment.state_dict(), "dataset": ds.state_dict()}
                    else:
                        state = loader.state_dict()
                    tmp = state_path.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"lines": step, "state": state}))
                    os.replace(tmp, state_path)
                    state = None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("kind", choices=["slice", "slab", "patch"])
    parser.add_argument("order", choices=["shuffle", "sampler", "buckets"])
    parser.add_argument("log", type=Path)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    run(args.store, args.kind, args.order, args.log, kill_at=args.kill_at, resume=args.resume)


if __name__ == "__main__":
    main()

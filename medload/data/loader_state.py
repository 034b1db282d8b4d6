"""Exact mid-epoch resume of a loader: ``loader.state_dict()`` / ``loader.load_state_dict(state)``, as
torchdata's ``StatefulDataLoader`` and PyTorch Lightning name them.

What a state holds: seeds and counters, never index lists -- the epoch, how many batches of it the
trainer *consumed*, and the states of the sampler (:mod:`medload.data.samplers`) and of the augmentation
(:class:`~medload.data.augment.BatchAugment`), each versioned (:mod:`medload.data.state_version`). Every
order is a function of ``(seed, epoch)`` and every augmentation draw of ``(seed, epoch, batch number)``,
so the counters rebuild the rest of the epoch:

- **Workers and prefetch.** The loader counts a batch when it hands it to the trainer, so batches the
  workers read ahead (and the buffer slots they fill) are not seen; the restored loader leaves out the
  first ``batches`` batches of the epoch's batching (indices only: nothing is read for them) and reads
  the rest. A trainer that itself fetches ahead (Lightning does for loaders without a length) gives
  the loader its own count, ``progress.consumed`` (:class:`medload.lightning.StoreDataModule` sets it
  to Lightning's), and the batches fetched but not stepped on count as not seen.
- **Shape buckets.** Batches are cut from the sampler's order per matrix size
  (:mod:`medload.data.buckets`), deterministically, so leaving out the first ``batches`` batches of that
  cut is exact, whatever their sizes.
- **Padding and elastic resume.** With :class:`~medload.data.DistributedPatientSampler` every rank ran
  the same number of steps (padding evens them), so the state of any one rank names what all of them
  consumed: ``segments``, ``[world size, batches]`` per stretch of the epoch. Restored with that world
  size, the rank continues its own order; with another, the samples no rank consumed are re-partitioned
  by patient among the new ranks by the same rule (:func:`~medload.data.distributed.assign_ranks`) that
  ``medload cache warm --rank R --world W`` copies shards by, each once in that epoch (padding evens the
  new ranks again); later epochs follow the new world size.

Examples:
    >>> loader = make_loader(SliceDataset(store), batch_size=4, shuffle=True, seed=1)
    >>> it = iter(loader); _ = next(it); state = loader.state_dict()
    >>> rest = [b["index"].tolist() for b in it]
    >>> again = make_loader(SliceDataset(store), batch_size=4, shuffle=True, seed=1)
    >>> again.load_state_dict(state)
    >>> [b["index"].tolist() for b in again] == rest
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from medload.data.buckets import ShapeBucketBatchSampler
from medload.data.state_version import checked, stamp
from medload.errors import ConfigError

__all__ = ["LoaderProgress", "capture", "restore"]


class LoaderProgress:
    """Where a loader's trainer is in the epoch: ``epoch``, ``handed`` (batches of it handed out, those
    a restored loader left out included), ``segments`` (``[world size, batches]`` of earlier stretches
    of the epoch under other world sizes) and ``consumed``: None (every batch handed out is consumed), or
    a callable giving the trainer's own count of the epoch's batches it stepped on."""

    def __init__(self) -> None:
        self.epoch = 0
        self.handed = 0
        self.segments: list[list[int]] = []
        self.consumed: Callable[[], int] | None = None
        self._restored = False  # the next pass continues a restored epoch

    def begin(self) -> None:
        """A pass over the loader starts: it continues a restored epoch, or starts from the beginning."""
        if not self._restored:
            self.handed, self.segments = 0, []
        self._restored = False

    def trainer_count(self) -> int:
        """Batches of this epoch the trainer consumed (never more than were handed out)."""
        if self.consumed is None:
            return self.handed
        return min(max(int(self.consumed()), 0), self.handed)


class DeviceLoader(Protocol):
    """What the state needs of a :class:`~medload.data.device_loader.DeviceLoader` or a
    :class:`~medload.data.patch_loader.PatchLoader` (which import this module): their batching is a
    :class:`~medload.data.buckets.ShapeBucketBatchSampler` at ``loader.loader.batch_sampler.batches``."""

    loader: torch.utils.data.DataLoader
    dataset: Any
    augment: Any
    progress: LoaderProgress

    def set_epoch(self, epoch: int) -> None: ...


def _bucketer(loader: DeviceLoader) -> ShapeBucketBatchSampler:
    """The loader's batching of its sampler's order (:mod:`medload.data.buckets`)."""
    return loader.loader.batch_sampler.batches  # type: ignore[union-attr]  # the slot batch sampler's


def set_epoch(loader: DeviceLoader, epoch: int) -> bool:
    """The loader's progress told of ``epoch``; False where it is the epoch a restored state continues (its
    place stays, and the sampler and augmentation keep theirs), True where it starts the epoch anew."""
    progress = loader.progress
    if progress._restored and epoch == progress.epoch:
        return False
    progress.epoch, progress.handed, progress.segments, progress._restored = epoch, 0, [], False
    _bucketer(loader).resume(0)
    return True


def capture(loader: DeviceLoader) -> dict[str, Any]:
    """``loader.state_dict()``: the state that restores the loader to the batch after the last one its
    trainer consumed (see the module docstring)."""
    progress, bucketer = loader.progress, _bucketer(loader)
    consumed = progress.trainer_count()
    state = stamp({"loader": type(loader).__name__, "epoch": progress.epoch, "batches": consumed,
                   "samples": len(loader.dataset), "batch_size": bucketer.batch_size, "drop_last": bucketer.drop_last})
    sampler: Any = bucketer.sampler  # a medload sampler has a state; torch's SequentialSampler none
    if hasattr(sampler, "state_dict"):
        state["sampler"] = {**sampler.state_dict(), "position": 0}  # the loader leaves out batches, not indices
    if hasattr(sampler, "continue_epoch"):  # distributed: every rank stepped alike, so counts name all ranks
        before = sum(count for _, count in progress.segments)
        state["segments"] = [*progress.segments, [sampler.world_size, consumed - before]]
        state["sampler"]["segments"] = []
    if hasattr(loader.augment, "state_dict"):
        augment = loader.augment.state_dict()
        state["augment"] = {**augment, "draws": augment["draws"] - (progress.handed - consumed)}
    return state


def restore(loader: DeviceLoader, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)``: the next pass over ``loader`` is the rest of the state's epoch."""
    state = checked(state, "loader", type(loader).__name__)
    bucketer = _bucketer(loader)
    here = {"samples": len(loader.dataset), "batch_size": bucketer.batch_size, "drop_last": bucketer.drop_last}
    saved = {name: state[name] for name in here}
    if saved != here:
        raise ConfigError(f"the state is of a loader of {saved}, this loader is one of {here}: build the loader "
                          "as the run that saved the state did (same dataset, batch_size and drop_last)")
    loader.progress._restored = False
    loader.set_epoch(int(state["epoch"]))  # the sampler's and the augmentation's epoch, before their states
    sampler: Any = bucketer.sampler
    if ("sampler" in state) != hasattr(sampler, "load_state_dict"):
        raise ConfigError("the state's loader and this one order their samples differently (one has a seeded "
                          "sampler, the other not): build the loader with the run's shuffle=/seed=/sampler=")
    if "sampler" in state:
        sampler.load_state_dict(state["sampler"])
    if ("augment" in state) != hasattr(loader.augment, "load_state_dict"):
        raise ConfigError("the state's loader and this one differ in their augmentation: pass the run's augment=")
    if "augment" in state:
        loader.augment.load_state_dict(state["augment"])
    skip, segments = int(state["batches"]), [[int(w), int(c)] for w, c in state.get("segments", [])]
    if hasattr(sampler, "continue_epoch"):
        if not segments:
            raise ConfigError("the state's loader had no DistributedPatientSampler: restore it with the run's sampler")
        if segments[-1][0] != sampler.world_size:  # elastic: the rest of the epoch over the new ranks
            segments.append([sampler.world_size, 0])
        sampler.continue_epoch(segments[:-1], _batched(bucketer))
        skip = segments[-1][1]
    progress = loader.progress
    progress.segments = segments[:-1]
    before = sum(count for _, count in progress.segments)
    bucketer.resume(skip, before)
    progress.handed, progress._restored = before + skip, True


def _batched(bucketer: ShapeBucketBatchSampler) -> Callable[[np.ndarray, int], np.ndarray]:
    """``take(order, count)``: the samples of the first ``count`` batches ``bucketer``'s batching cuts from
    ``order`` (another rank's order, when the loader replays what the ranks of a stretch consumed)."""
    def take(order: np.ndarray, count: int) -> np.ndarray:
        batches = ShapeBucketBatchSampler(order.tolist(), bucketer.buckets, bucketer.batch_size, bucketer.drop_last)
        out: list[int] = []
        for n, batch in enumerate(batches):
            if n == count:
                break
            out.extend(batch)
        return np.asarray(out, np.int64)
    return take

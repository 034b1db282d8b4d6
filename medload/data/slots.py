"""The slot machinery of the fast loader: batches read straight into slots of a shared buffer.

Stock pipelines collate per-sample float tensors in each worker, and every batch then crosses to the
trainer through freshly allocated shared memory (a copy and page faults per batch). Here:

1. a worker reads a whole batch of int16 (or uint8) slices with one call
   (:meth:`SliceDataset.read_batch`) straight into a *slot* of a shared buffer allocated once, before
   the workers start -- no per-batch allocation, no copy across the process boundary, half the bytes
   of float32;
2. only the slot number crosses the process boundary;
3. the trainer converts the slot to float and applies the window on the target device, in place.

With ``num_workers=0`` on the CPU nothing crosses a process, so step 1 writes floats instead: each
slice is cast straight into the float batch (from the L1 cache's own array where it holds the slice)
and windowed a few samples at a time, while they are in the CPU's cache; only labels use the slot
(what each of these choices gained: docs/benchmarks.md, "Design measurements").

A slot is reused ``slots`` batches later. When torch's DataLoader hands out batch n it dispatches batch
n + num_workers * prefetch_factor (never further ahead), while the trainer copies batch n off its slot
having finished with batch n - 1; so ``slots = num_workers * prefetch_factor + 1`` never overwrites a
batch in use (the new batch takes batch n - 1's slot). On CUDA the copy off a slot is only queued, so
the slots hold two more batches whose copies may be in flight, and a slot is refilled only once its
copy's event has completed (:mod:`medload.data.slot_ring`). A 2.5D int16 slot of 8 x 3 x 512 x 512 is
12.6 MB.

This module holds what runs where the batches are read (the batch sampler, the slot dataset, the
workers' L1 budget); :mod:`medload.data.device_loader` what runs in the trainer, and
:mod:`medload.data.build` puts them together (:func:`medload.data.make_loader` in front of it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from medload import windows as win
from medload.data.buckets import ShapeBucketBatchSampler
from medload.data.buffers import Recycler
from medload.data.loader_types import LoaderDataset
from medload.data.read_probe import timed_batch
from medload.data.readahead import ReadAhead
from medload.data.slot_ring import SlotRing
from medload.errors import ConfigError
from medload.storage.cache.lru import cap_shared

if TYPE_CHECKING:
    from torch.utils.data._utils.worker import WorkerInfo

__all__ = ["slot_count", "worker_l1", "shared_l1", "WorkerL1", "READ_AHEAD_BATCHES"]


class _Batch(list):
    """The sample indices of one batch, the buffer slot its arrays go into, its number in the epoch, and
    ``ahead``: ``(number, indices)`` of the batches the same reader reads after it, whose slices it has
    the disk fetch meanwhile."""

    def __init__(self, indices: list[int], slot: int, number: int = 0,
                 ahead: list[tuple[int, list[int]]] | None = None) -> None:
        super().__init__(indices)
        self.slot, self.number, self.ahead = slot, number, ahead or []


#: Batches of its own a reader has the disk fetch ahead of the one it decodes. One keeps a fast disk
#: busy; a slow or jittery one (a network volume, a shared VM disk) needs more in flight, so 2 (depths
#: compared in docs/benchmarks.md, "Design measurements"). Costs page cache only, not the process's memory: the
#: compressed bytes of the batches ahead.
READ_AHEAD_BATCHES = 2


class _SlotBatchSampler(torch.utils.data.Sampler):
    """Groups a sampler's indices into batches of one matrix size (:mod:`medload.data.buckets`), gives
    each batch the next slot of ``slots`` (a :class:`~medload.data.slot_ring.SlotRing`, or a number of
    slots), round robin, and the indices of the ``depth`` batches its reader reads next.

    torch's DataLoader hands batch n to worker ``n % num_workers``, so with ``lookahead = num_workers``
    (1 without workers) batches n + lookahead, n + 2 * lookahead ... are the next ones of the process that
    reads batch n: while it decodes batch n, the disk reads them (:meth:`medload.Store.prefetch`)."""

    def __init__(self, sampler: Iterable[int], batch_size: int, drop_last: bool, slots: int | SlotRing,
                 buckets: np.ndarray, lookahead: int = 1, depth: int | None = None) -> None:
        self.batches = ShapeBucketBatchSampler(sampler, buckets, batch_size, drop_last)
        self.ring = slots if isinstance(slots, SlotRing) else SlotRing(slots)
        self.lookahead, self.depth = lookahead, READ_AHEAD_BATCHES if depth is None else depth

    def __iter__(self) -> Iterator[_Batch]:
        pending: deque[list[int]] = deque()
        reach = self.lookahead * self.depth
        n = 0

        def emit() -> _Batch:
            nonlocal n
            ahead = [(n + k, pending[k]) for k in range(self.lookahead, reach + 1, self.lookahead) if k < len(pending)]
            batch = _Batch(pending.popleft(), self.ring.acquire(n), n, ahead)
            n += 1
            return batch

        for batch in self.batches:
            pending.append(batch)
            if len(pending) > reach:
                yield emit()
        while pending:
            yield emit()

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)


def _views(slot: np.ndarray, image_shape: tuple[int, ...], image_dtype: np.dtype, label_shape: tuple[int, ...] | None,
           label_dtype: np.dtype | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The image (and label) arrays of a batch, laid out one after the other in a slot's bytes."""
    n_image = int(np.prod(image_shape)) * image_dtype.itemsize
    image = slot[:n_image].view(image_dtype).reshape(image_shape)
    if label_shape is None:
        return image, None
    if label_dtype is None:
        raise ConfigError("a batch with labels needs the dataset's label_dtype; this dataset has none")
    n_label = int(np.prod(label_shape)) * label_dtype.itemsize
    return image, slot[n_image : n_image + n_label].view(label_dtype).reshape(label_shape)


class _Scale:
    """Scales a float image to 0..1 in place: a stored uint8 plane by 1/255, HU by the window."""

    def __init__(self, plane: str | None, window: win.Window | None) -> None:
        self.plane, self.window = plane, window

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.plane is not None:
            image.mul_(1.0 / 255.0)
        elif self.window is not None:
            lo, hi = self.window.bounds
            image.sub_(lo).mul_(1.0 / (hi - lo)).clamp_(0.0, 1.0)
        return image


class _SlotDataset(torch.utils.data.Dataset):
    """What the DataLoader sees: the dataset, writing each batch into its slot of ``buffers``.

    With ``cast_to`` (a float dtype and a :class:`_Scale`; the loader sets it for ``num_workers=0`` on
    the CPU, where the batch never crosses a process) the image is instead cast straight into a float
    batch and scaled there, a few samples at a time while they are in the CPU's cache, and handed over
    in the meta dict; only the label goes through the slot. Each slice is then copied once, from the L1
    cache into the float batch, instead of into the slot and from there into the float batch.

    ``control[0]`` (shared with the workers) is set while :func:`medload.data.profile.profile` runs:
    batches are then timed stage by stage where they are read (see :func:`~medload.data.read_probe.timed_batch`).
    """

    def __init__(self, dataset: LoaderDataset, buffers: torch.Tensor, control: torch.Tensor,
                 cast_to: tuple[torch.dtype, _Scale] | None = None) -> None:
        self.dataset, self.buffers, self.control, self.cast_to = dataset, buffers, control, cast_to
        self.recycler = Recycler() if cast_to else None
        self.probed = False  # this process reads through the profiler's observer (medload.data.read_probe)
        self.readahead = ReadAhead()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: _Batch) -> dict:
        if self.control[0] or self.probed:
            return timed_batch(self, batch)
        return self.fill(batch)

    def fill(self, batch: _Batch) -> dict:
        """Read ``batch`` into its slot; returns the small meta dict that crosses to the trainer.

        First the disk is asked, from a background thread, for the slices of the batch this process
        reads next, so that their reads overlap this batch's decoding (:mod:`medload.data.readahead`)."""
        self.readahead.before(self.dataset, batch)
        image_shape, label_shape = self.dataset.batch_shapes(batch)
        image, label = _views(self.buffers[batch.slot].numpy(), image_shape, self.dataset.dtype, label_shape,
                              self.dataset.label_dtype)
        meta = {"slot": batch.slot, "image_shape": image_shape, "label_shape": label_shape,
                "index": list(batch)}  # plain ints: a tensor would cross from a worker through new shared memory
        recycler = self.recycler  # set exactly when cast_to is
        if self.cast_to is None or recycler is None:
            self.dataset.read_batch(batch, image, label)
            return meta
        dtype, scale = self.cast_to
        floats = meta["image"] = recycler.empty(torch.Size(image_shape), dtype)
        step = max(1, _CACHED_BYTES // (floats[0].numel() * floats.element_size()))
        for i in range(0, len(batch), step):
            self.dataset.read_batch(batch[i : i + step], floats[i : i + step].numpy(),
                                    None if label is None else label[i : i + step])
            scale(floats[i : i + step])
        return meta


def _pass_through(batch: Any) -> Any:  # the meta dict of _SlotDataset.__getitems__, not a list of samples
    return batch



#: On the CPU the cast and the three window passes run over pieces of about this many bytes, which stay in
#: cache between passes instead of streaming a whole batch through memory four times (same result bit for
#: bit; measured in docs/benchmarks.md, "Design measurements").
_CACHED_BYTES = 4 << 20


def slot_count(num_workers: int, prefetch_factor: int, in_flight: int = 0) -> int:
    """Slots of the shared batch buffer: every batch the DataLoader may have in flight, plus the one the
    trainer is copying, plus ``in_flight`` whose device copies may still run (page-locked slots on CUDA:
    :data:`~medload.data.slot_ring.COPIES_IN_FLIGHT`; see the module docstring)."""
    return (num_workers * prefetch_factor + 1 if num_workers else 1) + in_flight


#: A dataset this many times larger than the L1 (decoded) is "far larger": see :func:`worker_l1`.
_FAR_LARGER = 8


def worker_l1(dataset: LoaderDataset, num_workers: int) -> int | None:
    """The L1 budget of each DataLoader worker of a loader over ``dataset`` (None: the store's own).

    Every process keeps its own L1, so W workers hold W copies of the budget. Where the dataset is far
    larger than the L1 (more than 8 times, decoded), a random epoch finds in any one of them about
    L1 / dataset of what it reads -- an eighth at most, under 5% on an archive -- and W copies only
    multiply the memory, not the hits: there the workers share the budget, each keeping 1/W of it.
    The hit rate stays the same and the peak memory falls (docs/benchmarks.md, "Design measurements"). Data that fit
    keep a whole L1 per worker.
    """
    decoded = sum(int(np.prod(r.shape)) for r in dataset.records) * dataset.dtype.itemsize
    return shared_l1(dataset.store.cache.l1_bytes, decoded, num_workers)


def shared_l1(l1: int, decoded: int, num_workers: int) -> int | None:
    """:func:`worker_l1`'s rule for a dataset of ``decoded`` bytes and an L1 budget ``l1``."""
    if num_workers < 2 or not l1:
        return None
    return l1 // num_workers if decoded > _FAR_LARGER * l1 else None


class WorkerL1:
    """``worker_init_fn`` of the loader: sets the worker's L1 budget (picklable, for ``spawn``)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget

    def __call__(self, worker_id: int) -> None:
        if self.budget is not None:
            info = cast("WorkerInfo", torch.utils.data.get_worker_info())  # None only outside a worker
            store = cast(_SlotDataset, info.dataset).dataset.store
            store.cache = replace(store.cache, l1_bytes=self.budget)
            cap_shared(self.budget)  # the L1 a forked worker inherits has the trainer's budget

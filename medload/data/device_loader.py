"""The trainer's side of the fast loader: :class:`DeviceLoader` takes each batch off its slot, onto the
training device, as float, windowed (and augmented) there.

It iterates a torch DataLoader built over the slot dataset of :mod:`medload.data.slots` (by
:mod:`medload.data.build`): only slot numbers and small meta dicts come from the workers. On CUDA the
slots are page-locked once the workers have started, and each batch is copied straight from its slot
and prepared on a side stream one batch ahead, while the model runs the previous one
(:mod:`medload.data.side_stream`; which slot may be refilled when: :mod:`medload.data.slot_ring`). On
the CPU the cast and window run piece by piece, each piece staying in the CPU's cache, on the cores the
workers leave. What the training thread pays inside ``next(loader)`` is kept in ``loader.cost``
(:mod:`medload.data.next_cost`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch

from medload import windows as win
from medload.cgroup_limits import usable_cores
from medload.data import loader_state
from medload.data.batch_meta import as_meta_batch, sample_keys
from medload.data.buffers import Recycler
from medload.data.lineage import loader_lineage
from medload.data.loader_types import Augment, LoaderTuning, StageClock
from medload.data.next_cost import NextCost
from medload.data.side_stream import CudaStreams, InFlight, SideStreamFeed, Streams
from medload.data.slot_ring import SlotRing
from medload.data.slots import _CACHED_BYTES, _Scale, _SlotBatchSampler, _SlotDataset, _views

if TYPE_CHECKING:
    from medload.lineage.record import LineageRecord

__all__ = ["DeviceLoader"]


def _no_mark(stage: str | None, meta: dict | None = None) -> None:
    """The profiler's stage clock when no profile runs: nothing."""


_Mark = Callable[..., None]  # the stage clock's mark, or _no_mark


def _unpin(streams: Streams, ring: SlotRing, buffers: torch.Tensor) -> None:
    """Unlock the slots once no copy from them is in flight."""
    ring.drain()
    streams.unpin(buffers)


_HALF = (torch.float16, torch.bfloat16)


@contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads capped at ``threads`` for the block (None: as they are).

    The loader casts and windows a batch on the CPU while its workers read the next ones; with torch's
    default of a thread per core the two oversubscribe the CPU, and the window then runs on the cores
    the workers leave (docs/benchmarks.md, "Design measurements")."""
    before = torch.get_num_threads()
    if threads is None or threads >= before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DeviceLoader:
    """Iterates batches as ``{"image": float (B, C, ...) on device, windowed to 0..1 (or HU without a
    window), "label": (B, 1, ...) as stored (uint8), "key": [B series keys], "z": int64 (B,),
    "index": int64 (B,)}`` -- the datasets' sample schema, batched: ``index`` is each sample's position
    in the dataset (``dataset.item_affine(i)`` maps it back to the patient), ``z`` its slice (2.5D: the
    centre; 3D: the first). With ``meta=True`` image and label are MONAI MetaTensors with the affines.

    ``tuning`` holds what ``num_workers="auto"`` chose and why (None otherwise); ``profiler`` is set
    while :func:`medload.data.profile.profile` times this loader's stages; ``cost`` totals the training
    thread's wall and CPU time inside ``next()`` (:class:`~medload.data.next_cost.NextCost`). On CUDA a
    batch handed out may still be in preparation on the device: the caller's stream waits for it there.

    Examples:
        >>> loader = make_loader(SliceDataset(store), batch_size=8, window="soft_tissue")
        >>> sorted(next(iter(loader)))     # the sample store has a label
        ['image', 'index', 'key', 'label', 'z']
    """

    def __init__(self, loader: torch.utils.data.DataLoader, buffers: torch.Tensor, device: torch.device,
                 window: win.Window | None, dtype: torch.dtype, augment: Augment | None = None, *,
                 pin_memory: bool | None = None, tuning: LoaderTuning | None = None, meta: bool = False,
                 streams: Streams | None = None) -> None:
        self.loader, self.buffers, self.device, self.window, self.dtype, self.augment = (
            loader, buffers, device, window, dtype, augment)
        self.dataset = cast(_SlotDataset, loader.dataset).dataset  # make_loader builds it over a _SlotDataset
        self.ring: SlotRing = cast(_SlotBatchSampler, loader.batch_sampler).ring
        self.meta = meta
        self.tuning = tuning
        self.profiler: StageClock | None = None  # set while medload.data.profile times this loader
        self.cost = NextCost()  # the training thread's time inside next(loader), all epochs
        self._scale = _Scale(self.dataset.plane, window)
        # streams: a stand-in drives the CUDA path's ordering on the CPU (tests)
        self._streams = streams if streams is not None else CudaStreams(device) if device.type == "cuda" else None
        self._pin = self._streams is not None and pin_memory is not False
        self._unlock: weakref.finalize | None = None  # unlocks the slots: at the latest when the loader goes
        self._recycler = Recycler() if device.type == "cpu" else None
        workers = loader.num_workers
        self._threads = max(1, usable_cores() - workers) if device.type == "cpu" and workers else None
        self.progress = loader_state.LoaderProgress()  # where the trainer is in the epoch (state_dict)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler and the augmentation (reproducible per epoch)."""
        if not loader_state.set_epoch(self, epoch):
            return  # the epoch a restored state continues: keep its place
        cast(_SlotBatchSampler, self.loader.batch_sampler).set_epoch(epoch)
        set_augment_epoch = getattr(self.augment, "set_epoch", None)
        if set_augment_epoch is not None:
            set_augment_epoch(epoch)

    def state_dict(self) -> dict:
        """Seeds and counters that restore this loader to the batch after the last one consumed, workers'
        read-ahead not counted (:mod:`medload.data.loader_state`)."""
        return loader_state.capture(self)

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass the rest of ``state``'s epoch, as an uninterrupted run would have read it (on
        another number of ranks: its remaining samples re-partitioned by patient)."""
        loader_state.restore(self, state)

    @property
    def sampler(self) -> DeviceLoader:
        """The loader itself: PyTorch Lightning's ``Trainer`` calls ``dataloader.sampler.set_epoch(epoch)``
        every epoch, which reaches :meth:`set_epoch` (sampler and augmentation) this way."""
        return self

    def lineage(self, **inputs: Any) -> LineageRecord:
        """The lineage record of this loader (:mod:`medload.lineage`): its dataset's, with the batch size, the
        sampler (kind, seed...), window, dtype and augmentation; ``inputs`` add further parts (``split=``...)."""
        return loader_lineage(self, **inputs)

    batch_sampler = None  # Lightning looks for one beside ``sampler``; the batching is the loader's own

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        mark = _no_mark if self.profiler is None else self.profiler.mark  # stage clock (medload.data.profile)
        cost = self.cost
        cost.enter()
        try:
            mark(None)
            self.progress.begin()
            batches = iter(self.loader)  # starts the workers (first epoch, or every epoch if not persistent)
            mark("start")
            for out in self._ready(batches, mark, self._feed()):
                cost.leave(batch=True)
                self.progress.handed += 1
                try:
                    yield out
                finally:  # also when the caller stops early (the generator is closed at its yield)
                    cost.enter()
                    mark("step")
                # hold no reference to the batch just handed out: once the caller drops it, its buffer is
                # free for the next (medload.data.buffers.Recycler)
                del out
        finally:
            self._end_epoch()
            cost.leave(batch=False)

    def _ready(self, batches: Iterator[dict], mark: _Mark, feed: SideStreamFeed | None) -> Iterator[dict]:
        """The epoch's batches, ready to hand out: on the CPU each prepared as it arrives; with a side
        stream, batch n is handed out once batch n + 1 has been queued behind it."""
        queued: InFlight | None = None
        for meta in batches:
            mark("wait", meta)
            if feed is None:
                yield self._prepare_here(meta, mark)
                continue
            issued = self._issue(feed, meta, mark)
            if queued is not None:
                yield self._finish(feed.hand_out(queued), queued.meta)
            queued = issued
            del meta, issued
        if queued is not None and feed is not None:
            yield self._finish(feed.hand_out(queued), queued.meta)

    def _feed(self) -> SideStreamFeed | None:
        """The side-stream feed of this epoch (None on the CPU); the slots are page-locked here, after the
        workers have started, so that no worker is forked from a process holding them locked."""
        if self._streams is None:
            return None
        if self._pin and not self._pinned:
            self._pin = self._streams.pin(self.buffers)  # where it failed, once (logged) is enough
            if self._pin:
                self._unlock = weakref.finalize(self, _unpin, self._streams, self.ring, self.buffers)
                self._unlock.atexit = False  # the process's exit frees it all
        self._streams.start()
        return SideStreamFeed(self._streams, self.ring, self._pinned)

    @property
    def _pinned(self) -> bool:
        return self._unlock is not None and self._unlock.alive

    def _end_epoch(self) -> None:
        """Workers that do not persist are forked again next epoch: unlock the slots until then."""
        if self._unlock is not None and self.loader.num_workers and not self.loader.persistent_workers:
            self._unlock()  # once: a finalizer runs at most once

    def _host(self, meta: dict) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """The batch's image and label on the host (views of its slot), and whether the image is a float
        batch already (cast as it was read: num_workers=0 on the CPU)."""
        ds = self.dataset
        image_view, label_view = _views(self.buffers[meta["slot"]].numpy(), meta["image_shape"], ds.dtype,
                                        meta["label_shape"], ds.label_dtype)
        owned = "image" in meta
        image = meta["image"] if owned else torch.from_numpy(image_view)
        return image, None if label_view is None else torch.from_numpy(label_view), owned

    def _prepare_here(self, meta: dict, mark: _Mark) -> dict:
        """A batch prepared on this thread, synchronously (the CPU): its slot is free on return."""
        image, label, owned = self._host(meta)
        label = None if label is None else label.to(self.device, copy=True)  # off the slot now
        mark("copy")
        out = self._prepared(image, label, meta, mark, owned)
        self.ring.released(meta["slot"])
        return self._finish(out, meta)

    def _issue(self, feed: SideStreamFeed, meta: dict, mark: _Mark) -> InFlight:
        """A batch queued on the side stream: copied from its slot, cast, windowed and augmented there."""
        image, label, _ = self._host(meta)

        def prepare(image: torch.Tensor, label: torch.Tensor | None) -> dict:
            mark("copy")
            return self._prepared(image, label, meta, mark)

        return feed.issue(meta["slot"], (image, label), self._to_device, prepare, meta)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on the device, queued without waiting where ``host`` is page-locked."""
        return host.to(self.device, non_blocking=True, copy=True)

    def _prepared(self, image: torch.Tensor, label: torch.Tensor | None, meta: dict, mark: _Mark,
                  owned: bool = False) -> dict:
        """The batch's tensors on the device: the image cast and windowed, augmented, and the indices."""
        out = {"image": self._to_float(image, owned),
               "index": torch.tensor(meta["index"], dtype=torch.int64, device=self.device)}
        if label is not None:
            out["label"] = label
        mark("window")
        if self.augment is not None:
            out["image"], augmented = self.augment(out["image"], out.get("label"))
            if augmented is not None:
                out["label"] = augmented
            mark("augment")
        return out

    def _finish(self, out: dict, meta: dict) -> dict:
        """The host-side fields of a batch: its series keys and slices, and MetaTensors with ``meta``."""
        out.update(sample_keys(self.dataset, meta["index"]))
        return as_meta_batch(out, self.dataset) if self.meta else out

    def _to_float(self, x: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """A float copy of ``x`` on the device (so the slot ``x`` may view is free), windowed in place
        (``owned``: ``x`` is such a float batch already, cast and windowed as it was read); for a
        stored ``dtype`` (int16/uint8), a copy of ``x`` on the device as it is.

        Half precision (float16/bfloat16) is windowed in float32 and then cast, so the only error is
        the final rounding of values in 0..1."""
        if owned:
            return x
        if not self.dtype.is_floating_point:  # passed through as stored, e.g. to be windowed in the model
            if x.device != self.device:
                return x.to(self.device)  # unpinned, to the GPU (a pinned batch is on the device already)
            return self._empty(x, x.dtype).copy_(x) if self.device.type == "cpu" else x  # off the slot on the CPU
        work = torch.float32 if self.dtype in _HALF else self.dtype
        image = self._empty(x, work)
        if self.device.type == "cpu":  # the passes run piece by piece, each piece staying in the CPU's cache
            planes, out = x.reshape(-1, *x.shape[-2:]), image.view(-1, *x.shape[-2:])
            step = max(1, _CACHED_BYTES // (out[0].numel() * out.element_size()))
            with _intra_op_threads(self._threads):
                for i in range(0, len(planes), step):
                    self._scale(out[i : i + step].copy_(planes[i : i + step]))
        else:
            self._scale(image.copy_(x))
        return image if work == self.dtype else self._empty(image, self.dtype).copy_(image)

    def _empty(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor shaped like ``like`` on the device (a recycled buffer on the CPU)."""
        if self._recycler is None:
            return torch.empty(like.shape, dtype=dtype, device=self.device)
        return self._recycler.empty(like.shape, dtype)

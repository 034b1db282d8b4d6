"""The fast path from a store to windowed float batches on the training device.

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
batch in use (the new batch takes batch n - 1's slot). A 2.5D int16 slot of 8 x 3 x 512 x 512 is 12.6 MB.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from medload import windows as win
from medload.config import affinity_cores
from medload.data.batch_meta import as_meta_batch, sample_keys
from medload.data.buckets import ShapeBucketBatchSampler, shape_buckets
from medload.data.buffers import PinnedStaging, Recycler
from medload.data.readahead import ReadAhead
from medload.devices import checked_device
from medload.errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.data._utils.worker import WorkerInfo

__all__ = ["make_loader", "DeviceLoader"]


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
    each batch the next slot, round robin, and the indices of the ``depth`` batches its reader reads next.

    torch's DataLoader hands batch n to worker ``n % num_workers``, so with ``lookahead = num_workers``
    (1 without workers) batches n + lookahead, n + 2 * lookahead ... are the next ones of the process that
    reads batch n: while it decodes batch n, the disk reads them (:meth:`medload.Store.prefetch`)."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, slots: int, buckets, lookahead: int = 1,
                 depth: int | None = None) -> None:
        self.batches, self.slots = ShapeBucketBatchSampler(sampler, buckets, batch_size, drop_last), slots
        self.lookahead, self.depth = lookahead, READ_AHEAD_BATCHES if depth is None else depth

    def __iter__(self) -> Iterator[_Batch]:
        pending: deque[list[int]] = deque()
        reach = self.lookahead * self.depth
        n = 0

        def emit() -> _Batch:
            nonlocal n
            ahead = [(n + k, pending[k]) for k in range(self.lookahead, reach + 1, self.lookahead) if k < len(pending)]
            batch = _Batch(pending.popleft(), n % self.slots, n, ahead)
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


def _views(slot: np.ndarray, image_shape, image_dtype: np.dtype, label_shape, label_dtype) -> tuple:
    """The image (and label) arrays of a batch, laid out one after the other in a slot's bytes."""
    n_image = int(np.prod(image_shape)) * image_dtype.itemsize
    image = slot[:n_image].view(image_dtype).reshape(image_shape)
    if label_shape is None:
        return image, None
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
    batches are then timed stage by stage where they are read (see :func:`~medload.data.profile.timed_batch`).
    """

    def __init__(self, dataset, buffers: torch.Tensor, control: torch.Tensor,
                 cast_to: tuple[torch.dtype, _Scale] | None = None) -> None:
        self.dataset, self.buffers, self.control, self.cast_to = dataset, buffers, control, cast_to
        self.recycler = Recycler() if cast_to else None
        self.probed = False  # this process's read path carries the profiler's probes
        self.readahead = ReadAhead()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: _Batch) -> dict:
        if self.control[0] or self.probed:
            from medload.data.profile import timed_batch

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


def _no_mark(stage: str | None, meta: dict | None = None) -> None:
    """The profiler's stage clock when no profile runs: nothing."""


_HALF = (torch.float16, torch.bfloat16)
#: On the CPU the cast and the three window passes run over pieces of about this many bytes, which stay in
#: cache between passes instead of streaming a whole batch through memory four times (same result bit for
#: bit; measured in docs/benchmarks.md, "Design measurements").
_CACHED_BYTES = 4 << 20


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


def slot_count(num_workers: int, prefetch_factor: int) -> int:
    """Slots of the shared batch buffer: every batch the DataLoader may have in flight, plus the one the
    trainer is copying (see the module docstring)."""
    return num_workers * prefetch_factor + 1 if num_workers else 1


class DeviceLoader:
    """Iterates batches as ``{"image": float (B, C, ...) on device, windowed to 0..1 (or HU without a
    window), "label": (B, 1, ...) as stored (uint8), "key": [B series keys], "z": int64 (B,),
    "index": int64 (B,)}`` -- the datasets' sample schema, batched: ``index`` is each sample's position
    in the dataset (``dataset.item_affine(i)`` maps it back to the patient), ``z`` its slice (2.5D: the
    centre; 3D: the first). With ``meta=True`` image and label are MONAI MetaTensors with the affines.

    ``tuning`` holds what ``num_workers="auto"`` chose and why (None otherwise); ``profiler`` is set
    while :func:`medload.data.profile.profile` times this loader's stages.

    Examples:
        >>> loader = make_loader(SliceDataset(store), batch_size=8, window="soft_tissue")
        >>> sorted(next(iter(loader)))     # the sample store has a label
        ['image', 'index', 'key', 'label', 'z']
    """

    def __init__(self, loader: torch.utils.data.DataLoader, buffers: torch.Tensor, device: torch.device,
                 window: win.Window | None, dtype: torch.dtype, augment=None, *, pin_memory: bool | None = None,
                 tuning=None, meta: bool = False) -> None:
        self.loader, self.buffers, self.device, self.window, self.dtype, self.augment = (
            loader, buffers, device, window, dtype, augment)
        self.dataset = cast(_SlotDataset, loader.dataset).dataset  # make_loader builds it over a _SlotDataset
        self.meta = meta
        self.tuning, self.profiler = tuning, None
        self._scale = _Scale(self.dataset.plane, window)
        pin = device.type == "cuda" if pin_memory is None else pin_memory and device.type == "cuda"
        self._staging = PinnedStaging() if pin else None
        self._recycler = Recycler() if device.type == "cpu" else None
        workers = loader.num_workers
        self._threads = max(1, affinity_cores() - workers) if device.type == "cpu" and workers else None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler and the augmentation (reproducible per epoch)."""
        cast(_SlotBatchSampler, self.loader.batch_sampler).set_epoch(epoch)
        if hasattr(self.augment, "set_epoch"):
            self.augment.set_epoch(epoch)

    @property
    def sampler(self) -> DeviceLoader:
        """The loader itself: PyTorch Lightning's ``Trainer`` calls ``dataloader.sampler.set_epoch(epoch)``
        every epoch, which reaches :meth:`set_epoch` (sampler and augmentation) this way."""
        return self

    batch_sampler = None  # Lightning looks for one beside ``sampler``; the batching is the loader's own

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        ds = self.dataset
        mark = _no_mark if self.profiler is None else self.profiler.mark  # stage clock (medload.data.profile)
        mark(None)
        batches = iter(self.loader)  # starts the workers (first epoch, or every epoch if not persistent)
        mark("start")
        for meta in batches:
            mark("wait", meta)
            image, label = _views(self.buffers[meta["slot"]].numpy(), meta["image_shape"], ds.dtype,
                                  meta["label_shape"], ds.label_dtype)
            owned = "image" in meta  # a float batch already: cast as it was read (num_workers=0, CPU)
            image = meta["image"] if owned else torch.from_numpy(image)
            if self._staging is not None:  # GPU: through pinned memory, asynchronously
                image = self._staging.to_device(image, self.device)
            if label is not None:  # copied off the slot before the slot is reused
                label = self._transfer(torch.from_numpy(label))
            index = torch.tensor(meta["index"], dtype=torch.int64, device=self.device)
            mark("copy")
            out = {"image": self._to_float(image, owned), "index": index}
            if label is not None:
                out["label"] = label
            mark("window")
            if self.augment is not None:
                out["image"], augmented = self.augment(out["image"], out.get("label"))
                if augmented is not None:
                    out["label"] = augmented
                mark("augment")
            out.update(sample_keys(ds, meta["index"]))
            if self.meta:
                out = as_meta_batch(out, ds)
            try:
                yield out
            finally:  # also when the caller stops early (the generator is closed at its yield)
                mark("step")
            # hold no reference to the batch just handed out: once the caller drops it, its buffer is free
            # for the next (medload.data.buffers.Recycler)
            del out, image, label, meta

    def _transfer(self, host: torch.Tensor) -> torch.Tensor:
        """The slot's array on the device, in its stored dtype (int16/uint8), no longer using the slot."""
        if self._staging is not None:
            return self._staging.to_device(host, self.device)
        return host.to(self.device, copy=True)

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


def make_loader(dataset, batch_size: int, num_workers: int | str = 0, device: str | torch.device = "cpu", *,
                window: str | win.Window | None = None, shuffle: bool = False, sampler=None, drop_last: bool = False,
                seed: int | None = None, augment=None, dtype: torch.dtype = torch.float32,
                prefetch_factor: int | None = None, persistent_workers: bool | None = None,
                multiprocessing_context=None, pin_memory: bool | None = None,
                memory_budget: int | str | None = None, meta: bool = False) -> DeviceLoader:
    """A loader of windowed float batches on ``device`` from a :class:`SliceDataset`/:class:`SlabDataset`.

    Args:
        num_workers: reading processes, or ``"auto"``: measure a few batches on this store and machine
            and choose workers, ``prefetch_factor`` (unless given) and pinning within ``memory_budget``
            (see :mod:`medload.data.autotune`; the choice and its reason are in ``loader.tuning``).
        dtype: of the image batches: float32, or float16/bfloat16, which halve the device memory of
            every batch; the window is applied in float32 and the result cast (error at most half a
            unit in the last place of a value in 0..1: 2**-11 for float16, 2**-8 for bfloat16).
            Without a window, half precision rounds HU above 2048 (float16) or 256 (bfloat16).
            Or the dataset's stored dtype (``torch.int16`` HU, ``torch.uint8`` planes): batches as
            stored, with no cast and no window, for a model that windows them itself on the device
            (half the bytes of float32 from host to GPU).
        prefetch_factor: batches each worker reads ahead (default 2).
        pin_memory: copy to CUDA through pinned host buffers, asynchronously (default: on CUDA).
        memory_budget: bytes (or ``"2GB"``) ``"auto"`` may spend on batch buffers, pinned staging and
            the workers' L1 caches (default: a quarter of the available memory, at most 4 GB).
        window: window for HU datasets (``"soft_tissue"``, ``"350/50"``...): values map to 0..1 on the
            device. A dataset reading a stored uint8 plane (``plane=``) is scaled to 0..1 and needs none.
        shuffle, seed: without a ``sampler``, a random order drawn from ``seed`` (default 0), a new one each
            epoch, or (default, as torch's DataLoader) the dataset's order. A seed without shuffling, or
            either with a ``sampler``, is a ConfigError: it would be ignored.
        sampler: any torch Sampler of dataset indices (e.g. from :mod:`medload.data.samplers`), which
            decides the order. Where the dataset mixes matrix
            sizes, each batch holds one size: the sampler's order is kept within each size and a batch
            goes out when its size has ``batch_size`` samples (:mod:`medload.data.buckets`); ``drop_last``
            then drops each size's last partial batch.
        augment: a callable ``(image, label) -> (image, label)`` applied to each batch on the device,
            e.g. :class:`medload.data.augment.BatchAugment`, which takes the device and the spatial
            dims from the loader (its ``bind``).
        meta: image and label batches as MONAI ``MetaTensor`` carrying each sample's affine and key
            (:mod:`medload.data.batch_meta`), for ``decollate_batch`` and MONAI post-processing
            (``Invertd``, ``SaveImaged``, ``sliding_window_inference``).

    Examples:
        >>> loader = make_loader(SliceDataset(store, context=1), batch_size=8, num_workers=2,
        ...                      device="cpu", window="soft_tissue", shuffle=True)   # or device="cuda"
        >>> batch = next(iter(loader)); batch["image"].shape, batch["image"].dtype
        (torch.Size([8, 3, 512, 512]), torch.float32)
    """
    device = checked_device(device)  # a GPU this machine lacks fails here, not at the first batch
    if dataset.plane is not None and window is not None:
        raise ConfigError(f"the dataset reads stored {dataset.plane!r} planes (already windowed): drop window={window!r}")
    sampler = _order(dataset, sampler, shuffle, seed)
    stored = torch.from_numpy(np.empty(0, dtype=dataset.dtype)).dtype
    if dtype not in (torch.float32, torch.float64, *_HALF, stored):
        raise ConfigError(f"dtype {dtype} is neither a float type (torch.float32, torch.float16, torch.bfloat16) "
                          f"nor the dataset's stored {stored} (batches as stored)")
    if not dtype.is_floating_point and augment is not None:
        raise ConfigError(f"dtype={dtype} passes batches through as stored; augmentation needs float batches")
    if not dtype.is_floating_point and window is not None:
        raise ConfigError(f"dtype={dtype} passes batches through as stored, unwindowed: drop window={window!r}, "
                          "or ask for a float dtype")
    tuning = None
    if num_workers == "auto":
        from medload.data.autotune import tune_loader

        tuning = tune_loader(dataset, batch_size, device, window=window, augment=augment, dtype=dtype,
                             prefetch_factor=prefetch_factor, pin_memory=pin_memory, memory_budget=memory_budget)
        num_workers, prefetch_factor, pin_memory = tuning.num_workers, tuning.prefetch_factor, tuning.pin_memory
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an integer >= 0 or \"auto\", got {num_workers!r}")
    prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
    slots = slot_count(num_workers, prefetch_factor)
    buffers = torch.empty((slots, dataset.max_batch_bytes(batch_size)), dtype=torch.uint8)
    control = torch.zeros(1, dtype=torch.uint8)  # [0]: a profile is running (medload.data.profile)
    if num_workers:
        buffers.share_memory_()
        control.share_memory_()
    window = None if window is None else win.get(window)
    if hasattr(augment, "bind"):  # BatchAugment: the device and dims of these batches, and whether they are 0..1
        augment = augment.bind(device=device, spatial_dims=dataset.spatial_dims,
                               scaled=window is not None or dataset.plane is not None)
    direct = num_workers == 0 and device.type == "cpu" and dtype in (torch.float32, torch.float64)
    loader = torch.utils.data.DataLoader(
        _SlotDataset(dataset, buffers, control, cast_to=(dtype, _Scale(dataset.plane, window)) if direct else None),
        batch_sampler=_SlotBatchSampler(sampler, batch_size, drop_last, slots, shape_buckets(dataset),
                                        lookahead=max(1, num_workers)),
        num_workers=num_workers, collate_fn=_pass_through,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
        multiprocessing_context=multiprocessing_context, worker_init_fn=_WorkerL1(worker_l1(dataset, num_workers)),
    )
    return DeviceLoader(loader, buffers, device, window, dtype, augment,
                        pin_memory=pin_memory, tuning=tuning, meta=meta)


def _order(dataset, sampler, shuffle: bool, seed: int | None):
    """The sampler of a loader: the one given, or a seeded random (``shuffle``) or sequential order."""
    if sampler is not None:
        if shuffle or seed is not None:
            raise ConfigError("a sampler decides the order: drop shuffle=/seed= (seed the sampler instead)")
        return sampler
    if seed is not None and not shuffle:
        raise ConfigError(f"seed={seed} only orders a shuffled loader: add shuffle=True, or drop the seed")
    if not shuffle:
        return torch.utils.data.SequentialSampler(dataset)
    return torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed or 0))


#: A dataset this many times larger than the L1 (decoded) is "far larger": see :func:`worker_l1`.
_FAR_LARGER = 8


def worker_l1(dataset, num_workers: int) -> int | None:
    """The L1 budget of each DataLoader worker of a loader over ``dataset`` (None: the store's own).

    Every process keeps its own L1, so W workers hold W copies of the budget. Where the dataset is far
    larger than the L1 (more than 8 times, decoded), a random epoch finds in any one of them about
    L1 / dataset of what it reads -- an eighth at most, under 5% on an archive -- and W copies only
    multiply the memory, not the hits: there the workers share the budget, each keeping 1/W of it.
    The hit rate stays the same and the peak memory falls (docs/benchmarks.md, "Design measurements"). Data that fit
    keep a whole L1 per worker.
    """
    l1 = dataset.store.cache.l1_bytes
    if num_workers < 2 or not l1:
        return None
    decoded = sum(int(np.prod(r.shape)) for r in dataset.records) * dataset.dtype.itemsize
    return l1 // num_workers if decoded > _FAR_LARGER * l1 else None


class _WorkerL1:
    """``worker_init_fn`` of the loader: sets the worker's L1 budget (picklable, for ``spawn``)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget

    def __call__(self, worker_id: int) -> None:
        if self.budget is not None:
            from dataclasses import replace

            from medload.storage.cache.lru import cap_shared

            info = cast("WorkerInfo", torch.utils.data.get_worker_info())  # None only outside a worker
            store = cast(_SlotDataset, info.dataset).dataset.store
            store.cache = replace(store.cache, l1_bytes=self.budget)
            cap_shared(self.budget)  # the L1 a forked worker inherits has the trainer's budget

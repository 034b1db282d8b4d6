"""The lower layer of the loader: a :class:`~medload.data.device_loader.DeviceLoader` built from concrete
settings -- a number of workers, a prefetch factor, a torch dtype -- with nothing left to resolve.

:func:`~medload.data.make_loader` (:mod:`medload.data.loader`) resolves its keywords and a
:class:`~medload.config.LoaderConfig` into such settings, and ``num_workers="auto"`` into a number
(:mod:`medload.data.autotune`, which measures through :func:`build_loader` itself), then calls
:func:`build_loader`. What the pieces do: :mod:`medload.data.slots` (where batches are read) and
:mod:`medload.data.device_loader` (the trainer's side).
"""

from __future__ import annotations

from collections.abc import Iterable, Sized

import numpy as np
import torch

from medload import windows as win
from medload.data.buckets import shape_buckets
from medload.data.device_loader import _HALF, DeviceLoader
from medload.data.loader_types import Augment, LoaderDataset, LoaderTuning, MPContext
from medload.data.samplers import EpochShuffle
from medload.data.shared_tensors import shared_empty
from medload.data.side_stream import Streams
from medload.data.slot_ring import COPIES_IN_FLIGHT, SlotRing
from medload.data.slots import (
    WorkerL1,
    _pass_through,
    _Scale,
    _SlotBatchSampler,
    _SlotDataset,
    slot_count,
    worker_l1,
)
from medload.devices import checked_device
from medload.errors import ConfigError

__all__ = ["build_loader", "check_settings", "ordered"]


def check_settings(dataset: LoaderDataset, window: str | win.Window | None, dtype: torch.dtype,
                   augment: Augment | None) -> None:
    """A ConfigError where the window, dtype and augmentation do not fit together or the dataset."""
    if dataset.plane is not None and window is not None:
        raise ConfigError(f"the dataset reads stored {dataset.plane!r} planes (already windowed): drop window={window!r}")
    stored = torch.from_numpy(np.empty(0, dtype=dataset.dtype)).dtype
    if dtype not in (torch.float32, torch.float64, *_HALF, stored):
        raise ConfigError(f"dtype {dtype} is neither a float type (torch.float32, torch.float16, torch.bfloat16) "
                          f"nor the dataset's stored {stored} (batches as stored)")
    if not dtype.is_floating_point and augment is not None:
        raise ConfigError(f"dtype={dtype} passes batches through as stored; augmentation needs float batches")
    if not dtype.is_floating_point and window is not None:
        raise ConfigError(f"dtype={dtype} passes batches through as stored, unwindowed: drop window={window!r}, "
                          "or ask for a float dtype")


def ordered(dataset: Sized, sampler: Iterable[int] | None, shuffle: bool, seed: int | None) -> Iterable[int]:
    """The sampler of a loader: the one given, or a seeded random (``shuffle``: :class:`EpochShuffle`,
    which a loader's state restores) or sequential order."""
    if sampler is not None:
        if shuffle or seed is not None:
            raise ConfigError("a sampler decides the order: drop shuffle=/seed= (seed the sampler instead)")
        return sampler
    if seed is not None and not shuffle:
        raise ConfigError(f"seed={seed} only orders a shuffled loader: add shuffle=True, or drop the seed")
    if not shuffle:
        return torch.utils.data.SequentialSampler(dataset)
    return EpochShuffle(len(dataset), seed=seed or 0)


def build_loader(  # noqa: PLR0913 - make_loader's settings, resolved, one keyword each
        dataset: LoaderDataset, batch_size: int, num_workers: int, device: str | torch.device, *,
        sampler: Iterable[int] | None = None, window: str | win.Window | None = None, drop_last: bool = False,
        augment: Augment | None = None, dtype: torch.dtype = torch.float32, prefetch_factor: int | None = None,
        persistent_workers: bool | None = None, multiprocessing_context: MPContext | None = None,
        pin_memory: bool | None = None, meta: bool = False, tuning: LoaderTuning | None = None,
        streams: Streams | None = None) -> DeviceLoader:
    """The loader over ``dataset`` with these settings (as :func:`~medload.data.make_loader`'s, but
    ``num_workers`` a number and ``sampler`` the order itself: None reads the dataset in order);
    ``tuning``: what chose them, kept as ``loader.tuning``; ``streams``: a stand-in for CUDA's
    (:class:`~medload.data.side_stream.Streams`) that drives the CUDA path on any device.

    Examples:
        >>> loader = build_loader(SliceDataset(store), 8, 0, "cpu", window="soft_tissue")
        >>> next(iter(loader))["image"].shape
        torch.Size([8, 3, 512, 512])
    """
    device = checked_device(device)  # a GPU this machine lacks fails here, not at the first batch
    check_settings(dataset, window, dtype, augment)
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an integer >= 0 or \"auto\", got {num_workers!r}")
    sampler = ordered(dataset, sampler, False, None)
    prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
    # page-locked slots: the device copies from them run asynchronously, so more slots hold copies in flight
    pinned = (device.type == "cuda" or streams is not None) and pin_memory is not False
    slots = SlotRing(slot_count(num_workers, prefetch_factor, COPIES_IN_FLIGHT if pinned else 0))
    shape = (slots.slots, dataset.max_batch_bytes(batch_size))
    if num_workers or pinned:  # shared with the workers (not through /dev/shm where they fork); page-aligned
        buffers = shared_empty(shape, torch.uint8, multiprocessing_context)
        control = shared_empty((1,), torch.uint8, multiprocessing_context)
        control.zero_()
    else:
        buffers, control = torch.empty(shape, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    # control[0]: a profile is running (medload.data.profile)
    window = None if window is None else win.get(window)
    bind = getattr(augment, "bind", None)
    if bind is not None:  # BatchAugment: the device and dims of these batches, and whether they are 0..1
        augment = bind(device=device, spatial_dims=dataset.spatial_dims,
                               scaled=window is not None or dataset.plane is not None)
    direct = num_workers == 0 and device.type == "cpu" and streams is None and dtype in (torch.float32, torch.float64)
    loader = torch.utils.data.DataLoader(
        _SlotDataset(dataset, buffers, control, cast_to=(dtype, _Scale(dataset.plane, window)) if direct else None),
        batch_sampler=_SlotBatchSampler(sampler, batch_size, drop_last, slots, shape_buckets(dataset),
                                        lookahead=max(1, num_workers)),
        num_workers=num_workers, collate_fn=_pass_through,
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
        multiprocessing_context=multiprocessing_context, worker_init_fn=WorkerL1(worker_l1(dataset, num_workers)),
    )
    return DeviceLoader(loader, buffers, device, window, dtype, augment,
                        pin_memory=pin_memory, tuning=tuning, meta=meta, streams=streams)

"""The fast path from a store to windowed float batches on the training device.

Stock pipelines collate per-sample float tensors in each worker, and every batch crosses to the
trainer through freshly allocated shared memory. Here a worker reads a whole batch of int16 (or
uint8) slices into one array (:meth:`SliceDataset.__getitems__`), that one array -- half the bytes of
float32 -- crosses to the trainer, is pinned when the device is a GPU, and the float conversion and
windowing run on the device, in place.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from medload import windows as win
from medload.allocator import keep_large_buffers_in_heap
from medload.errors import ConfigError

__all__ = ["make_loader", "DeviceLoader", "collate_batch"]


def collate_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The dataset already built the batch: wrap its arrays as tensors (no copy)."""
    return {name: torch.from_numpy(array) for name, array in batch.items()}


class DeviceLoader:
    """Iterates a DataLoader of int16/uint8 batches and yields float batches windowed on ``device``:
    ``{"image": float (B, C, ...) in 0..1 (or HU without a window), "label": uint8 (B, 1, ...),
    "index": int64 (B,)}`` (``index`` gives each sample's position in the dataset, for its affine)."""

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device, window: win.Window | None,
                 scale_uint8: bool, dtype: torch.dtype, augment=None) -> None:
        self.loader, self.device, self.window, self.dtype, self.augment = loader, device, window, dtype, augment
        self._scale_uint8 = scale_uint8

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self):
        return self.loader.dataset

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler and the augmentation (reproducible per epoch)."""
        for obj in (getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None), self.augment):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        non_blocking = self.device.type == "cuda"
        for batch in self.loader:
            out = {name: t.to(self.device, non_blocking=non_blocking) for name, t in batch.items()}
            out["image"] = self._to_float(out["image"])
            if self.augment is not None:
                out["image"], label = self.augment(out["image"], out.get("label"))
                if label is not None:
                    out["label"] = label
            yield out

    def _to_float(self, x: torch.Tensor) -> torch.Tensor:
        image = x.to(self.dtype)
        if self._scale_uint8:
            return image.mul_(1.0 / 255.0)
        if self.window is not None:
            lo, hi = self.window.bounds
            return image.sub_(lo).mul_(1.0 / (hi - lo)).clamp_(0.0, 1.0)
        return image


def _init_worker(worker_id: int) -> None:
    keep_large_buffers_in_heap()  # each worker builds one batch array after another


def make_loader(dataset, batch_size: int, num_workers: int = 0, device: str | torch.device = "cpu", *,
                window: str | win.Window | None = None, shuffle: bool = True, sampler=None, drop_last: bool = False,
                seed: int = 0, augment=None, dtype: torch.dtype = torch.float32, prefetch_factor: int | None = None,
                persistent_workers: bool | None = None, multiprocessing_context=None) -> DeviceLoader:
    """A loader of windowed float batches on ``device`` from a :class:`SliceDataset`/:class:`SlabDataset`.

    Args:
        window: window for HU datasets (``"soft_tissue"``, ``"350/50"``...): values map to 0..1 on the
            device. A dataset reading a stored uint8 plane (``plane=``) is scaled to 0..1 and needs none.
        sampler: any torch Sampler of dataset indices (e.g. from :mod:`medload.data.samplers`);
            otherwise a seeded random (``shuffle``) or sequential order.
        augment: a callable ``(image, label) -> (image, label)`` applied to each batch on the device,
            e.g. :class:`medload.data.augment.BatchAugment`.

    Example:
        >>> loader = make_loader(SliceDataset(store, context=1), batch_size=8, num_workers=2,
        ...                      device="cuda", window="soft_tissue")                 # doctest: +SKIP
        >>> batch = next(iter(loader)); batch["image"].shape, batch["image"].dtype
        (torch.Size([8, 3, 512, 512]), torch.float32)
    """
    device = torch.device(device)
    keep_large_buffers_in_heap()  # batches on the CPU: reuse their memory instead of faulting it in anew
    plane = getattr(dataset, "plane", None)
    if plane is not None and window is not None:
        raise ConfigError(f"the dataset reads stored {plane!r} planes (already windowed): drop window={window!r}")
    if sampler is None:
        generator = torch.Generator().manual_seed(seed)
        sampler = (torch.utils.data.RandomSampler(dataset, generator=generator) if shuffle
                   else torch.utils.data.SequentialSampler(dataset))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=num_workers,
        collate_fn=collate_batch, pin_memory=device.type == "cuda",
        prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
        multiprocessing_context=multiprocessing_context, worker_init_fn=_init_worker,
    )
    return DeviceLoader(loader, device, None if window is None else win.get(window), plane is not None, dtype, augment)

"""make_loader's path for datasets read one sample at a time, such as :class:`~medload.data.PatchDataset`.

The slot path (:mod:`medload.data.slots`) needs a dataset that reads whole batches of stored arrays into
a shared buffer (``read_batch``). A dataset without one -- ``ds[i]`` a dict whose ``image`` is already a
float tensor ``(C, *spatial)`` (a patch resampled on the CPU) -- goes here: torch's DataLoader builds the
samples (in workers, if any) and collates them; the trainer moves each batch to the device, windows the
image there (in float32, then cast to the dtype asked for) and augments it. The batch schema is
:class:`~medload.data.DeviceLoader`'s: ``image``, ``label`` (as the dataset gives it), ``index`` (int64 on
the device), ``key`` (a list) and the dataset's other per-sample values collated (PatchDataset's
``centre``, ``foreground``); with ``meta=True`` image and label are batched MetaTensors carrying each
sample's own affine, as the sample had it.

Epochs: the sampler hands each index out as ``(epoch, i)``, the epoch read from the dataset's ``epoch``
when the iterator starts, and the reading process sets it on its copy of the dataset before ``ds[i]``:
so DataLoader workers, persistent ones included, draw the current epoch's samples (PatchDataset's draw
depends on ``(seed, epoch, i)``). :meth:`SampleLoader.set_epoch` sets it (Lightning calls it each epoch).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeGuard

import torch

from medload import windows as win
from medload.data.loader_types import Augment, LoaderDataset, MPContext
from medload.data.slots import _Scale
from medload.errors import ConfigError

__all__ = ["SampleDataset", "SampleLoader", "reads_batches"]


class SampleDataset(Protocol):
    """A map-style dataset of dict samples (``image`` a float tensor ``(C, *spatial)``), read one at a time."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...

def reads_batches(dataset: object) -> TypeGuard[LoaderDataset]:
    """Whether ``dataset`` reads whole batches into the loader's slots (SliceDataset, SlabDataset): the
    slot path; otherwise :class:`SampleLoader`."""
    return callable(getattr(dataset, "read_batch", None))


class _EpochOrder(torch.utils.data.Sampler):
    """The sampler's indices as ``(epoch, i)``, the epoch the dataset had when the iterator started."""

    def __init__(self, dataset: Any, order: Iterable[int]) -> None:
        self.dataset, self.order = dataset, order

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = int(getattr(self.dataset, "epoch", 0))
        return ((epoch, int(i)) for i in self.order)

    def __len__(self) -> int:
        return len(self.order)  # type: ignore[arg-type]  # torch's samplers have a length

    def set_epoch(self, epoch: int) -> None:
        set_order_epoch = getattr(self.order, "set_epoch", None)
        if set_order_epoch is not None:
            set_order_epoch(epoch)


class _AtEpoch(torch.utils.data.Dataset):
    """``dataset[i]`` at the epoch that came with the index (what the reading process sees)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, i = key
        if getattr(self.dataset, "epoch", epoch) != epoch:
            self.dataset.set_epoch(epoch)
        return self.dataset[i]


class _Collate:
    """Plain tensors out of MetaTensors (and, for ``meta``, their affines kept as ``_affine``), then torch's
    default collation (picklable, for ``spawn``)."""

    def __init__(self, meta: bool) -> None:
        self.meta = meta

    def __call__(self, samples: list[dict]) -> dict:
        plain = [{k: v.as_tensor() if hasattr(v, "as_tensor") else v for k, v in s.items()} for s in samples]
        out = torch.utils.data.default_collate(plain)
        if self.meta:
            out["_affine"] = torch.stack([torch.as_tensor(s["image"].affine, dtype=torch.float64) for s in samples])
        return out


class SampleLoader:
    """Batches of a dataset read one sample at a time, on ``device`` (see the module docs); made by
    :func:`~medload.data.make_loader`, which passes its settings.

    Examples:
        >>> from medload.data import PatchDataset
        >>> loader = make_loader(PatchDataset(store, patch=(8, 32, 32), spacing=(5.0, 2.0, 2.0), samples_per_epoch=4),
        ...                      batch_size=2, window="soft_tissue")
        >>> batch = next(iter(loader)); batch["image"].shape, batch["label"].shape
        (torch.Size([2, 1, 8, 32, 32]), torch.Size([2, 1, 8, 32, 32]))
    """

    def __init__(self, dataset: SampleDataset, batch_size: int, num_workers: int, device: torch.device, *,  # noqa: PLR0913
                 sampler: Iterable[int], window: str | win.Window | None = None, drop_last: bool = False,
                 augment: Augment | None = None, dtype: torch.dtype = torch.float32,
                 prefetch_factor: int | None = None, persistent_workers: bool | None = None,
                 multiprocessing_context: MPContext | None = None, pin_memory: bool | None = None,
                 meta: bool = False) -> None:
        if not dtype.is_floating_point:
            raise ConfigError(f"{type(dataset).__name__} samples are float tensors: ask for a float dtype "
                              f"(torch.float32, torch.float16, torch.bfloat16), not {dtype}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"num_workers must be an integer >= 0 for {type(dataset).__name__} (\"auto\" tunes the "
                              f"slot loader of SliceDataset and SlabDataset), got {num_workers!r}")
        self.dataset, self.device, self.dtype, self.meta = dataset, device, dtype, meta
        self.window = None if window is None else win.get(window)
        self._scale = _Scale(None, self.window)
        self.augment, self._bound = augment, getattr(augment, "bind", None) is None
        self.tuning = None  # as DeviceLoader's: nothing tuned here
        pin = device.type == "cuda" if pin_memory is None else pin_memory and device.type == "cuda"
        self.loader = torch.utils.data.DataLoader(
            _AtEpoch(dataset), batch_size=batch_size, sampler=_EpochOrder(dataset, sampler), drop_last=drop_last,
            num_workers=num_workers, collate_fn=_Collate(meta), pin_memory=pin,
            prefetch_factor=(2 if prefetch_factor is None else prefetch_factor) if num_workers else None,
            persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
            multiprocessing_context=multiprocessing_context)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the dataset's samples (its ``set_epoch``), of the sampler's order and of the augmentation."""
        set_dataset_epoch = getattr(self.dataset, "set_epoch", None)
        if set_dataset_epoch is not None:
            set_dataset_epoch(epoch)
        for part in (self.loader.sampler, self.augment):
            set_part_epoch = getattr(part, "set_epoch", None)
            if set_part_epoch is not None:
                set_part_epoch(epoch)

    @property
    def sampler(self) -> SampleLoader:
        """The loader itself, so Lightning's ``dataloader.sampler.set_epoch(epoch)`` reaches :meth:`set_epoch`."""
        return self

    batch_sampler = None  # Lightning looks for one beside ``sampler``; the batching is the loader's own

    def __iter__(self) -> Iterator[dict]:
        for batch in self.loader:
            affine = batch.pop("_affine", None)
            image = self._scale(batch["image"].to(self.device, torch.float32, non_blocking=True))  # the batch's own
            out = dict(batch, image=image if self.dtype == torch.float32 else image.to(self.dtype),
                       index=batch["index"].to(self.device))
            if "label" in batch:
                out["label"] = batch["label"].to(self.device, non_blocking=True)
            if self.augment is not None:
                out["image"], augmented = self._augmenter(out["image"])(out["image"], out.get("label"))
                if augmented is not None:
                    out["label"] = augmented
            yield out if affine is None else _with_meta(out, affine)

    def _augmenter(self, image: torch.Tensor) -> Augment:
        """The augmentation, bound (once) to this loader's device and the batches' spatial dims."""
        if not self._bound:
            self.augment = self.augment.bind(device=self.device, spatial_dims=image.ndim - 2,  # type: ignore[union-attr]
                                             scaled=self.window is not None)
            self._bound = True
        return self.augment  # type: ignore[return-value]  # set whenever this is called


def _with_meta(batch: dict, affine: torch.Tensor) -> dict:
    """``batch`` with image and label as batched MetaTensors carrying the samples' affines ``(B, 4, 4)``."""
    from monai.data import MetaTensor
    from monai.utils import MetaKeys, SpaceKeys

    n = len(affine)
    out = dict(batch)
    for name in ("image", "label"):
        if name in batch:
            tensor = MetaTensor(batch[name], affine=affine.to(batch[name].device),
                                meta={"medload_key": list(batch["key"]), MetaKeys.SPACE: [SpaceKeys.RAS] * n})
            tensor.is_batch = True
            out[name] = tensor
    return out

"""MONAI ``Compose`` presets for the MONAI route: ``store.items(...)`` → ``LoadImaged`` → ... → tensors.

For users who keep MONAI's dictionary pipelines (a ``CacheDataset``, their own transforms): load with
:class:`~medload.data.MedloadReader`, put the channel first, window with the preset, and (training)
augment per sample on the CPU. The fast path (:func:`medload.data.make_loader` with
:class:`~medload.data.BatchAugment`) does the same per batch on the device.

Examples:
    >>> from monai.data import Dataset, DataLoader
    >>> ds = Dataset(store.items(context=1, labels=True), transform=train_transforms("soft_tissue"))
    >>> batch = next(iter(DataLoader(ds, batch_size=2)))
    >>> batch["image"].shape, batch["label"].shape, batch["z"].tolist()   # the datasets' layout and schema
    (torch.Size([2, 3, 512, 512]), torch.Size([2, 1, 512, 512]), [0, 1])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    MapTransform,
    RandAffined,
    RandFlipd,
    RandGaussianNoised,
    RandScaleIntensityd,
    RandShiftIntensityd,
)

from medload import windows as win
from medload.config import CacheConfig
from medload.data.monai_reader import MedloadReader

__all__ = ["train_transforms", "val_transforms"]


def _load(keys: Sequence[str], window: str | win.Window, cache: CacheConfig | str | None) -> list:
    # MONAI's annotation names reader classes only; its docs (and LoadImage) take a reader instance too
    return [LoadImaged(keys=list(keys), reader=MedloadReader(cache), image_only=True),  # type: ignore[arg-type]
            EnsureChannelFirstd(keys=list(keys)),
            win.scale_intensity(window, keys=keys[0])]


def val_transforms(window: str | win.Window = "soft_tissue", keys: Sequence[str] = ("image", "label"),
                   cache: CacheConfig | str | None = None) -> Compose:
    """Load, channel first, window the image (``keys[0]``) to 0..1, tensors."""
    return Compose([*_load(keys, window, cache), EnsureTyped(keys=list(keys))])


def train_transforms(window: str | win.Window = "soft_tissue", keys: Sequence[str] = ("image", "label"),
                     spatial_dims: int = 2, cache: CacheConfig | str | None = None, seed: int = 0) -> Compose:
    """:func:`val_transforms` plus per-sample augmentation: flips, rotation/zoom (image bilinear,
    labels nearest), intensity scale/shift and noise on the image."""
    keys = list(keys)
    image = keys[0]
    modes = ["bilinear"] + ["nearest"] * (len(keys) - 1)
    rotate = (math.radians(15),) if spatial_dims == 2 else (math.radians(15),) * 3
    augment: list[MapTransform] = [RandFlipd(keys=keys, prob=0.5, spatial_axis=axis) for axis in range(spatial_dims)]
    augment += [
        RandAffined(keys=keys, prob=0.8, rotate_range=rotate, scale_range=(0.1,) * spatial_dims, mode=modes,
                    padding_mode="border"),
        RandScaleIntensityd(keys=image, factors=0.1, prob=0.5),
        RandShiftIntensityd(keys=image, offsets=0.1, prob=0.5),
        RandGaussianNoised(keys=image, std=0.02, prob=0.3),
    ]
    pipeline = Compose([*_load(keys, window, cache), *augment, EnsureTyped(keys=keys)])
    pipeline.set_random_state(seed=seed)
    return pipeline

"""The contenders of the 3D patch section (:mod:`medload.bench.patches`), each as its users train: an
endless iterator of ``(image, label)`` batches ``(B, 1, D, H, W)`` on the device, augmented.

- ``medload``: :class:`~medload.data.PatchDataset` through :func:`~medload.data.make_loader` (crops read
  by the workers, resampled with the augmentation in mm on the device, :mod:`medload.data.patch_loader`);
  the augmentation is built in one place, :func:`medload_augmentation`.
- ``nnunet``: nnU-Net v2's ``nnUNetDataLoader`` over its preprocessed blosc2 data, its initial (larger)
  patch (its ``get_patch_size`` with the trainer's arguments) and ``nnUNetTrainer.get_training_transforms`` (rotation +-30 deg, zoom 0.7-1.4, mirroring, intensity,
  noise and blur, as ``3d_fullres`` trains, without deep supervision), with 0 workers in
  ``SingleThreadedAugmenter`` or ``num_workers`` processes in ``NonDetMultiThreadedAugmenter``, as
  ``nnUNetTrainer.get_dataloaders`` does.
- ``monai_cache`` / ``monai_persistent``: ``LoadImaged`` + ``EnsureChannelFirstd`` + ``Orientationd`` (RAS)
  + ``Spacingd`` (bilinear, labels nearest) + ``SpatialPadd`` cached by ``CacheDataset`` (in RAM) or
  ``PersistentDataset`` (on disk), then ``RandCropByPosNegLabeld`` (pos 1 : neg 2, a third on the label)
  + ``RandAffined`` (rotation +-30 deg, zoom 0.7-1.4, in voxels of the isotropic grid: mm-equivalent)
  + ``RandFlipd`` per axis, with torch's DataLoader.

Spatial augmentation is nnU-Net's everywhere: rotation +-30 deg about each axis and zoom 0.7-1.4, a patch
rotated or zoomed with probability :data:`SPATIAL_P`, mirrored along each axis with probability 0.5.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from medload.bench.peers import PeerUnavailable

if TYPE_CHECKING:
    from medload.bench.patches_data import PatchPrep, PatchSettings

__all__ = ["PATCH_PEERS", "medload_augmentation", "nnunet_initial_patch", "monai_transforms", "patch_batches"]

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]
ROTATE_DEG = 30.0
"""Rotation range (+-, degrees, each axis) of every contender: nnU-Net's for isotropic 3D patches."""
ZOOM = (0.7, 1.4)
"""Zoom range of every contender: nnU-Net's."""
SPATIAL_P = 1 - 0.8**2
"""The chance that a patch is rotated or zoomed: nnU-Net's (each with probability 0.2)."""


def medload_augmentation() -> Any:
    """The augmentation of the medload row: in mm, inside the batch's resampling on the device
    (:class:`~medload.data.patch_augment.PatchAugment`), nnU-Net's ranges."""
    from medload.data.patch_augment import PatchAugment

    return PatchAugment(rotate_deg=ROTATE_DEG, zoom=ZOOM, p=SPATIAL_P, mirror=0.5)


def _forever(loader) -> Iterator[Any]:
    while True:
        yield from loader


def _medload(prep: PatchPrep, settings: PatchSettings, workers: int, device: str, samples: int) -> Batches:
    from medload.data import PatchDataset, make_loader
    from medload.storage.store import open_store

    store = open_store(prep.store)
    ds = PatchDataset(store, settings.patch, (settings.spacing,) * 3, "RAS", foreground=settings.foreground,
                      samples_per_epoch=samples, seed=0, labels=True)
    loader = make_loader(ds, batch_size=settings.batch_size, num_workers=workers, device=device, window=None,
                         augment=medload_augmentation())
    return ((batch["image"], batch["label"]) for batch in _forever(loader))


_NNUNET_ROTATION = (-math.radians(ROTATE_DEG), math.radians(ROTATE_DEG))


def nnunet_initial_patch(settings: PatchSettings) -> list[int]:
    """The patch nnU-Net's loader crops before its spatial transform (large enough for any rotation and
    zoom of it to cover the final patch): ``get_patch_size``, as ``nnUNetTrainer`` calls it."""
    from nnunetv2.training.data_augmentation.compute_initial_patch_size import get_patch_size

    r = _NNUNET_ROTATION
    return [int(n) for n in get_patch_size(list(settings.patch), r, r, r, (0.85, 1.25))]


def _nnunet(prep: PatchPrep, settings: PatchSettings, workers: int, device: str, samples: int) -> Batches:
    try:
        from batchgenerators.dataloading.nondet_multi_threaded_augmenter import NonDetMultiThreadedAugmenter
        from batchgenerators.dataloading.single_threaded_augmenter import SingleThreadedAugmenter
        from nnunetv2.training.dataloading.data_loader import nnUNetDataLoader
        from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2
        from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
        from nnunetv2.utilities.label_handling.label_handling import LabelManager
    except ImportError as exc:
        raise PeerUnavailable(f"nnunetv2 is not installed ({exc}): pip install nnunetv2") from exc
    if prep.nnunet is None:
        raise PeerUnavailable("no nnU-Net data were prepared (nnunetv2 was not installed then)")
    from medload.bench.patches_data import CLASSES

    patch, rotation = list(settings.patch), _NNUNET_ROTATION
    initial = nnunet_initial_patch(settings)
    labels = LabelManager(CLASSES, regions_class_order=None)
    transforms = nnUNetTrainer.get_training_transforms(
        patch, rotation, None, (0, 1, 2), False, use_mask_for_norm=[False], is_cascaded=False,
        foreground_labels=labels.foreground_labels, regions=None, ignore_label=None)
    loader = nnUNetDataLoader(nnUNetDatasetBlosc2(prep.nnunet), settings.batch_size, initial, patch, labels,
                              oversample_foreground_percent=settings.foreground, transforms=transforms)
    gen = (SingleThreadedAugmenter(loader, None) if workers == 0 else
           NonDetMultiThreadedAugmenter(loader, None, num_processes=workers, num_cached=max(6, workers // 2),
                                        seeds=None, pin_memory=device.startswith("cuda"), wait_time=0.002))
    try:
        for batch in gen:
            target = batch["target"]
            yield (batch["data"].to(device, non_blocking=True),
                   (target[0] if isinstance(target, list) else target).to(device, non_blocking=True))
    finally:
        getattr(gen, "_finish", lambda: None)()


def monai_transforms(settings: PatchSettings):
    """MONAI's (deterministic, random) transforms of the section (see the module docstring)."""
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        LoadImaged,
        Orientationd,
        RandAffined,
        RandCropByPosNegLabeld,
        RandFlipd,
        Spacingd,
        SpatialPadd,
    )

    keys = ["image", "label"]
    deterministic = Compose([LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Orientationd(keys=keys, axcodes="RAS"),
                             Spacingd(keys=keys, pixdim=(settings.spacing,) * 3, mode=("bilinear", "nearest")),
                             SpatialPadd(keys=keys, spatial_size=settings.patch, value=0)])
    rotate = math.radians(ROTATE_DEG)
    random = Compose([RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=settings.patch, pos=1, neg=2,
                                             num_samples=1),
                      RandAffined(keys=keys, prob=SPATIAL_P, rotate_range=(rotate,) * 3,
                                  scale_range=(ZOOM[0] - 1, ZOOM[1] - 1), mode=("bilinear", "nearest"),
                                  padding_mode="zeros"),
                      *[RandFlipd(keys=keys, prob=0.5, spatial_axis=a) for a in range(3)]])
    return deterministic, random


def _monai(kind: str):
    def contender(prep: PatchPrep, settings: PatchSettings, workers: int, device: str, samples: int) -> Batches:
        from monai.data import CacheDataset, DataLoader, PersistentDataset, list_data_collate

        deterministic, random = monai_transforms(settings)
        files = [{"image": i, "label": lab} for i, lab in prep.nifti]
        cached: Any = (CacheDataset(files, transform=deterministic, cache_rate=1.0, progress=False) if kind == "cache"
                       else PersistentDataset(files, transform=deterministic, cache_dir=Path(prep.persistent)))
        loader = DataLoader(_Patches(cached, random, samples), batch_size=settings.batch_size, num_workers=workers, shuffle=True,
                            collate_fn=list_data_collate, persistent_workers=workers > 0)
        for batch in _forever(loader):
            yield (batch["image"].as_tensor().to(device, non_blocking=True),
                   batch["label"].as_tensor().to(device, non_blocking=True))
    return contender


class _Patches(torch.utils.data.Dataset):
    """``samples`` patches: item ``i`` is the random transforms of volume ``i % len(volumes)``."""

    def __init__(self, volumes, random, samples: int) -> None:
        self.volumes, self.random, self.samples = volumes, random, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int):
        return self.random(self.volumes[i % len(self.volumes)])


PATCH_PEERS = {"medload": _medload, "nnunet": _nnunet, "monai_cache": _monai("cache"),
               "monai_persistent": _monai("persistent")}
"""Contender name -> ``(prep, settings, workers, device, samples) -> endless batches``."""


def patch_batches(name: str, prep: PatchPrep, settings: PatchSettings, workers: int, device: str,
                  samples: int) -> Batches:
    """Contender ``name``'s batches (raises :class:`PeerUnavailable` where its library is missing)."""
    return PATCH_PEERS[name](prep, settings, workers, device, samples)

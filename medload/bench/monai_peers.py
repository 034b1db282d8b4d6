"""MONAI's own pipelines as contenders of the loading benchmark (see :mod:`medload.bench.peers`).

Each is written as a MONAI user would: dictionary transforms, a torch DataLoader with default collate;
the volume caches (CacheDataset, PersistentDataset, LMDBDataset) hold ``LoadImaged`` +
``EnsureChannelFirstd`` of each series, and the sample's slices (2.5D: 3 as channels; 3D: a slab of
``depth``) and the window are taken per sample.
"""

from __future__ import annotations

import shutil
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from monai.data import CacheDataset, LMDBDataset, PersistentDataset, ThreadDataLoader
from monai.data import Dataset as MonaiDataset
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    MapTransform,
    ScaleIntensityRanged,
    ToDeviced,
)
from torch.utils.data import Dataset

from medload.bench.peers import WINDOW, device_batches

if TYPE_CHECKING:
    from medload.bench.loading_data import Prepared

__all__ = ["TakeSlicesd", "monai_load_dicom", "monai_cache_dataset", "monai_persistent_dataset",
           "monai_lmdb_dataset", "monai_gpu_cache"]


class TakeSlicesd(MapTransform):
    """Slices ``z0 .. z0+depth-1`` (``z0`` read from ``data[z_key]``) of a channel-first ``(1, X, Y, Z)``
    volume, in the layout of DICOM slices: as channels ``(depth, Y, X)`` = ``(depth, rows, columns)``
    (2.5D), or as a slab ``(1, depth, rows, columns)`` (``slab=True``, 3D)."""

    def __init__(self, keys: str | Sequence[Hashable], depth: int, slab: bool = False, z_key: str = "z0") -> None:
        super().__init__(keys)
        self.depth, self.slab, self.z_key = depth, slab, z_key

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        z0 = int(d[self.z_key])
        for key in self.key_iterator(d):
            x = d[key][0, :, :, z0 : z0 + self.depth].permute(2, 1, 0)
            d[key] = x[None] if self.slab else x
        return d


def _load() -> list:
    return [LoadImaged(keys="image", reader="PydicomReader"), EnsureChannelFirstd(keys="image")]


def _per_sample(prep: Prepared) -> Compose:
    low, high = WINDOW.bounds
    return Compose([
        TakeSlicesd(keys="image", depth=prep.depth, slab=prep.kind == "3d"),
        ScaleIntensityRanged(keys="image", a_min=low, a_max=high, b_min=0.0, b_max=1.0, clip=True),
        EnsureTyped(keys="image", data_type="tensor", track_meta=False),
    ])


class SamplesOfVolumes(Dataset):
    """Sample ``i``: the cached volume of series ``series_index[i]`` cut at ``z0[i]`` and windowed."""

    def __init__(self, volumes: Dataset, prep: Prepared) -> None:
        self.volumes, self.series_index, self.z0 = volumes, prep.series_index, prep.z0
        self.transform = _per_sample(prep)

    def __len__(self) -> int:
        return len(self.z0)

    def __getitem__(self, i: int) -> dict:
        item = self.volumes[int(self.series_index[i])]
        return self.transform({"image": item["image"], "z0": int(self.z0[i])})


def monai_load_dicom(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    data = [{"image": prep.series[s].dicom_dir, "z0": int(z)} for s, z in zip(prep.series_index, prep.z0)]
    dataset = MonaiDataset(data, transform=Compose([*_load(), *_per_sample(prep).transforms]))
    return device_batches(dataset, batch_size, num_workers, device)


def _volumes(prep: Prepared) -> list[dict]:
    return [{"image": s.dicom_dir} for s in prep.series]


def monai_cache_dataset(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    volumes = CacheDataset(_volumes(prep), transform=Compose(_load()), cache_rate=1.0, copy_cache=False,
                           progress=False)
    return device_batches(SamplesOfVolumes(volumes, prep), batch_size, num_workers, device)


def _fresh_cache(prep: Prepared, name: str):
    path = prep.cache_dir(name)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def monai_persistent_dataset(prep: Prepared, batch_size: int, num_workers: int,
                             device: str) -> Iterable[torch.Tensor]:
    volumes = PersistentDataset(_volumes(prep), transform=Compose(_load()),
                                cache_dir=_fresh_cache(prep, "monai_persistent"))
    for i in range(len(volumes)):  # fill the cache before timing: every timed pass is a later epoch
        volumes[i]
    return device_batches(SamplesOfVolumes(volumes, prep), batch_size, num_workers, device)


def monai_lmdb_dataset(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    volumes = LMDBDataset(_volumes(prep), transform=Compose(_load()), cache_dir=_fresh_cache(prep, "monai_lmdb"),
                          progress=False)  # fills the cache in the constructor; readers open in each worker
    return device_batches(SamplesOfVolumes(volumes, prep), batch_size, num_workers, device)


class _ThreadBatches:
    """Re-iterable: the ``"image"`` of each batch of a MONAI ThreadDataLoader (already on the device)."""

    def __init__(self, loader: ThreadDataLoader) -> None:
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            yield batch["image"]


def monai_gpu_cache(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    """MONAI's recipe for fast training on a GPU: CacheDataset whose cached transforms end with
    ``ToDeviced`` (the volumes stay on the GPU), a ``ThreadDataLoader`` with ``num_workers=0`` that
    cuts and windows each sample there (``num_workers`` is ignored, as the recipe sets it to 0)."""
    volumes = CacheDataset(_volumes(prep), transform=Compose([*_load(), EnsureTyped(keys="image", track_meta=False),
                                                              ToDeviced(keys="image", device=device)]),
                           cache_rate=1.0, copy_cache=False, progress=False)
    loader = ThreadDataLoader(SamplesOfVolumes(volumes, prep), batch_size=batch_size, shuffle=False,  # type: ignore[arg-type]
                              num_workers=0)
    return _ThreadBatches(loader)

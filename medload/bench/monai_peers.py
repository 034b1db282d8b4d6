"""MONAI's own pipelines as contenders of the 2.5D loading benchmark (see :mod:`medload.bench.peers`).

Each is written as a MONAI user would: dictionary transforms, a torch DataLoader with default collate;
the volume caches (CacheDataset, PersistentDataset, LMDBDataset) hold ``LoadImaged`` +
``EnsureChannelFirstd`` of each series, and the three slices and the window are taken per sample.
"""

from __future__ import annotations

import shutil
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from monai.data import CacheDataset, LMDBDataset, PersistentDataset
from monai.data import Dataset as MonaiDataset
from monai.transforms import (Compose, EnsureChannelFirstd, EnsureTyped, LoadImaged, MapTransform,
                              ScaleIntensityRanged)
from torch.utils.data import Dataset

from medload.bench.peers import WINDOW, device_batches

if TYPE_CHECKING:
    from medload.bench.loading import Prepared

__all__ = ["Take25Dd", "monai_load_dicom", "monai_cache_dataset", "monai_persistent_dataset", "monai_lmdb_dataset"]


class Take25Dd(MapTransform):
    """Slices ``z-1, z, z+1`` (``z`` read from ``data[z_key]``) of a channel-first ``(1, X, Y, Z)`` volume,
    as channels: ``(3, Y, X)`` = ``(3, rows, columns)``, the layout of a DICOM slice."""

    def __init__(self, keys: str | Sequence[Hashable], z_key: str = "z") -> None:
        super().__init__(keys)
        self.z_key = z_key

    def __call__(self, data: Mapping) -> dict:
        d = dict(data)
        z = int(d[self.z_key])
        for key in self.key_iterator(d):
            d[key] = d[key][0, :, :, z - 1 : z + 2].permute(2, 1, 0)
        return d


def _load() -> list:
    return [LoadImaged(keys="image", reader="PydicomReader"), EnsureChannelFirstd(keys="image")]


def _per_sample() -> Compose:
    low, high = WINDOW.bounds
    return Compose([
        Take25Dd(keys="image"),
        ScaleIntensityRanged(keys="image", a_min=low, a_max=high, b_min=0.0, b_max=1.0, clip=True),
        EnsureTyped(keys="image", data_type="tensor", track_meta=False),
    ])


class SamplesOfVolumes(Dataset):
    """Sample ``i``: the cached volume of series ``series_index[i]`` cut and windowed around ``z[i]``."""

    def __init__(self, volumes: Dataset, series_index: np.ndarray, z: np.ndarray) -> None:
        self.volumes, self.series_index, self.z = volumes, series_index, z
        self.transform = _per_sample()

    def __len__(self) -> int:
        return len(self.z)

    def __getitem__(self, i: int) -> dict:
        item = self.volumes[int(self.series_index[i])]
        return self.transform({"image": item["image"], "z": int(self.z[i])})


def monai_load_dicom(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    data = [{"image": prep.series[s].dicom_dir, "z": int(z)} for s, z in zip(prep.series_index, prep.z)]
    dataset = MonaiDataset(data, transform=Compose([*_load(), *_per_sample().transforms]))
    return device_batches(dataset, batch_size, num_workers, device)


def _volumes(prep: Prepared) -> list[dict]:
    return [{"image": s.dicom_dir} for s in prep.series]


def monai_cache_dataset(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    volumes = CacheDataset(_volumes(prep), transform=Compose(_load()), cache_rate=1.0, copy_cache=False,
                           progress=False)
    return device_batches(SamplesOfVolumes(volumes, prep.series_index, prep.z), batch_size, num_workers, device)


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
    return device_batches(SamplesOfVolumes(volumes, prep.series_index, prep.z), batch_size, num_workers, device)


def monai_lmdb_dataset(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    volumes = LMDBDataset(_volumes(prep), transform=Compose(_load()), cache_dir=_fresh_cache(prep, "monai_lmdb"),
                          progress=False)  # fills the cache in the constructor; readers open in each worker
    return device_batches(SamplesOfVolumes(volumes, prep.series_index, prep.z), batch_size, num_workers, device)

"""The contenders of the GPU section (:mod:`medload.bench.gpu`): each turns the section's data into
windowed float batches on the device, as its users would write it.

- ``medload`` and ``medload_augment``: :func:`medload.data.make_loader` (``num_workers`` a number or
  ``"auto"``), the second with :class:`medload.data.BatchAugment` on the device;
- ``monai_cache_dataset``: MONAI's CacheDataset (``copy_cache=False``) of the volumes and a torch
  DataLoader with pinned memory (:mod:`medload.bench.monai_peers`);
- ``monai_gpu_cache``: MONAI's GPU-cache recipe: the cached transforms end with ``ToDeviced``, so the
  volumes live on the GPU, and a ``ThreadDataLoader`` without workers cuts and windows each sample there;
- ``pydicom_files``: a torch DataLoader whose dataset reads each sample's slices, one DICOM file each,
  with pydicom, and windows them on the host.

Each takes ``(prep, batch_size, num_workers, device)`` and returns an iterable of image batches;
MONAI and pydicom are imported only by the contenders that use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from medload.bench.loading_data import Prepared
from medload.bench.peers import L1_BUDGET, WINDOW, PeerUnavailable, device_batches, window_into

__all__ = ["GPU_CONTENDERS", "medload_images", "pydicom_files"]


class _Images:
    """Re-iterable: the ``"image"`` of each batch of a medload loader (``loader``: the loader itself)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.loader:
            yield batch["image"]


def medload_images(prep: Prepared, batch_size: int, num_workers: int | str, device: str,
                   augment: bool = False) -> _Images:
    """The section's samples, in its order, from :func:`~medload.data.make_loader` on ``device``."""
    from medload.data import BatchAugment, SliceDataset, make_loader
    from medload.storage.store import open_store

    ds = SliceDataset(open_store(prep.store, cache=L1_BUDGET), context=prep.depth // 2, labels=False,
                      keys=[s.key for s in prep.series])
    position = {(ds.index.keys[s], int(z)): i for i, (s, z) in enumerate(zip(ds.index.series, ds.index.z))}
    order = [position[(prep.series[s].key, int(z) + prep.depth // 2)] for s, z in zip(prep.series_index, prep.z0)]
    return _Images(make_loader(ds, batch_size=batch_size, num_workers=num_workers, device=device, sampler=order,
                               window=WINDOW.name, drop_last=True,
                               augment=BatchAugment(device=device, seed=0) if augment else None))


def _medload_augment(prep: Prepared, batch_size: int, num_workers: int | str, device: str) -> _Images:
    return medload_images(prep, batch_size, num_workers, device, augment=True)


class DicomSlices(Dataset):
    """Sample ``i``: slices ``z0 .. z0+depth-1`` of its series, one DICOM file each, read with pydicom,
    rescaled to HU (RescaleSlope/Intercept, (0028,1053)/(0028,1052)) and windowed to float32."""

    def __init__(self, prep: Prepared) -> None:
        import pydicom

        self.files: list[list[str]] = []
        for s in prep.series:
            if s.dicom_dir is None:
                raise PeerUnavailable("no DICOM folder per series was prepared")
            headers = [(int(pydicom.dcmread(p, stop_before_pixels=True).InstanceNumber), str(p))
                       for p in Path(s.dicom_dir).iterdir() if p.is_file()]
            self.files.append([p for _, p in sorted(headers)])  # synthetic series: InstanceNumber in slice order
        self.series_index, self.z0, self.depth = prep.series_index, prep.z0, prep.depth

    def __len__(self) -> int:
        return len(self.z0)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        import pydicom

        files = self.files[int(self.series_index[i])]
        z0 = int(self.z0[i])
        planes = []
        for path in files[z0 : z0 + self.depth]:
            ds = pydicom.dcmread(path)
            hu = ds.pixel_array.astype(np.float32) * float(getattr(ds, "RescaleSlope", 1)) + float(
                getattr(ds, "RescaleIntercept", 0))
            planes.append(hu)
        hu = np.stack(planes)
        return {"image": torch.from_numpy(window_into(hu, np.empty(hu.shape, np.float32)))}


def pydicom_files(prep: Prepared, batch_size: int, num_workers: int | str, device: str) -> Iterable[torch.Tensor]:
    return device_batches(DicomSlices(prep), batch_size, int(num_workers), device)


def _monai(name: str):
    def run(prep: Prepared, batch_size: int, num_workers: int | str, device: str) -> Iterable[torch.Tensor]:
        if prep.monai_note:
            raise PeerUnavailable(prep.monai_note)
        try:
            from medload.bench import monai_peers
        except ImportError as exc:
            raise PeerUnavailable(f"MONAI is not installed ({exc})") from exc
        return getattr(monai_peers, name)(prep, batch_size, int(num_workers), device)

    run.__name__ = name
    return run


GPU_CONTENDERS = {"medload": medload_images, "medload_augment": _medload_augment,
                  "monai_cache_dataset": _monai("monai_cache_dataset"), "monai_gpu_cache": _monai("monai_gpu_cache"),
                  "pydicom_files": pydicom_files}
"""The section's contenders, in table order."""
PEERS = ("monai_cache_dataset", "monai_gpu_cache", "pydicom_files")

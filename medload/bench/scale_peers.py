"""Peers of the scale section (:mod:`medload.bench.scale`): the same CT kept the ways archives are kept,
each read the way its users read it. Every contender turns the section's random 2.5D samples (three
neighbouring slices of one series) into batches ``(B, 3, rows, columns)`` of float32 under the
soft-tissue window, like the loading section's peers (:mod:`medload.bench.peers`), whose ``npy_memmap``
and ``medload`` contenders run here too.

- ``zarr_blosc``: one zarr v3 array per series, one chunk per slice, blosc LZ4 with bit-shuffle (the
  codec medload's store uses); an item reads ``array[z0:z0 + 3]`` (three chunk files) and windows it.
- ``hdf5_chunked``: one HDF5 file per series (h5py), one uncompressed chunk per slice -- h5py's
  built-in filters decode at a fraction of blosc's speed, so the fastest HDF5 is the uncompressed one.
- ``monai_cache_thread``: MONAI's documented fast path: ``CacheDataset`` of ``LoadImaged`` +
  ``EnsureChannelFirstd`` volumes (NumpyReader on the .npy volumes) and ``ThreadDataLoader``. At this
  scale the volumes (float32, as LoadImaged returns them) do not fit in RAM, so ``cache_rate`` is what
  fits in :data:`MONAI_CACHE_BYTES`; a sample of an uncached volume loads the whole volume, which is
  what CacheDataset does with the rest.
- ``nnunet``: nnU-Net v2's own data path: each series saved with ``nnUNetDatasetBlosc2.save_case``
  (float32, chunks and blocks from ``comp_blosc2_params`` for a (3, rows, columns) patch, as its
  preprocessor does) and read by ``nnUNetDataLoader`` with that patch size (single-process, or under
  batchgenerators' ``NonDetMultiThreadedAugmenter`` with ``num_workers`` processes, as nnU-Net trains).
  It draws its own random cases and crops rather than the section's sample list: the same kind of
  samples, not the same ones. Skipped where nnunetv2 is not installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from medload.bench.peers import PeerUnavailable, device_batches, window_into

if TYPE_CHECKING:
    from medload.bench.loading_data import Prepared

__all__ = ["SCALE_PEERS", "MONAI_CACHE_BYTES", "write_zarr", "write_hdf5", "write_nnunet", "zarr_blosc",
           "hdf5_chunked", "monai_cache_thread", "nnunet"]

MONAI_CACHE_BYTES = 4 * 10**9
"""RAM the MONAI contender's CacheDataset may fill (16 times medload's 256 MB L1)."""


def _optional(module: str, extra: str):
    from importlib import import_module

    try:
        return import_module(module)
    except ImportError as exc:
        raise PeerUnavailable(f"{module.split('.')[0]} is not installed ({exc}): pip install {extra}") from exc


# ---- writing the formats, one volume (slices, rows, columns) int16 HU at a time ---------------------------
def write_zarr(path: Path, volume: np.ndarray) -> None:
    zarr = _optional("zarr", "'zarr>=3'")
    from zarr.codecs import BloscCodec

    arr = zarr.create_array(store=str(path), shape=volume.shape, dtype=volume.dtype, chunks=(1, *volume.shape[1:]),
                            compressors=BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"), overwrite=True)
    arr[:] = volume


def write_hdf5(path: Path, volume: np.ndarray) -> None:
    h5py = _optional("h5py", "h5py")
    with h5py.File(path, "w") as f:
        f.create_dataset("hu", data=volume, chunks=(1, *volume.shape[1:]))


def write_nnunet(folder: Path, case: str, volume: np.ndarray, patch: tuple[int, int, int]) -> None:
    """One case as nnU-Net's preprocessor saves it (its image as float32, an empty segmentation)."""
    nd = _optional("nnunetv2.training.dataloading.nnunet_dataset", "nnunetv2")
    data = volume[None].astype(np.float32)
    seg = np.zeros(data.shape, np.int16)
    blocks, chunks = nd.comp_blosc2_params(data.shape, patch, data.itemsize)
    seg_blocks, seg_chunks = nd.comp_blosc2_params(seg.shape, patch, seg.itemsize)
    properties = {"class_locations": {1: np.zeros((0, 4), np.int64)}, "shape_after_cropping_and_before_resampling":
                  volume.shape}
    nd.nnUNetDatasetBlosc2.save_case(data, seg, properties, str(folder / case), chunks=chunks, blocks=blocks,
                                     chunks_seg=seg_chunks, blocks_seg=seg_blocks)


# ---- per-sample readers of one format -----------------------------------------------------------------
class _Samples(Dataset):
    """Sample ``i``: slices ``z0 .. z0+2`` of series ``series_index[i]`` read by :meth:`_read`, windowed to
    float32. Files are opened lazily in the process that reads them (a DataLoader worker)."""

    def __init__(self, prep: Prepared) -> None:
        self.prep, self.series_index, self.z0, self.depth = prep, prep.series_index, prep.z0, prep.depth
        self._open: dict[int, object] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}

    def __len__(self) -> int:
        return len(self.z0)

    def _open_series(self, s: int) -> Any:
        """Series ``s`` as an array-like of ``(slices, rows, columns)`` HU (each format opens its own)."""
        raise NotImplementedError

    def _handle(self, s: int):
        if s not in self._open:
            self._open[s] = self._open_series(s)
        return self._open[s]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        z0 = int(self.z0[i])
        hu = self._handle(int(self.series_index[i]))[z0 : z0 + self.depth]
        return {"image": torch.from_numpy(window_into(hu, np.empty(hu.shape, np.float32)))}


class _ZarrSamples(_Samples):
    def _open_series(self, s: int):
        import zarr

        return zarr.open_array(self.prep.formats["zarr"] + f"/{self.prep.series[s].key}.zarr", mode="r")


class _Hdf5Samples(_Samples):
    def _open_series(self, s: int):
        import h5py

        return h5py.File(self.prep.formats["hdf5"] + f"/{self.prep.series[s].key}.h5", "r")["hu"]


def zarr_blosc(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    _optional("zarr", "'zarr>=3'")
    if "zarr" not in prep.formats:
        raise PeerUnavailable("no zarr arrays were prepared")
    return device_batches(_ZarrSamples(prep), batch_size, num_workers, device)


def hdf5_chunked(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    _optional("h5py", "h5py")
    if "hdf5" not in prep.formats:
        raise PeerUnavailable("no HDF5 files were prepared")
    return device_batches(_Hdf5Samples(prep), batch_size, num_workers, device)


# ---- MONAI: CacheDataset + ThreadDataLoader ------------------------------------------------------------
def monai_cache_thread(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    from monai.data import CacheDataset, ThreadDataLoader
    from monai.transforms import Compose, EnsureChannelFirstd, EnsureTyped, LoadImaged, ScaleIntensityRanged

    from medload.bench.peers import WINDOW

    if any(s.npy is None for s in prep.series):
        raise PeerUnavailable("no .npy volumes were prepared")
    volume_bytes = sum(s.depth for s in prep.series) * prep.rows * prep.cols * 4  # float32, as LoadImaged returns
    rate = min(1.0, MONAI_CACHE_BYTES / volume_bytes)
    load = Compose([LoadImaged(keys="image", reader="NumpyReader"),
                    EnsureChannelFirstd(keys="image", channel_dim="no_channel")])
    volumes = CacheDataset([{"image": s.npy} for s in prep.series], transform=load, cache_rate=rate, copy_cache=False,
                           progress=False)
    low, high = WINDOW.bounds
    per_sample = Compose([ScaleIntensityRanged(keys="image", a_min=low, a_max=high, b_min=0.0, b_max=1.0, clip=True),
                          EnsureTyped(keys="image", data_type="tensor", track_meta=False)])
    dataset = _CachedStacks(volumes, prep, per_sample)
    # MONAI annotates a monai.data.Dataset, but hands any torch Dataset to torch's DataLoader
    loader = ThreadDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,  # type: ignore[arg-type]
                              shuffle=False)
    return _OnDevice(loader, device)


class _CachedStacks(Dataset):
    """Sample ``i``: slices ``z0 .. z0+2`` of its cached (or freshly loaded) ``(1, slices, rows, columns)``
    volume, as channels, then the per-sample transforms."""

    def __init__(self, volumes, prep: Prepared, transform) -> None:
        self.volumes, self.series_index, self.z0, self.depth, self.transform = (
            volumes, prep.series_index, prep.z0, prep.depth, transform)

    def __len__(self) -> int:
        return len(self.z0)

    def __getitem__(self, i: int) -> dict:
        z0 = int(self.z0[i])
        volume = self.volumes[int(self.series_index[i])]["image"]
        return self.transform({"image": volume[0, z0 : z0 + self.depth]})


class _OnDevice:
    def __init__(self, loader, device: str) -> None:
        self.loader, self.device = loader, torch.device(device)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.loader:
            yield batch["image"].to(self.device, non_blocking=True)


# ---- nnU-Net v2 -----------------------------------------------------------------------------------------
class _NnunetBatches:
    """nnU-Net's batches ``(B, 1, 3, rows, columns)`` of HU, windowed to ``(B, 3, rows, columns)``."""

    def __init__(self, prep: Prepared, batch_size: int, num_workers: int, device: str) -> None:
        self.prep, self.batch_size, self.num_workers, self.device = prep, batch_size, num_workers, torch.device(device)

    def __iter__(self) -> Iterator[torch.Tensor]:
        from batchgenerators.dataloading.nondet_multi_threaded_augmenter import NonDetMultiThreadedAugmenter
        from batchgenerators.dataloading.single_threaded_augmenter import SingleThreadedAugmenter
        from nnunetv2.training.dataloading.data_loader import nnUNetDataLoader
        from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2
        from nnunetv2.utilities.label_handling.label_handling import LabelManager

        patch = (self.prep.depth, self.prep.rows, self.prep.cols)
        labels = LabelManager({"background": 0, "tissue": 1}, regions_class_order=None)
        loader = nnUNetDataLoader(nnUNetDatasetBlosc2(self.prep.formats["nnunet"]), self.batch_size, patch, patch,
                                  labels, oversample_foreground_percent=0.0)
        gen = (SingleThreadedAugmenter(loader, None) if self.num_workers == 0 else
               NonDetMultiThreadedAugmenter(loader, None, num_processes=self.num_workers,
                                            num_cached=max(6, self.num_workers // 2), seeds=None, wait_time=0.002))
        try:
            for batch in gen:
                hu = batch["data"].reshape(self.batch_size, *patch)
                out = torch.from_numpy(window_into(hu.numpy(), np.empty(hu.shape, np.float32)))
                yield out.to(self.device, non_blocking=True)
        finally:
            if hasattr(gen, "_finish"):
                gen._finish()


def nnunet(prep: Prepared, batch_size: int, num_workers: int, device: str) -> Iterable[torch.Tensor]:
    _optional("nnunetv2.training.dataloading.data_loader", "nnunetv2")
    if "nnunet" not in prep.formats:
        raise PeerUnavailable("no nnU-Net dataset was prepared")
    return _NnunetBatches(prep, batch_size, num_workers, device)


SCALE_PEERS = {"zarr_blosc": zarr_blosc, "hdf5_chunked": hdf5_chunked, "monai_cache_thread": monai_cache_thread,
               "nnunet": nnunet}
"""The scale section's own peers (besides :func:`~medload.bench.peers.npy_memmap` and medload)."""

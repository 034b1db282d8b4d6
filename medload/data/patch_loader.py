"""The fast loader of 3D patches: ``make_loader(PatchDataset(...))``.

Workers (or the trainer, with ``num_workers=0``) place each sample of a batch as ``ds[i]`` does (same seed,
epoch and draw: :meth:`PatchDataset.locate`), compose any :class:`~medload.data.patch_augment.PatchAugment`
with its affine, and read only the box of stored voxels that grid touches (:mod:`medload.data.patch_reads`:
one range read of the image, one of the label, cropped as decoded). For a GPU, a batch crosses to the
trainer as the crops as stored (int16 HU, uint8 label) padded to the batch's largest box, plus each
sample's map from patch index to box index; the trainer resamples the whole batch on its device -- one
trilinear ``grid_sample`` for the images, one gather of nearest voxels for the labels
(:mod:`medload.data.patch_device`) -- then windows and casts it. For a CPU device the workers (or the
trainer, with none) resample each sample with ``ds[i]``'s own functions before the batch crosses: there the
trainer's cores are the workers' cores, and a sample whose grid runs along its series' axes takes three
1D passes (:mod:`medload.data.separable`) rather than a 3D ``grid_sample``.

Every batch carries the epoch it was drawn for, so persistent workers follow :meth:`PatchLoader.set_epoch`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import numpy as np
import torch

from medload import windows as win
from medload.data import loader_state
from medload.data.batch_meta import meta_batch
from medload.data.buckets import ShapeBucketBatchSampler
from medload.data.lineage import loader_lineage
from medload.data.loader_types import Augment, MPContext
from medload.data.patch_augment import PatchAugment
from medload.data.patch_device import resample_batch
from medload.data.patch_geometry import source_box, voxel_to_voxel
from medload.data.patch_reads import read_box
from medload.data.patches import PatchDataset
from medload.data.resample import HU_PAD, grid_matrix
from medload.data.shared_tensors import batches_in_flight_fit
from medload.data.slots import WorkerL1, shared_l1
from medload.devices import checked_device
from medload.errors import ConfigError
from medload.lineage.record import LineageRecord
from medload.storage.records import SeriesRecord

__all__ = ["PatchLoader", "build_patch_loader"]


class _PatchBatch(list):
    """The sample indices of one batch and the epoch they are drawn for."""

    def __init__(self, indices: list[int], epoch: int) -> None:
        super().__init__(indices)
        self.epoch = epoch


class _PatchBatches(torch.utils.data.Sampler):
    """Batches of ``sampler``'s indices, each tagged with the dataset's epoch when the iteration starts."""

    def __init__(self, dataset: PatchDataset, sampler: Iterable[int], batch_size: int, drop_last: bool) -> None:
        self.dataset, self.sampler = dataset, sampler
        # one bucket (every patch has the dataset's shape): the batching a loader's state resumes (loader_state)
        self.batches = ShapeBucketBatchSampler(sampler, np.zeros(len(dataset), np.int64), batch_size, drop_last)

    def __iter__(self) -> Iterator[_PatchBatch]:
        epoch = self.dataset.epoch
        return (_PatchBatch(b, epoch) for b in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _PatchCrops(torch.utils.data.Dataset):
    """What the DataLoader sees: a batch of indices in, its crops and maps out (the module docs)."""

    def __init__(self, dataset: PatchDataset, augment: PatchAugment | None, resample: bool = False,
                 via_pipe: bool = False) -> None:
        self.dataset, self.augment, self.resample, self.via_pipe = dataset, augment, resample, via_pipe

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, batch: _PatchBatch) -> dict[str, Any]:
        ds = self.dataset
        ds.set_epoch(batch.epoch)
        records = ds.records
        placed, affines, centres, foreground, keys = [], [], [], [], []
        for i in batch:
            centre, draw, affine = ds.locate(i)
            rec = records[draw.series]
            if self.augment is not None:
                world, grid = self.augment.matrix(ds.seed, ds.epoch, i, centre, ds.patch)
                affine = world @ affine @ grid
            placed.append((rec, affine))
            affines.append(affine)
            centres.append(centre)
            foreground.append(draw.foreground)
            keys.append(rec.key)
        out: dict[str, Any] = {
            "affine": torch.from_numpy(np.stack(affines)), "centre": torch.from_numpy(np.stack(centres)),
            "foreground": torch.tensor(foreground), "index": [int(i) for i in batch], "key": keys}
        # a CPU device: each sample resampled here, in the workers when there are any, as ds[i] resamples it
        # (the trainer's cores are the workers'); a GPU: the crops, resampled a batch at a time on it
        out.update(self._resampled(placed) if self.resample else self._crops(placed))
        out["resampled"] = self.resample
        if self.via_pipe:  # arrays are pickled through the workers' pipe; tensors would take /dev/shm files
            out = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
        return out

    def _resampled(self, placed: list[tuple[SeriesRecord, np.ndarray]]) -> dict[str, Any]:
        """Each sample through :meth:`PatchDataset.read_patch`, ``ds[i]``'s own read and resampling."""
        ds = self.dataset
        images = torch.empty((len(placed), 1, *ds.patch), dtype=torch.float32)
        labels = torch.zeros((len(placed), 1, *ds.patch), dtype=_torch_dtype(ds.label_dtype)) if ds.labels else None
        for k, (rec, affine) in enumerate(placed):
            image, label = ds.read_patch(rec, affine)
            images[k, 0] = image
            if labels is not None and label is not None:
                labels[k, 0] = torch.from_numpy(label)
        return {"image": images, "label": labels}

    def _crops(self, placed: list[tuple[SeriesRecord, np.ndarray]]) -> dict[str, Any]:
        """The box of stored voxels each sample's grid touches, and its map from patch index to box index."""
        ds = self.dataset
        crops: list[np.ndarray] = []
        labels: list[np.ndarray | None] = []
        maps = []
        for rec, affine in placed:
            v2v = voxel_to_voxel(affine, rec.affine)
            box = source_box(v2v, ds.patch, rec.shape)
            if box is None:  # wholly outside its series: the padding alone
                image, label = np.empty((0, 0, 0), ds.store.plane_dtype(rec.key)), None
            else:
                image, label = read_box(ds.store, rec.key, box, ds.labels, ds.label_dtype)
                v2v[:3, 3] -= box[0]
            crops.append(image)
            labels.append(label)
            maps.append(v2v)
        image_batch, label_batch, grids = _padded(crops, labels, maps, ds.label_dtype if ds.labels else None)
        return {"image": image_batch, "label": label_batch, "grid": grids, "v2v": torch.from_numpy(np.stack(maps))}


def _padded(crops: list[np.ndarray], labels: list[np.ndarray | None], maps: list[np.ndarray],
            label_dtype: np.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The crops of a batch padded to its largest box (-1024 HU, label 0), and each sample's map into it as
    ``grid_sample``'s normalised coordinates: what the device resamples (:mod:`medload.data.patch_device`)."""
    size = np.max([c.shape for c in crops], axis=0).clip(min=1)
    image_batch = np.full((len(crops), *size), HU_PAD, dtype=np.result_type(*crops))
    label_batch = np.zeros((len(crops), *size), label_dtype) if label_dtype is not None else None
    for k, (image, label) in enumerate(zip(crops, labels)):
        s, r, c = image.shape
        image_batch[k, :s, :r, :c] = image
        if label_batch is not None and label is not None:
            label_batch[k, :s, :r, :c] = label
    grids = torch.from_numpy(np.stack([grid_matrix(v2v, size) for v2v in maps]))
    return torch.from_numpy(image_batch), None if label_batch is None else torch.from_numpy(label_batch), grids


def _worker_l1(dataset: PatchDataset, num_workers: int) -> int | None:
    """Each worker's L1 budget: the slice loaders' rule (:func:`~medload.data.slots.worker_l1`) on the
    series' decoded slices, labels included, which patches read through the same L1."""
    store = dataset.store
    label = dataset.label_dtype.itemsize if dataset.labels and dataset.label_dtype is not None else 0
    per_voxel = {r.key: np.dtype(store.plane_dtype(r.key)).itemsize + label for r in dataset.records}
    decoded = sum(int(np.prod(r.shape)) * per_voxel[r.key] for r in dataset.records)
    return shared_l1(store.cache.l1_bytes, decoded, num_workers)


def _torch_dtype(dtype: np.dtype | None) -> torch.dtype | None:
    return None if dtype is None else torch.from_numpy(np.empty(0, dtype)).dtype


def _pass_through(batch: Any) -> Any:  # the dict of _PatchCrops.__getitems__, not a list of samples
    return batch


class PatchLoader:
    """Iterates batches ``{"image": (B, 1, D, H, W) float on device (HU, or 0..1 with a window),
    "label": (B, 1, D, H, W) on device (the dataset's label dtype), "affine": (B, 4, 4) float64 (each
    patch's index to RAS mm, augmentation included), "index": int64 (B,), "key": [B series keys],
    "centre": (B, 3) float64 RAS mm, "foreground": bool (B,)}``; with ``meta=True`` image and label are
    MONAI MetaTensors carrying those affines. Built by :func:`medload.data.make_loader`.

    Examples:
        >>> loader = make_loader(PatchDataset(store, (16, 64, 64), (5.0, 2.0, 2.0), samples_per_epoch=4),
        ...                      batch_size=2, augment=PatchAugment(rotate_deg=15, zoom=(0.9, 1.1)))
        >>> batch = next(iter(loader)); batch["image"].shape, batch["label"].dtype
        (torch.Size([2, 1, 16, 64, 64]), torch.uint8)
    """

    batch_sampler = None  # Lightning looks for one beside ``sampler``; the batching is the loader's own

    def __init__(self, loader: torch.utils.data.DataLoader, dataset: PatchDataset, device: torch.device,
                 window: win.Window | None, dtype: torch.dtype, augment: Augment | None, meta: bool) -> None:
        self.loader, self.dataset, self.device, self.window, self.dtype = loader, dataset, device, window, dtype
        self.augment, self.meta = augment, meta
        self._label_dtype = _torch_dtype(dataset.label_dtype)
        self.progress = loader_state.LoaderProgress()

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s patches (and forward it to the sampler and a batch augmentation)."""
        if not loader_state.set_epoch(self, epoch):
            return  # the epoch a restored state continues: keep its place
        self.dataset.set_epoch(epoch)
        for part in (cast(_PatchBatches, self.loader.batch_sampler).sampler, self.augment):
            set_part_epoch = getattr(part, "set_epoch", None)
            if set_part_epoch is not None:
                set_part_epoch(epoch)

    @property
    def sampler(self) -> PatchLoader:
        """The loader itself, so that Lightning's ``dataloader.sampler.set_epoch(epoch)`` reaches :meth:`set_epoch`."""
        return self

    def state_dict(self) -> dict:
        """Seeds and counters that restore this loader to the batch after the last one consumed, workers'
        read-ahead not counted (:mod:`medload.data.loader_state`; the patches are drawn from ``(seed, epoch,
        i)``, so the rest of the epoch is the same patches with the same augmentation)."""
        return loader_state.capture(self)

    def load_state_dict(self, state: dict) -> None:
        """Make the next pass the rest of ``state``'s epoch, as an uninterrupted run would have drawn it."""
        loader_state.restore(self, state)

    def lineage(self, **inputs: Any) -> LineageRecord:
        """The lineage record of this loader (:mod:`medload.lineage`), as :meth:`DeviceLoader.lineage`."""
        return loader_lineage(self, **inputs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.progress.begin()
        for raw in self.loader:
            self.progress.handed += 1
            yield self.resample(raw)

    def resample(self, raw: dict[str, Any]) -> dict[str, Any]:
        """A batch as the workers send it (crops and maps) resampled, windowed and cast on the device."""
        raw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in raw.items()}  # via a pipe
        image, label = raw["image"], raw["label"]
        if not raw["resampled"]:
            move = {"device": self.device, "non_blocking": self.loader.pin_memory}
            label = None if label is None else label.to(**move)
            image, label = resample_batch(image.to(**move), label, raw["grid"].to(**move), raw["v2v"].to(**move),
                                          self.dataset.patch, self._label_dtype)
        if self.window is not None:
            lo, hi = self.window.bounds
            image.sub_(lo).mul_(1.0 / (hi - lo)).clamp_(0.0, 1.0)
        out: dict[str, Any] = {"image": image.to(self.dtype)}
        if label is not None:
            out["label"] = label
        if self.augment is not None:
            out["image"], augmented = self.augment(out["image"], out.get("label"))
            if augmented is not None:
                out["label"] = augmented
        out.update(affine=raw["affine"], index=torch.tensor(raw["index"], dtype=torch.int64, device=self.device),
                   key=raw["key"], centre=raw["centre"], foreground=raw["foreground"])
        if self.meta:
            metas = [{"medload_key": k, "filename_or_obj": f"{k}_patch{i:06d}"} for k, i in zip(raw["key"], raw["index"])]
            out = meta_batch(out, raw["affine"], metas)
        return out


def build_patch_loader(  # noqa: PLR0913 - make_loader's settings, resolved, one keyword each
        dataset: PatchDataset, batch_size: int, num_workers: int | str, device: str | torch.device, *,
        sampler: Iterable[int], window: str | win.Window | None = None, drop_last: bool = False,
        augment: Augment | PatchAugment | None = None, dtype: torch.dtype = torch.float32,
        prefetch_factor: int | None = None, persistent_workers: bool | None = None,
        multiprocessing_context: MPContext | None = None, pin_memory: bool | None = None,
        meta: bool = False) -> PatchLoader:
    """The patch loader over ``dataset`` with :func:`~medload.data.make_loader`'s settings, resolved
    (``sampler``: the order of the indices). ``augment``: a :class:`PatchAugment`, folded into the
    resampling, or a batch augmentation (``(image, label) -> (image, label)``, e.g.
    :class:`~medload.data.BatchAugment`) applied after it."""
    device = checked_device(device)
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ConfigError(f"num_workers must be an integer >= 0 for a PatchDataset, got {num_workers!r} "
                          "(\"auto\" tunes the slice and slab loaders only)")
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ConfigError(f"dtype {dtype}: patches are resampled, so their batches are float (torch.float32, "
                          "torch.float16, torch.bfloat16)")
    spatial = augment if isinstance(augment, PatchAugment) else None
    after: Augment | None = None if isinstance(augment, PatchAugment) else augment
    window = None if window is None else win.get(window)
    bind = getattr(after, "bind", None)
    if bind is not None:  # BatchAugment: the device and dims of these batches, and whether they are 0..1
        after = bind(device=device, spatial_dims=3, scaled=window is not None)
    via_pipe = bool(num_workers) and not _batches_fit(dataset, batch_size, num_workers, prefetch_factor,
                                                      resampled=device.type == "cpu", augment=spatial)
    loader = torch.utils.data.DataLoader(
        _PatchCrops(dataset, spatial, resample=device.type == "cpu", via_pipe=via_pipe), batch_sampler=_PatchBatches(dataset, sampler, batch_size, drop_last),
        num_workers=num_workers, collate_fn=_pass_through, prefetch_factor=prefetch_factor if num_workers else None,
        persistent_workers=(num_workers > 0) if persistent_workers is None else persistent_workers,
        multiprocessing_context=multiprocessing_context, worker_init_fn=WorkerL1(_worker_l1(dataset, num_workers)),
        pin_memory=device.type == "cuda" if pin_memory is None else bool(pin_memory) and device.type == "cuda")
    return PatchLoader(loader, dataset, device, window, dtype, after, meta)


def _batches_fit(dataset: PatchDataset, batch_size: int, num_workers: int, prefetch_factor: int | None,
                 resampled: bool, augment: PatchAugment | None) -> bool:
    """Whether the batches in flight fit in /dev/shm (:func:`~medload.data.shared_tensors.batches_in_flight_fit`):
    resampled on the CPU, a batch is its float patches and labels; for a GPU, its crops as stored, each at
    most :func:`_crop_bound` voxels."""
    label = dataset.label_dtype.itemsize if dataset.labels and dataset.label_dtype is not None else 0
    if resampled:
        per_batch = batch_size * int(np.prod(dataset.patch)) * (4 + label)
    else:
        per_batch = batch_size * max(_crop_bound(dataset, rec, augment) * (np.dtype(dataset.store.plane_dtype(rec.key))
                                                                           .itemsize + label) for rec in dataset.records)
    # torch keeps prefetch_factor (default 2) batches per worker in flight, and the trainer holds one
    return batches_in_flight_fit(per_batch, num_workers * (prefetch_factor or 2) + 1)


def _crop_bound(dataset: PatchDataset, rec: SeriesRecord, augment: PatchAugment | None) -> int:
    """The most voxels of series ``rec`` one patch's crop can take (:func:`source_box`: the box of the patch's
    corners in the series' index space, widened by a voxel, clipped to the series). Unaugmented, every patch of
    a series is the same grid shifted: its box is the corners' extent, plus one voxel for where the floor falls.
    Augmented, a rotation changes the extent but not the patch's longest diagonal: along index axis j the box
    is at most that diagonal, in mm and scaled by the smallest zoom, times the norm of row j of the series'
    mm-to-index map."""
    grid = dataset.grid_affine(rec, np.zeros(3))
    v2v = voxel_to_voxel(grid, rec.affine)
    corners = np.array(np.meshgrid(*[[0, n - 1] for n in dataset.patch], indexing="ij")).reshape(3, -1)
    if augment is None:
        src = v2v[:3, :3] @ corners
        extent = src.max(axis=1) - src.min(axis=1)
    else:
        mm = grid[:3, :3] @ corners
        diagonal = float(np.linalg.norm(mm[:, :, None] - mm[:, None, :], axis=0).max())
        scale = max(1.0, 1.0 / min(augment.zoom))
        to_index = v2v[:3, :3] @ np.linalg.inv(grid[:3, :3])  # RAS mm to series index, linear part
        extent = np.linalg.norm(to_index, axis=1) * diagonal * scale
    box = np.minimum(np.floor(extent).astype(np.int64) + 3, np.asarray(rec.shape))
    return int(np.prod(box))

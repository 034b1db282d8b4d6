"""Training datasets over a store: 2.5D slice stacks and 3D slabs.

Both are map-style torch datasets: ``ds[i]`` is one sample, a dict with the schema every route shares
(this one, :func:`~medload.data.make_loader`'s batches and ``Store.items`` through MONAI's
``LoadImaged(reader=MedloadReader())``):

- ``image``: a MONAI ``MetaTensor`` as stored (int16 HU, or uint8 for a stored ``plane=``); 2.5D
  ``(2k+1, rows, columns)`` -- slice z and k neighbours on each side as channels -- or 3D
  ``(1, depth, rows, columns)``. Its affine maps its own indices to RAS mm
  (:mod:`medload.data.layout`), so a prediction can be put back where it belongs.
- ``label`` (when the dataset has labels): the same affine, 2.5D ``(1, rows, columns)`` (the centre
  slice's label), 3D ``(1, depth, rows, columns)``.
- ``key``: the series key; ``z``: the sample's slice -- the centre slice of a 2.5D stack, the first slice
  of a 3D slab; ``index``: ``i``.

So ``torch.utils.data.DataLoader(ds, batch_size=4)`` and ``monai.data.DataLoader`` work as with any
dataset. The fast loader does not go through ``ds[i]``: it reads whole batches straight into shared
int16 buffers (:meth:`read_batch`) and windows them on the training device (:mod:`medload.data.loader`).

Edge policy (2.5D): near the first and last slice, missing neighbours *replicate* the edge slice, so
every slice of a series is a sample and the stack always has 2k+1 channels.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from medload import windows as win
from medload.data.index import SampleIndex, slab_index, slice_index
from medload.data.labelling import ClassMap, class_tables, returns_labels, select_labelled
from medload.data.layout import sample_affine
from medload.data.lineage import dataset_lineage
from medload.errors import ConfigError
from medload.lineage.record import LineageRecord
from medload.storage.records import SeriesRecord
from medload.storage.selection import thick_enough
from medload.storage.store import Store

__all__ = ["SliceDataset", "SlabDataset"]


class _StoreDataset(torch.utils.data.Dataset):
    """What 2.5D and 3D datasets share: the store, the sample index, planes and labels."""

    spatial_dims: int  # of a sample: 2 (2.5D stacks) or 3 (slabs)

    def __init__(self, store: Store, records: list[SeriesRecord], index: SampleIndex, *, plane: str | None,
                 labels: bool | str | None, classes: ClassMap | None = None, filters: dict[str, Any]) -> None:
        label_records = [store.labels(r.key) for r in records]
        self.store = store
        self.filters = filters  # the series filters asked for (for the lineage record)
        self._classes = classes
        self.index = index
        self.plane = None if plane is None else win.stored(plane).name
        self.labels = returns_labels(store, label_records, labels)
        if classes is not None and not self.labels:
            raise ConfigError("classes= maps stored label classes, and this dataset has no labels: pass labels='only' "
                              "to keep the labelled series")
        by_key = {r.key: r for r in records}
        self._records = [by_key[k] for k in index.keys]
        self._affines = np.stack([np.asarray(r.affine, dtype=np.float64) for r in self._records])
        self._hw = np.array([r.shape[1:] for r in self._records], dtype=np.int32)
        self.dtype = store.plane_dtype(records[0].key, self.plane)
        self._label_records = {lab.key: lab for lab in label_records if lab is not None}
        #: label value -> class name (background left out); None without labels, or where the stored
        #: numberings disagree and no class map was given (:mod:`medload.data.labelling`)
        self.class_names: dict[int, str] | None = None
        self._luts: dict[str, np.ndarray] | None = None
        if self.labels:
            self.class_names, self._luts = class_tables(list(self._label_records.values()), classes)
        self.label_dtype = (None if not self.labels else next(iter(self._luts.values())).dtype if self._luts
                            else np.result_type(*(np.dtype(lab.dtype) for lab in self._label_records.values())))
        self.foreground = self._foreground() if self.labels else None

    # ---- what each kind of sample defines (SliceDataset, SlabDataset) ------------------------------
    def _sample_foreground(self, per_slice: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Per sample starting at ``z``: whether its label has foreground, from ``per_slice``."""
        raise NotImplementedError

    def _item_shape(self, h: int, w: int) -> tuple[int, ...]:
        """The shape of one image sample of an ``h`` x ``w`` series."""
        raise NotImplementedError

    def _label_shape(self, h: int, w: int) -> tuple[int, ...]:
        """The shape of one label sample of an ``h`` x ``w`` series."""
        raise NotImplementedError

    def _span(self, rec: SeriesRecord, z: int) -> tuple[int, int]:
        """The slices ``[a, e)`` of ``rec`` that the sample at ``z`` reads."""
        raise NotImplementedError

    def _read_item(self, i: int, image: np.ndarray) -> None:
        """Sample ``i``'s image into ``image``, in the stored dtype."""
        raise NotImplementedError

    def _item_planes(self, i: int) -> list[np.ndarray]:
        """Sample ``i``'s planes as a list of (H, W) arrays."""
        raise NotImplementedError

    def _options(self) -> dict[str, Any]:
        """The arguments that shape the samples, as JSON values (for the lineage record)."""
        raise NotImplementedError

    def lineage(self, **inputs: Any) -> LineageRecord:
        """The lineage record of this dataset (:mod:`medload.lineage`): the store, each series it draws with
        its content digest (and its label map's, with labels), the arguments and filters; ``inputs`` add
        further parts (``split=``, ...). ``medload.lineage.save(record, path)`` writes it."""
        options = {"kind": type(self).__name__, **self._options(), "plane": self.plane, "labels": self.labels,
                   "classes": self._classes}
        return dataset_lineage(self.store, self.records, options, self.filters, labels=self.labels,
                               samples=len(self), **inputs)

    # ---- labels and foreground ------------------------------------------------------------------
    def _slice_foreground(self, key: str) -> np.ndarray:
        """Per slice of a series: whether its label has any foreground voxel (of a class the class map keeps)."""
        label = self._label_records[key]
        counts = np.asarray(label.foreground, dtype=np.int64).reshape(-1, max(1, len(label.classes)))
        if self._luts is not None and label.classes:
            counts = counts[:, self._luts[key][label.class_ids] > 0]
        return counts.sum(axis=1) > 0

    def _foreground(self) -> np.ndarray:
        """Per sample: whether its label has foreground (what :class:`ForegroundSampler` draws on)."""
        out = np.zeros(len(self.index), dtype=bool)
        for s, key in enumerate(self.index.keys):
            rows = np.flatnonzero(self.index.series == s)
            out[rows] = self._sample_foreground(self._slice_foreground(key), self.index.z[rows])
        return out

    def _read_label(self, rec: SeriesRecord, z0: int, z1: int, out: np.ndarray) -> None:
        """Labels of one series into ``out`` (through the class map's table, or cast when series' label
        dtypes differ)."""
        if self._luts is not None:
            out[...] = self._luts[rec.key][self.store.read_label(rec.key, z0, z1)]
        elif np.dtype(self._label_records[rec.key].dtype) == out.dtype:
            self.store.read_label(rec.key, z0, z1, out=out)
        else:
            out[...] = self.store.read_label(rec.key, z0, z1)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def records(self) -> tuple[SeriesRecord, ...]:
        """The series records, in ``index.keys`` order (``index.series`` numbers them)."""
        return tuple(self._records)

    def _sample(self, i: int) -> tuple[SeriesRecord, int]:
        return self._records[int(self.index.series[i])], int(self.index.z[i])

    def _batch_hw(self, indices: Sequence[int]) -> tuple[int, int]:
        hw = self._hw[self.index.series[np.asarray(indices)]]
        if (hw != hw[0]).any():
            sizes = sorted({tuple(x) for x in hw.tolist()})
            raise ConfigError(f"a batch mixes matrix sizes {sizes}: load the dataset with make_loader, which "
                              "batches each size apart, or filter it to one size")
        return int(hw[0, 0]), int(hw[0, 1])

    # ---- batches ----------------------------------------------------------------------------
    def batch_shapes(self, indices: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Shapes of the image and label arrays of a batch of these samples."""
        h, w = self._batch_hw(indices)
        n = len(indices)
        return (n, *self._item_shape(h, w)), ((n, *self._label_shape(h, w)) if self.labels else None)

    def max_batch_bytes(self, batch_size: int) -> int:
        """Bytes of the largest batch (image and label) this dataset can produce."""
        most = 0
        for h, w in {tuple(x) for x in self._hw.tolist()}:
            nbytes = int(np.prod(self._item_shape(h, w))) * self.dtype.itemsize
            if self.labels:
                label_dtype = cast(np.dtype, self.label_dtype)  # set whenever the dataset has labels
                nbytes += int(np.prod(self._label_shape(h, w))) * label_dtype.itemsize
            most = max(most, nbytes)
        return most * batch_size

    def read_batch(self, indices: Sequence[int], image: np.ndarray, label: np.ndarray | None) -> None:
        """Fill ``image`` (B, *item shape) and ``label`` (B, 1, ...) with the samples ``indices``.

        ``image`` holds the stored dtype (:attr:`dtype`), or a float dtype: each slice is then cast
        straight into it -- from the L1 cache's own array where it holds the slice
        (:meth:`Store.planes`), saving the copy of every slice into an int16 batch first."""
        if image.dtype == self.dtype:
            for b, i in enumerate(indices):
                self._read_item(i, image[b])
        else:
            planes = torch.from_numpy(image).view(len(indices), -1, *image.shape[-2:])
            with warnings.catch_warnings():  # the L1's arrays are read-only; they are only read here
                warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                for b, i in enumerate(indices):
                    for c, plane in enumerate(self._item_planes(i)):
                        planes[b, c].copy_(torch.from_numpy(plane))
        if label is not None:
            self.read_labels(indices, label)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Have the disk start reading the slices (and labels) of these samples now, without waiting
        (:meth:`medload.Store.prefetch`); the loader calls it for the batches it reads next."""
        samples = [self._sample(i) for i in indices]
        if not samples:
            return
        self.store.prefetch([(rec.key_bytes, *self._span(rec, z)) for rec, z in samples], plane=self.plane)
        if self.labels:
            depth = int(np.prod(self._label_shape(1, 1)[1:-2]))  # slices per label: 1 (2.5D) or the slab's depth
            self.store.prefetch_labels([(rec.key_bytes, z, z + depth) for rec, z in samples])

    def read_labels(self, indices: Sequence[int], label: np.ndarray) -> None:
        """Fill ``label`` (B, 1, ...) with the label maps of the samples ``indices``."""
        depth = int(np.prod(label.shape[1:-2]))  # slices per label: 1 (2.5D) or the slab's depth
        for b, i in enumerate(indices):
            rec, z = self._sample(i)
            self._read_label(rec, z, z + depth, label[b].reshape(depth, *label.shape[-2:]))

    def read_samples(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """Samples ``indices`` read as one batch: ``image`` (B, *item shape) in the stored dtype,
        ``label`` (B, 1, ...) when the dataset has labels, ``index`` (B,)."""
        image_shape, label_shape = self.batch_shapes(indices)
        image = np.empty(image_shape, dtype=self.dtype)
        label = None if label_shape is None else np.empty(label_shape, dtype=self.label_dtype)
        self.read_batch(indices, image, label)
        out = {"image": image, "index": np.asarray(indices, dtype=np.int64)}
        if label is not None:
            out["label"] = label
        return out

    def item_affine(self, i: int) -> np.ndarray:
        """The affine of sample ``i``: its array indices to RAS mm (:mod:`medload.data.layout`)."""
        return sample_affine(self._affines[self.index.series[i]], int(self.index.z[i]), self.spatial_dims)

    def sample_meta(self, i: int) -> dict:
        """What sample ``i``'s MetaTensors carry besides the affine: the series key and slice, and a
        ``filename_or_obj`` naming both, which MONAI's ``SaveImaged`` uses to name its output."""
        rec, z = self._sample(i)
        return {"medload_key": rec.key, "medload_z": z, "filename_or_obj": f"{rec.key}_z{z:04d}"}

    def __getitem__(self, i: int) -> dict:
        from monai.data import MetaTensor

        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a dataset of {len(self)}")
        i = int(i) % len(self)
        batch = self.read_samples([i])
        rec, z = self._sample(i)
        affine = torch.from_numpy(self.item_affine(i))
        meta = self.sample_meta(i)
        out: dict[str, Any] = {"image": MetaTensor(torch.from_numpy(batch["image"][0]), affine=affine, meta=dict(meta))}
        if self.labels:
            out["label"] = MetaTensor(torch.from_numpy(batch["label"][0]), affine=affine.clone(), meta=dict(meta))
        out.update(key=rec.key, z=z, index=i)
        return out


class SliceDataset(_StoreDataset):
    """2.5D samples: slice z with ``context`` neighbours on each side as channels, ``(2k+1, H, W)``.

    Args:
        store: an open :class:`~medload.Store`.
        context: k, neighbours on each side (0: single slices).
        plane: read a pre-windowed uint8 plane stored at ingest (``"lung"``) instead of HU.
        labels: include the centre slice's label map ``(1, H, W)``; None: when every series has one (a
            warning where only some do); ``"only"``: keep just the series that have one (the others'
            keys in ``unlabelled``, their number logged).
        classes: a class map, for label values that mean one thing in every series: ``["liver",
            "spleen"]`` (value k is the k-th stored class name, any case) or ``{"liver": ["Liver",
            "LIVER_1"], "foreground": ["Liver", "bone"]}`` (several stored classes in one: a merge, asked
            for); other stored classes become background. None: values as stored (a warning where the
            series number their classes differently). ``class_names`` says what each value is
            (:mod:`medload.data.labelling`).
        modality, kernel, thickness, keys, orientation: filters on the series (see
            :func:`~medload.storage.selection.select_series`); where none is left, the error says what
            each filter matched.

    Examples:
        >>> ds = SliceDataset(medload.open_store("stores/sample"), context=1)
        >>> ds[10]["image"].shape
        torch.Size([3, 512, 512])
    """

    spatial_dims = 2

    def __init__(self, store: Store, context: int = 1, *, plane: str | None = None, labels: bool | str | None = None,
                 classes: ClassMap | None = None, modality: str | Sequence[str] | None = None, kernel: str | Sequence[str] | None = None,
                 thickness: tuple[float, float] | None = None, keys: Sequence[str] | None = None,
                 orientation: str | Sequence[str] | None = None) -> None:
        if context < 0:
            raise ConfigError(f"context must be >= 0 neighbours, got {context}")
        filters = dict(modality=modality, kernel=kernel, thickness=thickness, keys=keys, orientation=orientation)
        records, self.unlabelled = select_labelled(store, labels, filters)
        self.context = context
        super().__init__(store, records, slice_index(records), plane=plane, labels=labels, classes=classes,
                         filters=filters)

    @property
    def channels(self) -> int:
        return 2 * self.context + 1

    def _options(self) -> dict[str, Any]:
        return {"context": self.context}

    @staticmethod
    def _sample_foreground(per_slice: np.ndarray, z: np.ndarray) -> np.ndarray:
        return per_slice[z]  # the label is the centre slice's

    def _item_shape(self, h: int, w: int) -> tuple[int, ...]:
        return (2 * self.context + 1, h, w)

    def _label_shape(self, h: int, w: int) -> tuple[int, ...]:
        return (1, h, w)

    def _edges(self, rec: SeriesRecord, z: int) -> tuple[int, int, int]:
        """The slices ``a..e-1`` a stack around z reads, and ``lo``: the channel slice a goes to (the
        channels before it, and after slice e-1, replicate the edge slices)."""
        k = self.context
        a, e = max(z - k, 0), min(z + k + 1, rec.shape[0])
        return a, e, a - (z - k)

    def _span(self, rec: SeriesRecord, z: int) -> tuple[int, int]:
        """The slices ``[a, e)`` the stack around z reads."""
        return self._edges(rec, z)[:2]

    def _read_item(self, i: int, image: np.ndarray) -> None:
        rec, z = self._sample(i)
        a, e, lo = self._edges(rec, z)
        self.store.read(rec.key, a, e, plane=self.plane, out=image[lo : lo + e - a])
        image[:lo] = image[lo]                        # replicate the first slice
        image[lo + e - a :] = image[lo + e - a - 1]   # replicate the last slice

    def _item_planes(self, i: int) -> list[np.ndarray]:
        """Sample ``i``'s channels as a list of (H, W) arrays (:meth:`Store.planes`: L1 arrays themselves,
        read-only; the edge slices repeated)."""
        rec, z = self._sample(i)
        a, e, lo = self._edges(rec, z)
        planes = self.store.planes(rec.key_bytes, a, e, plane=self.plane, transient=True)
        return [planes[0]] * lo + planes + [planes[-1]] * (self.channels - lo - (e - a))


class SlabDataset(_StoreDataset):
    """3D samples: ``depth`` consecutive slices every ``stride`` slices, ``(1, D, H, W)``.

    The last slab of each series ends at its last slice (it may overlap the previous one); series
    thinner than ``depth`` give no samples (with a warning naming how many). Arguments as
    :class:`SliceDataset`.

    Examples:
        >>> ds = SlabDataset(medload.open_store("stores/sample"), depth=16, stride=8)
        >>> len(ds), ds[0]["image"].shape     # 28 slices: slabs start at 0, 8 and 12
        (3, torch.Size([1, 16, 512, 512]))
    """

    spatial_dims = 3

    def __init__(self, store: Store, depth: int, stride: int | None = None, *, plane: str | None = None,
                 labels: bool | str | None = None, classes: ClassMap | None = None,
                 modality: str | Sequence[str] | None = None,
                 kernel: str | Sequence[str] | None = None, thickness: tuple[float, float] | None = None,
                 keys: Sequence[str] | None = None, orientation: str | Sequence[str] | None = None) -> None:
        filters = dict(modality=modality, kernel=kernel, thickness=thickness, keys=keys, orientation=orientation)
        records, self.unlabelled = select_labelled(store, labels, filters)
        records = thick_enough(records, depth)
        self.depth, self.stride = depth, stride or depth
        super().__init__(store, records, slab_index(records, depth, self.stride), plane=plane, labels=labels,
                         classes=classes, filters=filters)

    def _options(self) -> dict[str, Any]:
        return {"depth": self.depth, "stride": self.stride}

    def _sample_foreground(self, per_slice: np.ndarray, z: np.ndarray) -> np.ndarray:
        cumulative = np.concatenate([[0], np.cumsum(per_slice)])
        return cumulative[z + self.depth] - cumulative[z] > 0  # any labelled slice in the slab

    def _item_shape(self, h: int, w: int) -> tuple[int, ...]:
        return (1, self.depth, h, w)

    _label_shape = _item_shape

    def _read_item(self, i: int, image: np.ndarray) -> None:
        rec, z = self._sample(i)
        self.store.read(rec.key, z, z + self.depth, plane=self.plane, out=image[0])

    def _span(self, rec: SeriesRecord, z: int) -> tuple[int, int]:
        return z, z + self.depth

    def _item_planes(self, i: int) -> list[np.ndarray]:
        """Sample ``i``'s slices as a list of (H, W) arrays (see :meth:`SliceDataset._item_planes`)."""
        rec, z = self._sample(i)
        return self.store.planes(rec.key_bytes, z, z + self.depth, plane=self.plane, transient=True)

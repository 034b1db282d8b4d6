"""3D training patches at a target spacing and orientation, with foreground oversampling (nnU-Net's way).

:class:`PatchDataset` is a map-style dataset whose ``ds[i]`` is a patch ``(1, D, H, W)`` resampled from
one stored series onto a grid of the requested spacing and orientation (:mod:`medload.data.patch_geometry`),
centred at a point drawn for ``i``:

**The draw** (:meth:`PatchDataset.draw`), from ``numpy.random.default_rng([seed, epoch, i])`` in this
order: a series, uniformly; a coin, foreground with probability ``foreground``; then, for a foreground
draw on a series whose label has voxels of some class, a class chosen uniformly among those present and
one of its voxels chosen uniformly (nnU-Net's rule: the patch is centred on that voxel's centre);
otherwise a point uniform in the volume -- in the solid spanned by the voxel centres, so the centre is
always inside the series and uniform in mm (the affine is linear). The draw needs no pixels: the
per-slice class counts stored at ingest pick the voxel's slice and its rank on that slice, and
:meth:`PatchDataset.centre` reads that one label slice to place it. Series without labels always get
uniform centres.

**The read**: one range read of the slices the patch's extent reaches, plus the label's, cropped to the
rows and columns it reaches as they are decoded (:mod:`medload.data.patch_reads`), then trilinear
resampling of the image (float32 HU, -1024 outside the volume) and nearest neighbour of the label (0
outside) -- :mod:`medload.data.resample`. ``make_loader`` over a PatchDataset reads the same boxes in its
workers and resamples whole batches on the training device instead (:mod:`medload.data.patch_loader`).

Equal to MONAI's ``SpatialResample`` of the exported NIfTI onto the patch's affine (tests/data/test_patches.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from medload.data.labelling import returns_labels, select_labelled
from medload.data.lineage import dataset_lineage
from medload.data.patch_geometry import (
    axcode_directions,
    native_directions,
    native_spacing,
    patch_affine,
    series_index_affine,
    source_box,
    voxel_to_voxel,
)
from medload.data.patch_reads import read_box
from medload.data.resample import HU_PAD, sample_linear, sample_nearest
from medload.data.samplers import _int, _rng
from medload.data.state_version import checked, stamp
from medload.errors import ConfigError, StoreError
from medload.lineage.record import LineageRecord
from medload.storage.records import LabelRecord, SeriesRecord
from medload.storage.store import Store

__all__ = ["PatchDataset", "PatchDraw"]


@dataclass(frozen=True)
class PatchDraw:
    """Where sample ``i``'s patch is centred, as drawn (no pixels read).

    ``series``: position in :attr:`PatchDataset.records`. ``class_id``: the class of a foreground draw,
    whose centre is voxel number ``rank`` (raster order) of that class on slice ``slice``; None for a
    uniform draw, whose centre is the continuous stored index ``point`` ``(slice, row, column)``.
    """

    series: int
    class_id: int | None = None
    slice: int = 0
    rank: int = 0
    point: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def foreground(self) -> bool:
        return self.class_id is not None


class _ClassCounts:
    """A series' label counts per class: which classes are present, and the running voxel count over
    slices of each, to turn a uniform voxel number into (slice, rank)."""

    def __init__(self, label: LabelRecord | None) -> None:
        ids = label.class_ids if label is not None else []
        counts = (np.asarray(label.foreground, dtype=np.int64).reshape(-1, len(ids))
                  if label is not None and ids else np.zeros((0, 0), np.int64))
        keep = counts.sum(axis=0) > 0 if counts.size else np.zeros(0, bool)
        self.present = [c for c, k in zip(ids, keep) if k]
        self.cumulative = np.cumsum(counts[:, keep], axis=0)  # (slices, present classes)


class PatchDataset(torch.utils.data.Dataset):
    """3D patches ``(1, D, H, W)`` at a target spacing and orientation, a share of them centred on labels.

    Args:
        store: an open :class:`~medload.Store`.
        patch: ``(D, H, W)`` voxels.
        spacing: ``(z, y, x)`` mm between voxels along D, H, W; None: each series' own, the spacing of its
            axis closest to each patch axis (:func:`~medload.data.patch_geometry.native_spacing`).
        orientation: where the W, H and D axes point, ``"RAS"`` (MONAI's canonical), ``"LPS"`` (ITK's),
            any such code; None: each series' own column, row and slice directions.
        foreground: the probability that a patch is centred on a labelled voxel (nnU-Net: 0.33).
        samples_per_epoch: ``len(ds)`` (nnU-Net: 250 iterations of batch 2).
        seed: with the epoch (:meth:`set_epoch`) and ``i``, decides sample ``i`` (see the module docs).
        labels: include the ``label`` patch; None: when every series has labels; ``"only"``: keep just the
            labelled series (the others' keys in ``ds.unlabelled``), as the other datasets
            (:mod:`medload.data.labelling`). Foreground centring uses the labels of every series that has
            them either way.
        modality, kernel, thickness, keys: filters on the series (:func:`~medload.storage.selection.select_series`).

    ``ds[i]`` is a dict: ``image`` (MetaTensor float32 HU, its affine mapping ``(d, h, w)`` to RAS mm),
    ``label`` (same affine, the stored label dtype; uint16 labels as int32), ``key``, ``index``,
    ``centre`` (RAS mm, float64) and ``foreground`` (whether the centre was drawn on a label). With
    DataLoader workers, call :meth:`set_epoch` before creating each epoch's iterator (workers that persist
    keep the epoch they started with).

    Examples:
        >>> ds = PatchDataset(store, patch=(16, 64, 64), spacing=(5.0, 2.0, 2.0), samples_per_epoch=4)
        >>> sample = ds[0]
        >>> sample["image"].shape, sample["label"].shape, sample["image"].dtype
        (torch.Size([1, 16, 64, 64]), torch.Size([1, 16, 64, 64]), torch.float32)
        >>> sample["image"].affine[:3, :3].numpy()     # d: 5 mm to S, h: 2 mm to A, w: 2 mm to R
        array([[0., 0., 2.],
               [0., 2., 0.],
               [5., 0., 0.]])
    """

    def __init__(self, store: Store, patch: Sequence[int], spacing: Sequence[float] | None = None,
                 orientation: str | None = "RAS", *, foreground: float = 0.33, samples_per_epoch: int = 500,
                 seed: int = 0, labels: bool | str | None = None, modality: str | Sequence[str] | None = None,
                 kernel: str | Sequence[str] | None = None, thickness: tuple[float, float] | None = None,
                 keys: Sequence[str] | None = None) -> None:
        if len(patch) != 3:
            raise ConfigError(f"patch must be three sizes (D, H, W), got {tuple(patch)}")
        if spacing is not None and (len(spacing) != 3 or min(float(s) for s in spacing) <= 0):
            raise ConfigError(f"spacing must be positive (z, y, x) mm or None, got {tuple(spacing)}")
        if not 0.0 <= foreground <= 1.0:
            raise ConfigError(f"foreground must be a probability in [0, 1], got {foreground}")
        self.filters = dict(modality=modality, kernel=kernel, thickness=thickness, keys=keys)
        records, self.unlabelled = select_labelled(store, labels, self.filters)
        self.store = store
        self.patch = tuple(_int("patch size", n, low=1) for n in patch)
        self.spacing = None if spacing is None else tuple(float(s) for s in spacing)
        self._directions = None if orientation is None else axcode_directions(orientation)
        self.orientation = None if orientation is None else str(orientation).upper()
        self.foreground = float(foreground)
        self.samples_per_epoch = _int("samples_per_epoch", samples_per_epoch, low=1)
        self.seed = _int("seed", seed)
        self.epoch = 0
        self._records = list(records)
        label_records = [store.labels(r.key) for r in records]
        self.labels = returns_labels(store, label_records, labels, stacklevel=3)
        self._counts = [_ClassCounts(lab) for lab in label_records]
        dtypes = [np.dtype(lab.dtype) for lab in label_records if lab is not None]
        label_dtype = np.result_type(*dtypes) if self.labels else None
        self.label_dtype = None if label_dtype is None else (label_dtype if label_dtype == np.uint8 else np.dtype(np.int32))

    def __len__(self) -> int:
        return self.samples_per_epoch

    @property
    def records(self) -> tuple[SeriesRecord, ...]:
        """The series records, in the order :attr:`PatchDraw.series` numbers them."""
        return tuple(self._records)

    def lineage(self, **inputs: Any) -> LineageRecord:
        """The lineage record of this dataset (:mod:`medload.lineage`), as :meth:`SliceDataset.lineage`'s; the
        label digests are recorded where patches are centred on labels (``foreground`` above 0) or return them."""
        options = {"kind": "PatchDataset", "patch": list(self.patch), "spacing": self.spacing,
                   "orientation": self.orientation, "foreground": self.foreground,
                   "samples_per_epoch": self.samples_per_epoch, "seed": self.seed, "labels": self.labels}
        return dataset_lineage(self.store, self.records, options, self.filters,
                               labels=self.labels or self.foreground > 0, samples=len(self), **inputs)

    def set_epoch(self, epoch: int) -> None:
        """Draw the next epoch's patches (``ds[i]`` depends on ``(seed, epoch, i)``)."""
        self.epoch = _int("epoch", epoch)

    def state_dict(self) -> dict[str, Any]:
        """What decides the patches: ``{"version", "dataset", "seed", "epoch"}`` (the order and the place
        in the epoch are the sampler's state)."""
        return stamp({"dataset": type(self).__name__, "seed": self.seed, "epoch": self.epoch})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Draw the patches of ``state``'s epoch; its seed must be this dataset's."""
        state = checked(state, "dataset", type(self).__name__)
        if state["seed"] != self.seed:
            raise ConfigError(f"the state is of a PatchDataset seeded {state['seed']}, this one is seeded {self.seed}: "
                              f"build it with seed={state['seed']} to resume that run")
        self.set_epoch(state["epoch"])

    # ---- where a patch goes ---------------------------------------------------------------------
    def draw(self, i: int) -> PatchDraw:
        """Sample ``i``'s series and centre as drawn for this epoch (the rule: the module docs); no pixels."""
        rng = _rng(self.seed, self.epoch, int(i))
        s = int(rng.integers(len(self._records)))
        counts = self._counts[s]
        if rng.random() < self.foreground and counts.present:
            c = int(rng.integers(len(counts.present)))
            running = counts.cumulative[:, c]
            voxel = int(rng.integers(running[-1]))          # uniform over the class's voxels
            z = int(np.searchsorted(running, voxel, side="right"))
            return PatchDraw(s, counts.present[c], z, voxel - int(running[z - 1] if z else 0))
        extent = np.asarray(self._records[s].shape, dtype=np.float64) - 1
        point = rng.random(3) * extent
        return PatchDraw(s, point=(float(point[0]), float(point[1]), float(point[2])))

    def centre(self, i: int) -> tuple[np.ndarray, PatchDraw]:
        """Sample ``i``'s centre in RAS mm, and its draw (a foreground draw reads its one label slice)."""
        d = self.draw(i)
        rec = self._records[d.series]
        point = np.array(d.point)
        if d.class_id is not None:
            hits = np.flatnonzero(self.store.read_label(rec.key, d.slice, d.slice + 1)[0] == d.class_id)
            if d.rank >= hits.size:
                raise StoreError(f"series {rec.key[:12]}: slice {d.slice} holds {hits.size} voxels of class "
                                 f"{d.class_id}, fewer than its stored count: run `medload verify` on the store")
            point = np.array([d.slice, *divmod(int(hits[d.rank]), rec.shape[2])], dtype=np.float64)
        return (series_index_affine(rec.affine) @ np.append(point, 1.0))[:3], d

    def item_affine(self, i: int) -> np.ndarray:
        """Sample ``i``'s affine: patch index ``(d, h, w)`` to RAS mm."""
        return self.locate(i)[2]

    def locate(self, i: int) -> tuple[np.ndarray, PatchDraw, np.ndarray]:
        """Sample ``i``'s centre (RAS mm), draw and affine (patch index ``(d, h, w)`` to RAS mm)."""
        centre, d = self.centre(i)
        return centre, d, self.grid_affine(self._records[d.series], centre)

    def grid_affine(self, rec: SeriesRecord, centre: np.ndarray) -> np.ndarray:
        """The affine (patch index ``(d, h, w)`` to RAS mm) of a patch of series ``rec`` centred at ``centre``
        (RAS mm), before any augmentation."""
        directions = native_directions(rec.affine) if self._directions is None else self._directions
        spacing = self.spacing or native_spacing(rec.affine, directions)
        return patch_affine(centre, self.patch, spacing, directions)

    # ---- reading ----------------------------------------------------------------------------
    def read_patch(self, rec: SeriesRecord, affine: np.ndarray) -> tuple[torch.Tensor, np.ndarray | None]:
        """The image (float32 HU) and label (when the dataset has labels) of series ``rec`` resampled onto
        the patch grid ``affine``, from one range read of the slices it reaches."""
        v2v = voxel_to_voxel(affine, rec.affine)
        box = source_box(v2v, self.patch, rec.shape)
        if box is None:  # wholly outside the series: only padding
            image = torch.full(self.patch, HU_PAD, dtype=torch.float32)
            return image, (np.zeros(self.patch, self.label_dtype) if self.labels else None)
        stored, stored_label = read_box(self.store, rec.key, box, self.labels)
        image = sample_linear(stored, v2v, self.patch, box[0])
        if stored_label is None:
            return image, None
        return image, sample_nearest(stored_label, v2v, self.patch, box[0]).astype(self.label_dtype, copy=False)

    def __getitem__(self, i: int) -> dict:
        from monai.data import MetaTensor

        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a dataset of {len(self)}")
        i = int(i) % len(self)
        centre, d, affine = self.locate(i)
        rec = self._records[d.series]
        image, label = self.read_patch(rec, affine)
        meta = {"medload_key": rec.key, "filename_or_obj": f"{rec.key}_patch{i:06d}"}
        out: dict[str, Any] = {"image": MetaTensor(image[None], affine=torch.from_numpy(affine), meta=dict(meta))}
        if label is not None:
            out["label"] = MetaTensor(torch.from_numpy(label[None]), affine=torch.from_numpy(affine), meta=dict(meta))
        out.update(key=rec.key, index=i, centre=torch.from_numpy(centre), foreground=d.foreground)
        return out

"""A PyTorch Lightning ``LightningDataModule`` over a store: ``Trainer.fit(model, datamodule=...)``.

:class:`StoreDataModule` splits the store's series into training and validation sets by patient
(:func:`split_patients`: no patient in both, the same split for the same seed), builds a
:class:`~medload.data.SliceDataset` (2.5D), :class:`~medload.data.SlabDataset` (3D slabs) or
:class:`~medload.data.PatchDataset` (3D patches at a target spacing and orientation) for each, and hands
Lightning :func:`~medload.data.make_loader` loaders: batches are read, windowed and augmented by the fast
path, on the trainer's device. Lightning calls ``set_epoch`` on them every epoch, so each epoch draws a
new (seeded) order. With a trainer, the training loader's lineage record (:mod:`medload.lineage`: the series
it draws, their digests, the split, sampler, seeds and augmentation) is written beside the checkpoints, as
``medload_lineage.json`` in the ``ModelCheckpoint`` folder (``lineage_path``). Needs the ``lightning`` extra: ``pip install medload[lightning]``.

Examples:
    >>> import lightning
    >>> from medload.lightning import StoreDataModule
    >>> data = StoreDataModule("stores/sample", context=1, batch_size=8, window="soft_tissue")  # doctest: +SKIP
    >>> lightning.Trainer(max_epochs=10).fit(model, datamodule=data)                           # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from medload.config import FROM_CONFIG, FromConfig, LoaderConfig, choose
from medload.data import (
    AugmentConfig,
    BatchAugment,
    DistributedPatientSampler,
    ForegroundSampler,
    PatchDataset,
    SeriesGroupedSampler,
    SlabDataset,
    SliceDataset,
    UniformSampler,
    make_loader,
)
from medload.data.index import slice_index
from medload.data.labelling import check_labels_choice
from medload.data.splits import PatientSplit, split_patients
from medload.data.state_version import checked, stamp
from medload.errors import ConfigError
from medload.extras import require
from medload.lineage.record import save
from medload.storage.selection import select_series
from medload.storage.store import Store, open_store

require("lightning", "lightning", "medload.lightning (a LightningDataModule)")
import lightning  # noqa: E402

__all__ = ["PatientSplit", "split_patients", "StoreDataModule"]

_SAMPLERS: dict[str, type[UniformSampler | ForegroundSampler | SeriesGroupedSampler | DistributedPatientSampler]] = {
    "uniform": UniformSampler, "foreground": ForegroundSampler, "grouped": SeriesGroupedSampler,
             "distributed": DistributedPatientSampler}


class StoreDataModule(lightning.LightningDataModule):
    """Training and validation loaders over a store, split by patient, for ``lightning.Trainer``.

    Args:
        store: a store path or an open :class:`~medload.Store`.
        context: 2.5D samples with ``context`` neighbours on each side as channels (the default, 1).
        depth, stride: 3D slabs of ``depth`` slices every ``stride`` (default ``depth``) instead.
        patch, spacing, axcodes, foreground, patches_per_epoch: 3D patches instead
            (:class:`~medload.data.PatchDataset`): ``patch`` ``(D, H, W)`` voxels at ``spacing`` ``(z, y, x)``
            mm (None: each series' own) along ``axcodes`` (PatchDataset's ``orientation``: ``"RAS"``, the
            default; None: each series' own), ``foreground`` of them centred on a labelled voxel (default
            0.33), ``patches_per_epoch`` training patches an epoch (default: nnU-Net's 250 batches). Each
            training index is a fresh seeded draw, new every epoch. Validation is a fixed set of patches of
            the validation series -- the epoch-0 draw of a dataset of ``patches_per_epoch * val_fraction``
            patches (at least one batch), the same every epoch, so epochs compare -- with the same
            ``foreground`` share; whole-series sliding-window Dice is
            :func:`~medload.data.predict_series`'s (as ``pipelines/train_segmentation.py --patch`` does).
            ``sampler`` is ``"uniform"`` (the draws in index order) or ``"distributed"`` (rank r takes
            indices r, r + world, ...); no ``classes=`` or ``plane=``.
        labels: None (the default): the selected series that have labels (``"only"``: the others are left
            out, their number logged) when any has them, so every batch of a segmentation has a
            ``"label"``; no labels where none has them. True, False or ``"only"``: as the datasets take it.
        classes: a class map for the label values (``["liver", "spleen"]``, or ``{"foreground": ["Liver",
            "bone"]}`` to merge on purpose): see :class:`~medload.data.SliceDataset`.
        plane, modality, kernel, thickness, keys, orientation: passed to the datasets (``keys`` filters the
            series before the split).
        batch_size, num_workers, window: as in :func:`~medload.data.make_loader` (default: ``config``'s, else
            8, 0 and no window).
        augment: for training batches: True (the default :class:`~medload.data.AugmentConfig`), an
            ``AugmentConfig``, or a callable ``(image, label) -> (image, label)``; None: no augmentation.
        sampler: the training order: ``"uniform"``, ``"foreground"`` (needs labels), ``"grouped"`` (one
            series at a time) or ``"distributed"`` (by patient, one share per rank: needed with more than
            one process; validation is then split over the ranks too, each sample once); or a callable
            taking the training dataset and returning a sampler. Named samplers use ``seed``.
        val_fraction: fraction of the patients held out for validation (0: no validation loader).
        seed: of the split, the training order and the augmentation.
        device: where batches are made; None: the trainer's device (the CPU without a trainer).
        loader_options: further :func:`~medload.data.make_loader` arguments (``dtype``, ``prefetch_factor``...).
        config: a :class:`~medload.config.LoaderConfig` (e.g. ``load_config(path).loader``, the ``[loader]``
            table) for both loaders; the keywords above and ``loader_options`` win over it. Its order is the
            sampler's (``sampler=``, ``seed=``).

    After ``setup()``: ``split`` (a :class:`PatientSplit`), ``train_dataset`` and ``val_dataset`` (None
    without validation); once a trainer asked for the training loader, ``lineage_path``: where its lineage
    record went (None without a trainer that saves checkpoints, and on ranks other than 0).

    Examples:
        >>> data = StoreDataModule("stores/ct", depth=32, stride=16, sampler="distributed", window="soft_tissue",
        ...                        batch_size=2, num_workers=4, augment=True)                   # doctest: +SKIP
        >>> lightning.Trainer(devices=4, strategy="ddp").fit(model, datamodule=data)             # doctest: +SKIP
        >>> len(data.split.val), len(data.train_dataset)                                         # doctest: +SKIP
        (41, 11250)
    """

    def __init__(  # noqa: PLR0913 - the data module's public keywords: make_loader's and the datasets'
            self, store: str | os.PathLike | Store, *, context: int | None = None, depth: int | None = None,
            stride: int | None = None, plane: str | None = None, labels: bool | str | None = None,
            classes=None, modality: str | Sequence[str] | None = None, kernel: str | Sequence[str] | None = None,
            thickness: tuple[float, float] | None = None, keys=None,
            orientation: str | Sequence[str] | None = None, batch_size: int | FromConfig = FROM_CONFIG,
            num_workers: int | str | FromConfig = FROM_CONFIG, window=FROM_CONFIG,
            augment: bool | AugmentConfig | Callable | None = None,
            sampler: str | Callable = "uniform", val_fraction: float = 0.2, seed: int = 0,
            device=None, loader_options: Mapping | None = None, config: LoaderConfig | None = None,
            patch: Sequence[int] | None = None, spacing: Sequence[float] | None = None, axcodes: str | None = "RAS",
            foreground: float = 0.33, patches_per_epoch: int | None = None) -> None:
        super().__init__()
        if sum(x is not None for x in (context, depth, patch)) > 1:
            raise ConfigError("pass one of context= (2.5D slices), depth= (3D slabs) or patch= (3D patches), not both")
        if patch is not None and (classes is not None or plane is not None):
            raise ConfigError("patch= gives the stored label values and HU: drop classes= and plane=")
        if patch is not None and sampler not in ("uniform", "distributed"):
            raise ConfigError(f"patch= draws its own patches: sampler='uniform' or 'distributed', not {sampler!r}")
        if depth is None and stride is not None:
            raise ConfigError("stride= steps 3D slabs: pass depth= with it")
        if not (augment is None or isinstance(augment, (bool, AugmentConfig)) or callable(augment)):
            raise ConfigError(f"augment must be True, an AugmentConfig or a callable (image, label) -> (image, label); "
                              f"got {augment!r}")
        if not (callable(sampler) or isinstance(sampler, str) and sampler in _SAMPLERS):
            raise ConfigError(f"sampler must be one of {', '.join(_SAMPLERS)} or a callable taking the training "
                              f"dataset; got {sampler!r}")
        if config is not None and not isinstance(config, LoaderConfig):
            raise ConfigError(f"config must be a LoaderConfig (medload.config), got {type(config).__name__}")
        self.store = store
        self.context = 1 if context is None and depth is None and patch is None else context
        self.depth, self.stride = depth, stride
        self.patch_options: dict[str, Any] | None = None if patch is None else {
            "patch": patch, "spacing": spacing, "orientation": axcodes, "foreground": foreground}
        self.patches_per_epoch = patches_per_epoch
        check_labels_choice(labels)
        self.dataset_options: dict[str, Any] = {"plane": plane, "labels": labels, "classes": classes,
                                                "modality": modality, "kernel": kernel, "thickness": thickness,
                                                "orientation": orientation}
        self.keys = keys
        self.loader_config = LoaderConfig() if config is None else config
        self.batch_size = choose(batch_size, self.loader_config.batch_size, 8)
        no_workers: int | str = 0  # the default, typed as the setting (which may be "auto")
        self.num_workers = choose(num_workers, self.loader_config.num_workers, no_workers)
        self.window = choose(window, self.loader_config.window, None)
        self.augment, self.sampler, self.val_fraction, self.seed = augment, sampler, val_fraction, seed
        self.device, self.loader_options = device, dict(loader_options or {})
        self._train_loader: Any = None  # the last training loader built, whose state a checkpoint keeps
        self._train_state: dict[str, Any] | None = None  # a restored state for the next training loader
        self.split: PatientSplit | None = None
        self.train_dataset: SliceDataset | SlabDataset | PatchDataset | None = None
        self.val_dataset: SliceDataset | SlabDataset | PatchDataset | None = None
        self.lineage_path: Path | None = None

    def setup(self, stage: str | None = None) -> None:
        """Open the store, split its patients and build the datasets (once; later calls keep them)."""
        if self.split is not None:
            return
        if not isinstance(self.store, Store):
            self.store = open_store(self.store)
        if self.dataset_options["labels"] is None:  # the labelled series, where the selection has any
            self.dataset_options["labels"] = "only" if self._any_labelled() else False
        everything = self._dataset(self.keys)
        index = slice_index(everything.records) if isinstance(everything, PatchDataset) else everything
        self.split = split_patients(index, self.val_fraction, self.seed)
        self.train_dataset = self._dataset(self.split.train)
        self.val_dataset = self._dataset(self.split.val, validation=True) if self.split.val else None

    def train_dataloader(self):
        """Training batches in the chosen sampler's order, new each epoch (Lightning calls ``set_epoch``);
        after :meth:`load_state_dict`, from where the checkpointed run stopped."""
        ds = self._built(self.train_dataset)
        loader = make_loader(ds, self.batch_size, self.num_workers, self._device(), window=self.window,
                             sampler=self._train_sampler(ds), augment=self._augment(), config=self.loader_config,
                             **self.loader_options)
        if self.trainer is not None:  # count the steps Lightning ran, whatever its fetcher has taken ahead
            loader.progress.consumed = self._batches_processed
        if self._train_state is not None:
            loader.load_state_dict(self._train_state)
            self._train_state = None
        self._train_loader = loader
        self._write_lineage(loader)
        return loader

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the data (Lightning saves it with the model): the training loader's
        state (:mod:`medload.data.loader_state`) -- seeds and counters -- so that ``Trainer.fit(...,
        ckpt_path=...)`` of a run stopped mid-epoch resumes at the batch after the last step it saved."""
        loader = self._train_loader
        return stamp({"datamodule": type(self).__name__, "seed": self.seed,
                      "train_loader": None if loader is None else loader.state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the training loader from ``state`` (from :meth:`state_dict`) when it is next built; on another
        number of processes, the rest of the epoch is re-partitioned by patient (``sampler="distributed"``)."""
        state = checked(state, "datamodule", type(self).__name__)
        if state["seed"] != self.seed:
            raise ConfigError(f"the checkpoint's data module was seeded {state['seed']}, this one {self.seed}: pass "
                              f"seed={state['seed']} to resume that run")
        self._train_state = state["train_loader"]
        if self._train_loader is not None and self._train_state is not None:
            self._train_loader.load_state_dict(self._train_state)
            self._train_state = None

    def _batches_processed(self) -> int:
        """Batches of this epoch the trainer's steps have taken (Lightning's count: 2.4-2.6 fetch a loader with
        a length only as its steps ask, but one without a length a batch ahead)."""
        progress: Any = cast(lightning.Trainer, self.trainer).fit_loop.epoch_loop.batch_progress.current
        return progress.processed

    def val_dataloader(self):
        """Validation batches in index order (no validation patients: an empty list, which Lightning skips)."""
        ds = self._built(self.val_dataset)
        if ds is None:
            return []
        sampler = None
        if isinstance(ds, PatchDataset):
            return _SameEveryEpoch(make_loader(ds, self.batch_size, self.num_workers, self._device(),
                                               window=self.window, sampler=self._patch_order(ds),
                                               config=self.loader_config, **self.loader_options))
        if self.sampler == "distributed":
            rank, world_size = self._ranks()
            sampler = DistributedPatientSampler.from_dataset(ds, rank=rank, world_size=world_size, seed=self.seed,
                                                             shuffle=False, even="none")
        return make_loader(ds, self.batch_size, self.num_workers, self._device(), window=self.window,
                           shuffle=False, sampler=sampler, config=self.loader_config, **self.loader_options)

    # ---- helpers ----------------------------------------------------------------------------------
    def _write_lineage(self, loader) -> None:
        """The training loader's lineage record, with the split, into the checkpoint folder (rank 0 only)."""
        trainer = self.trainer
        checkpoints = None if trainer is None else getattr(trainer.checkpoint_callback, "dirpath", None)
        if trainer is None or not trainer.is_global_zero or checkpoints is None:  # no checkpoints, no record
            return
        folder = Path(checkpoints)
        folder.mkdir(parents=True, exist_ok=True)
        split = cast(PatientSplit, self.split)
        self.lineage_path = save(loader.lineage(split={"by": "patient", "val_fraction": self.val_fraction,
                                                       "seed": self.seed, "val": sorted(split.val)}),
                                 folder / "medload_lineage.json")

    def _dataset(self, keys, validation: bool = False) -> SliceDataset | SlabDataset | PatchDataset:
        store = self.store
        if not isinstance(store, Store):
            raise ConfigError("call setup() first (Trainer.fit does): it opens the store")
        if self.patch_options is not None:
            return self._patches(store, keys, validation)
        if self.depth is not None:
            return SlabDataset(store, self.depth, self.stride, keys=keys, **self.dataset_options)
        # without depth, __init__ set context (1 by default)
        return SliceDataset(store, cast(int, self.context), keys=keys, **self.dataset_options)

    def _patches(self, store: Store, keys, validation: bool) -> PatchDataset:
        """The patches of the selected series (the plane filter, which PatchDataset lacks, resolved to keys)."""
        options = self.dataset_options
        filters = {k: options[k] for k in ("modality", "kernel", "thickness", "orientation")}
        chosen = [r.key for r in select_series(store.series(), keys=keys, **filters)]
        if not chosen:
            raise ConfigError(f"the series filters ({filters}, keys={keys}) select none of the store's series")
        batch_size = self.batch_size if isinstance(self.batch_size, int) else 2
        per_epoch = self.patches_per_epoch or 250 * batch_size  # nnU-Net: 250 iterations an epoch
        count = max(batch_size, round(per_epoch * self.val_fraction)) if validation else per_epoch
        grid = cast(dict, self.patch_options)
        return PatchDataset(store, grid["patch"], grid["spacing"], grid["orientation"], foreground=grid["foreground"],
                            samples_per_epoch=count, seed=self.seed, labels=options["labels"], keys=chosen)

    def _patch_order(self, ds: PatchDataset) -> range:
        """The patches this process reads: all of them, or under ``sampler="distributed"`` every world-th."""
        rank, world_size = self._ranks() if self.sampler == "distributed" else (0, 1)
        return range(rank or 0, len(ds), world_size or 1)

    def _any_labelled(self) -> bool:
        """Whether any series the filters select has labels."""
        store = cast(Store, self.store)
        filters = {k: self.dataset_options[k] for k in ("modality", "kernel", "thickness", "orientation")}
        return any(store.labels(r.key) is not None for r in select_series(store.series(), keys=self.keys, **filters))

    def _built(self, dataset):
        """``dataset`` once ``setup()`` has run, and the sampler fits the trainer's processes."""
        if self.split is None:
            raise ConfigError("call setup() first (Trainer.fit does): it splits the store into the datasets")
        world_size = self._ranks()[1]
        if isinstance(self.sampler, str) and self.sampler != "distributed" and (world_size or 1) > 1:
            raise ConfigError(f"the trainer runs {world_size} processes and sampler={self.sampler!r} would give "
                              "each the same samples: pass sampler='distributed'")
        return dataset

    def _ranks(self) -> tuple[int | None, int | None]:
        """(rank, world_size) of the attached trainer; (None, None) without one: torch.distributed's."""
        if self.trainer is None:
            return None, None
        return self.trainer.global_rank, self.trainer.world_size

    def _device(self):
        if self.device is not None:
            return self.device
        return self.trainer.strategy.root_device if self.trainer is not None else "cpu"

    def _train_sampler(self, ds):
        if isinstance(ds, PatchDataset):
            return self._patch_order(ds)
        if callable(self.sampler):
            return self.sampler(ds)
        if self.sampler == "distributed":
            rank, world_size = self._ranks()
            return DistributedPatientSampler.from_dataset(ds, rank=rank, world_size=world_size, seed=self.seed,
                                                          even="pad")
        return _SAMPLERS[self.sampler].from_dataset(ds, seed=self.seed)

    def _augment(self):
        if self.augment is None or self.augment is False or callable(self.augment):
            return self.augment or None
        config = AugmentConfig() if self.augment is True else self.augment
        return BatchAugment(config, device=self._device(), seed=self.seed,
                            spatial_dims=2 if self.depth is None and self.patch_options is None else 3)


class _SameEveryEpoch:
    """A loader whose epoch stays as it is: no ``sampler`` for Lightning's ``set_epoch`` to reach (the
    validation patches, drawn once)."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

"""Where a training loop's time goes, stage by stage, measured on the real loader.

``with profile(loader) as prof:`` around a training loop (entered before the ``for``) times:

- **trainer stages**, in the training process, as consecutive intervals of one clock, so they add up
  to the wall time of the loop: ``start`` (starting the workers), ``wait`` (the step waiting for the
  next batch), ``copy`` (host to device: the label and, on CUDA, the image through pinned memory),
  ``window`` (cast to float and window on the device; on the CPU this is also the image's copy out of
  its slot), ``augment`` (the ``augment=`` callable) and ``step`` (the caller's code between batches:
  the training step). ``outside`` is the rest of the ``with`` block's wall time (model set-up, time
  between epochs). On CUDA the clock synchronises the device at each stage boundary (only while
  profiling), so device work is charged to the stage that queued it.
- **worker stages**, where each batch is read, and sent back with the batch's slot number: ``read_l1``
  (slices served by the in-process LRU, and filling it), ``read_l2`` / ``read_l3`` (LMDB range scans
  on the hot copy or the store, checksums included), ``decode`` (codec decompression) and ``collate``
  (the rest of building the batch in its slot: shapes, edge replication). The loader has no CPU
  transforms: windowing happens on the device -- except with ``num_workers=0`` on the CPU, where each
  slice is cast and windowed as it is read (into the float batch, not a slot), and ``collate``
  includes that work. With ``num_workers=0`` these stages run inside ``wait``; with workers they run
  alongside the trainer and are reported as busy time per worker.

The read path is timed by a read observer on the dataset's store (:meth:`medload.Store.observe`,
:mod:`medload.data.read_probe`) in the processes that read, only while a profile runs: a loader that is
never profiled pays one flag check per batch.

The layers: :mod:`medload.data.read_probe` (the observer, below the loader), :mod:`medload.data.stage_times`
(:func:`profile` and :class:`ProfileReport`, which ``num_workers="auto"`` measures with), and here, above
:func:`~medload.data.make_loader`, :func:`profile_training`; this module hands out all of them.

Examples:
    >>> loader = make_loader(SliceDataset(store), batch_size=8, num_workers=2)  # doctest: +SKIP
    >>> with profile(loader) as prof:   # doctest: +SKIP
    ...     for batch in loader:
    ...         train_step(batch)
    >>> print(prof.report().verdict())   # doctest: +SKIP
    input-bound: 71% of the training loop getting data; biggest stage: decode (38%)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from medload.config import FROM_CONFIG, FromConfig, LoaderConfig, choose
from medload.data.augment import BatchAugment
from medload.data.autotune import LoaderTuning
from medload.data.datasets import SliceDataset
from medload.data.device_loader import DeviceLoader
from medload.data.loader import make_loader
from medload.data.read_probe import timed_batch
from medload.data.stage_times import (
    STAGE_LABELS,
    TIERS,
    TRAINER_STAGES,
    WORKER_STAGES,
    Profile,
    ProfileReport,
    profile,
)
from medload.errors import ConfigError
from medload.models import TrainStep, segmentation_unet

if TYPE_CHECKING:
    from medload.storage.store import Store

__all__ = ["profile", "profile_training", "Profile", "ProfileReport", "timed_batch", "STAGE_LABELS",
           "TRAINER_STAGES", "WORKER_STAGES", "TIERS"]


#: what :func:`profile_training` (and ``medload profile``) take where no keyword or config gives the setting
BATCH_SIZE: int = 4
NUM_WORKERS: int | str = 0
WINDOW: str | None = "soft_tissue"


def profile_training(store: Store, *, batch_size: int | FromConfig = FROM_CONFIG, num_workers: int | str | FromConfig = FROM_CONFIG,
                     steps: int = 20, window: str | None | FromConfig = FROM_CONFIG, context: int = 1,
                     device: str | torch.device = "cpu", model: str = "small", augment: bool = False, seed: int = 0,
                     config: LoaderConfig | None = None) -> tuple[ProfileReport, LoaderTuning | None]:
    """Profile ``steps`` training steps of the 2.5D pipeline on ``store`` (what ``medload profile`` runs):
    :class:`~medload.data.SliceDataset` -> :func:`~medload.data.make_loader` (optionally
    :class:`~medload.data.BatchAugment`) -> the UNet step of ``pipelines/train_segmentation.py``
    (``model="small"`` or ``"full"``; ``"none"`` times the loader alone). The target is the label
    where the store has labels, else the voxels at the top of the window. Returns the report and the
    loader's ``tuning`` (what ``num_workers="auto"`` chose, or None).

    The loader's settings: each keyword given, else ``config``'s (a :class:`~medload.config.LoaderConfig`:
    its dtype, prefetch, pinning... too), else batches of 4, no workers, the ``soft_tissue`` window.

    Examples:
        >>> report, _ = profile_training(medload.open_store("stores/sample"), steps=10)   # doctest: +SKIP
        >>> report.verdict()   # doctest: +SKIP
        'compute-bound: 83% of the training loop in the training step; biggest input stage: cast + window (9%)'
    """
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    device = torch.device(device)
    dataset = SliceDataset(store, context=context)
    cfg = config or LoaderConfig()
    loader = cast(DeviceLoader, make_loader(  # a SliceDataset's: the slot loader
        dataset, choose(batch_size, cfg.batch_size, BATCH_SIZE), choose(num_workers, cfg.num_workers, NUM_WORKERS),
        device, window=choose(window, cfg.window, WINDOW), shuffle=True, seed=seed,
        augment=BatchAugment(device=device, seed=seed) if augment else None, config=cfg))
    train = None if model == "none" else TrainStep(segmentation_unet(2, dataset.channels, small=model == "small")
                                                   .to(device))
    done, epoch = 0, 0
    with profile(loader) as prof:
        while done < steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if train is not None:
                    target = batch["label"] > 0 if "label" in batch else batch["image"][:, context:context + 1] >= 1.0
                    train(batch["image"].float(), target.float())
                done += 1
                if done == steps:
                    break
            epoch += 1
    return prof.report(), loader.tuning


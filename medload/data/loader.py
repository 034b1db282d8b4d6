"""The fast path from a store to windowed float batches on the training device: :func:`make_loader`.

The loader is built in layers, each importing only those below it:

- :mod:`medload.data.loader_types`: the types the layers share, below everything (``LoaderDataset``: what
  the loader needs of a dataset);
- :mod:`medload.data.read_probe`: the profiler's read observer on the store;
- :mod:`medload.data.slots`: where batches are read -- straight into slots of a shared buffer (the design
  and what it gained are told there);
- :mod:`medload.data.device_loader`: the trainer's side, :class:`DeviceLoader`;
- :mod:`medload.data.build`: :func:`~medload.data.build.build_loader`, a loader from concrete settings;
- :mod:`medload.data.sample_loader`: beside them, the loader of datasets read one sample at a time
  (``ds[i]``, no ``read_batch``: :class:`~medload.data.PatchDataset`), which ``make_loader`` hands them to;
- :mod:`medload.data.stage_times` and :mod:`medload.data.autotune`: the stage clock, and
  ``num_workers="auto"``, which measures through ``build_loader``;
- here, :func:`make_loader`: its keywords and a :class:`~medload.config.LoaderConfig` resolved into
  concrete settings, ``"auto"`` tuned, then ``build_loader``;
- :mod:`medload.data.profile`: ``profile_training``, above it all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from medload import windows as win
from medload.config import FROM_CONFIG, FromConfig, LoaderConfig, choose
from medload.data.autotune import tune_loader
from medload.data.build import build_loader, check_settings, ordered
from medload.data.device_loader import DeviceLoader
from medload.data.loader_types import Augment, LoaderDataset, MPContext
from medload.data.sample_loader import SampleDataset, SampleLoader, reads_batches
from medload.data.slots import READ_AHEAD_BATCHES, slot_count, worker_l1
from medload.data.slots import _Batch as _Batch  # the old import path of the batch type (tests)
from medload.data.slots import _SlotBatchSampler as _SlotBatchSampler  # and of the batch sampler
from medload.devices import checked_device
from medload.errors import ConfigError

__all__ = ["make_loader", "DeviceLoader", "loader_settings", "slot_count", "worker_l1", "READ_AHEAD_BATCHES"]


def make_loader(  # noqa: PLR0913 - the public keyword API of the loader, kept for compatibility
        dataset: LoaderDataset | SampleDataset, batch_size: int | FromConfig = FROM_CONFIG,
        num_workers: int | str | FromConfig = FROM_CONFIG, device: str | torch.device = "cpu", *,
        window: str | win.Window | None | FromConfig = FROM_CONFIG, shuffle: bool = False,
        sampler: Iterable[int] | None = None, drop_last: bool | FromConfig = FROM_CONFIG, seed: int | None = None,
        augment: Augment | None = None, dtype: torch.dtype | FromConfig = FROM_CONFIG,
        prefetch_factor: int | None | FromConfig = FROM_CONFIG, persistent_workers: bool | None | FromConfig = FROM_CONFIG,
        multiprocessing_context: MPContext | None | FromConfig = FROM_CONFIG,
        pin_memory: bool | None | FromConfig = FROM_CONFIG, memory_budget: int | str | None | FromConfig = FROM_CONFIG,
        meta: bool | FromConfig = FROM_CONFIG, config: LoaderConfig | None = None) -> DeviceLoader | SampleLoader:
    """A loader of windowed float batches on ``device`` from a :class:`SliceDataset`/:class:`SlabDataset`
    (or, one sample at a time, a :class:`PatchDataset`: :mod:`medload.data.sample_loader`).

    Each setting is the keyword given, else ``config``'s (a :class:`~medload.config.LoaderConfig`, e.g. the
    ``[loader]`` table of a config file), else its default below: an explicit keyword wins over the config.

    Args:
        batch_size: samples per batch (needed: here or in ``config``).
        num_workers: reading processes, or ``"auto"``: measure a few batches on this store and machine
            and choose workers, ``prefetch_factor`` (unless given) and pinning within ``memory_budget``
            (see :mod:`medload.data.autotune`; the choice and its reason are in ``loader.tuning``).
        dtype: of the image batches: float32, or float16/bfloat16, which halve the device memory of
            every batch; the window is applied in float32 and the result cast (error at most half a
            unit in the last place of a value in 0..1: 2**-11 for float16, 2**-8 for bfloat16).
            Without a window, half precision rounds HU above 2048 (float16) or 256 (bfloat16).
            Or the dataset's stored dtype (``torch.int16`` HU, ``torch.uint8`` planes): batches as
            stored, with no cast and no window, for a model that windows them itself on the device
            (half the bytes of float32 from host to GPU).
        prefetch_factor: batches each worker reads ahead (default 2).
        persistent_workers: keep the workers between epochs (default: when there are workers).
        multiprocessing_context: of the workers, as torch's DataLoader takes it (default: torch's).
        pin_memory: copy to CUDA through pinned host buffers, asynchronously (default: on CUDA).
        memory_budget: bytes (or ``"2GB"``) ``"auto"`` may spend on batch buffers, pinned staging and
            the workers' L1 caches (default: a quarter of the available memory, at most 4 GB).
        window: window for HU datasets (``"soft_tissue"``, ``"350/50"``...): values map to 0..1 on the
            device. A dataset reading a stored uint8 plane (``plane=``) is scaled to 0..1 and needs none.
        shuffle, seed: without a ``sampler``, a random order drawn from ``seed`` (default 0), a new one each
            epoch, or (default, as torch's DataLoader) the dataset's order. A seed without shuffling, or
            either with a ``sampler``, is a ConfigError: it would be ignored.
        sampler: any torch Sampler of dataset indices (e.g. from :mod:`medload.data.samplers`), which
            decides the order. Where the dataset mixes matrix
            sizes, each batch holds one size: the sampler's order is kept within each size and a batch
            goes out when its size has ``batch_size`` samples (:mod:`medload.data.buckets`); ``drop_last``
            then drops each size's last partial batch.
        augment: a callable ``(image, label) -> (image, label)`` applied to each batch on the device,
            e.g. :class:`medload.data.augment.BatchAugment`, which takes the device and the spatial
            dims from the loader (its ``bind``).
        meta: image and label batches as MONAI ``MetaTensor`` carrying each sample's affine and key
            (:mod:`medload.data.batch_meta`), for ``decollate_batch`` and MONAI post-processing
            (``Invertd``, ``SaveImaged``, ``sliding_window_inference``).

    Examples:
        >>> loader = make_loader(SliceDataset(store, context=1), batch_size=8, num_workers=2,
        ...                      device="cpu", window="soft_tissue", shuffle=True)   # or device="cuda"
        >>> batch = next(iter(loader)); batch["image"].shape, batch["image"].dtype
        (torch.Size([8, 3, 512, 512]), torch.float32)
        >>> from medload.config import LoaderConfig
        >>> next(iter(make_loader(SliceDataset(store), config=LoaderConfig(batch_size=4, dtype="float16"))))["image"].dtype
        torch.float16
    """
    s = loader_settings(config, batch_size=batch_size, num_workers=num_workers, window=window, drop_last=drop_last,
                        dtype=dtype, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                        multiprocessing_context=multiprocessing_context, pin_memory=pin_memory,
                        memory_budget=memory_budget, meta=meta)
    device = checked_device(device)  # a GPU this machine lacks fails here, not at the first batch
    order = ordered(dataset, sampler, shuffle, seed)
    if not reads_batches(dataset):  # ds[i] samples (PatchDataset): batched by torch's DataLoader
        s.pop("memory_budget")
        return SampleLoader(dataset, device=device, sampler=order, augment=augment, **s)
    check_settings(dataset, s["window"], s["dtype"], augment)
    tuning, budget = None, s.pop("memory_budget")
    if s["num_workers"] == "auto":
        tuning = tune_loader(dataset, s["batch_size"], device, window=s["window"], augment=augment, dtype=s["dtype"],
                             prefetch_factor=s["prefetch_factor"], pin_memory=s["pin_memory"], memory_budget=budget)
        s.update(num_workers=tuning.num_workers, prefetch_factor=tuning.prefetch_factor, pin_memory=tuning.pin_memory)
    return build_loader(dataset, device=device, sampler=order, augment=augment, tuning=tuning, **s)


def loader_settings(config: LoaderConfig | None = None, **given: Any) -> dict[str, Any]:
    """:func:`make_loader`'s settings: each of ``given`` that is not :data:`~medload.config.FROM_CONFIG`,
    else ``config``'s, else make_loader's default; ``dtype`` a torch dtype.

    Examples:
        >>> s = loader_settings(LoaderConfig(batch_size=8, num_workers=2, dtype="bfloat16"), num_workers=0)
        >>> s["batch_size"], s["num_workers"], s["dtype"], s["window"]
        (8, 0, torch.bfloat16, None)
    """
    cfg = LoaderConfig() if config is None else config
    if not isinstance(cfg, LoaderConfig):
        raise ConfigError(f"config must be a LoaderConfig (medload.config), got {type(cfg).__name__}")
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(f"make_loader has no setting(s) {', '.join(unknown)}")
    out = {name: choose(given.get(name, FROM_CONFIG), getattr(cfg, name), default) for name, default in _DEFAULTS.items()}
    if out["batch_size"] is None:
        raise ConfigError("give a batch size: make_loader(dataset, batch_size), or config=LoaderConfig(batch_size=...)")
    if isinstance(out["dtype"], str):
        out["dtype"] = getattr(torch, out["dtype"])
    return out


#: make_loader's defaults of the settings a LoaderConfig holds (batch_size: none, it must be given)
_DEFAULTS = {"batch_size": None, "num_workers": 0, "window": None, "drop_last": False, "dtype": torch.float32,
             "prefetch_factor": None, "persistent_workers": None, "multiprocessing_context": None, "pin_memory": None,
             "memory_budget": None, "meta": False}

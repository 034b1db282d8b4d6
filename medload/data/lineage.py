"""The lineage records of the training datasets (:mod:`medload.lineage`): what each dataset was asked for;
:meth:`medload.data.device_loader.DeviceLoader.lineage` adds how the loader orders, batches and augments.

Samplers and augmentations are described by their kind and their public settings (numbers, text, flags:
``seed``, ``p``, ``shuffle``, ``rank``, ``world_size``...; a dataclass config as its fields), so a sampler
written by the user is recorded too; the epoch and a sampler's position in it, which change as training
runs, are left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from medload.lineage.record import LineageRecord, make_record
from medload.storage.selection import _key_prefixes
from medload.storage.store import Store

if TYPE_CHECKING:
    from medload.storage.records import SeriesRecord

__all__ = ["dataset_lineage", "describe", "filters_json", "loader_lineage"]

_SCALARS = (bool, int, float, str, type(None))
_VOLATILE = {"epoch", "position"}  # where a run is, not how it was set up: a record must not depend on it


def describe(obj: Any) -> dict[str, Any] | None:
    """``obj`` (a sampler, an augmentation) as its kind and public scalar settings; None for None."""
    if obj is None:
        return None
    out: dict[str, Any] = {"kind": type(obj).__qualname__}
    for name, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
        if name.startswith("_") or name in _VOLATILE:
            continue
        if isinstance(value, _SCALARS):
            out[name] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[name] = dataclasses.asdict(value)
        elif isinstance(value, torch.Generator):  # torch's RandomSampler keeps its seed in its generator
            out["seed"] = value.initial_seed()
    return out


def filters_json(filters: Mapping[str, Any]) -> dict[str, Any]:
    """A dataset's series filters as JSON: those given, ``keys`` as the sorted key prefixes."""
    out = {name: value for name, value in filters.items() if value is not None}
    if "keys" in out:
        out["keys"] = sorted(_key_prefixes(out["keys"]))
    return out


def dataset_lineage(store: Store, records: tuple[SeriesRecord, ...], options: dict[str, Any], filters: Mapping[str, Any],
                    *, labels: bool, samples: int, **inputs: Any) -> LineageRecord:
    """The record of a dataset drawing from ``records``: ``options`` (its kind and arguments), its
    ``filters``, whether it uses ``labels`` and its number of ``samples``; ``inputs`` add further parts."""
    dataset = {**options, "filters": filters_json(filters), "samples": samples}
    return make_record(store, records, labels=labels, dataset=dataset, **inputs)


def loader_lineage(loader: Any, **inputs: Any) -> LineageRecord:
    """``loader.lineage()`` of a :class:`~medload.data.device_loader.DeviceLoader` or a
    :class:`~medload.data.patch_loader.PatchLoader`: its dataset's record, with the batch size, the sampler
    (kind, seed...), window, dtype and augmentation; ``inputs`` add further parts (``split=``...)."""
    batches = loader.loader.batch_sampler.batches  # the shape-bucket batching of both loaders
    settings = {"batch_size": batches.batch_size, "drop_last": batches.drop_last,
                "sampler": describe(batches.sampler), "num_workers": loader.loader.num_workers,
                "window": None if loader.window is None else dataclasses.asdict(loader.window),
                "dtype": str(loader.dtype).removeprefix("torch."), "augment": describe(loader.augment),
                "meta": loader.meta}
    return loader.dataset.lineage(loader=settings, **inputs)

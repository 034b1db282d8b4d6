"""The sample schema of a fast-loader batch beyond the arrays: keys and slices, and MONAI metadata.

``sample_keys`` adds the datasets' ``key`` and ``z`` per sample (read in the trainer from the dataset's
index arrays: nothing more crosses from the workers). ``as_meta_batch`` (``make_loader(meta=True)``)
turns image and label into batched MONAI ``MetaTensor`` s whose affine is ``(B, 4, 4)``, one per sample
(:mod:`medload.data.layout`), with the per-sample metadata ``decollate_batch`` splits, so MONAI's
post-processing -- ``Invertd``, ``SaveImaged``, ``sliding_window_inference`` -- works on fast-path
batches as on a ``monai.data.DataLoader``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from medload.data.loader_types import LoaderDataset

__all__ = ["sample_keys", "as_meta_batch", "meta_batch"]


def sample_keys(dataset: LoaderDataset, indices: Sequence[int]) -> dict[str, Any]:
    """``key`` (list of series keys) and ``z`` (int64 tensor, on the CPU) of the samples ``indices``."""
    idx = np.asarray(indices, dtype=np.int64)
    keys = dataset.index.keys
    return {"key": [keys[s] for s in dataset.index.series[idx].tolist()],
            "z": torch.from_numpy(dataset.index.z[idx].astype(np.int64))}


def as_meta_batch(batch: dict, dataset: LoaderDataset) -> dict:
    """``batch`` with its image and label as batched MetaTensors carrying each sample's affine."""
    idx = batch["index"].tolist()
    affine = torch.from_numpy(np.stack([dataset.item_affine(i) for i in idx]))
    return meta_batch(batch, affine, [dataset.sample_meta(i) for i in idx])


def meta_batch(batch: dict, affine: torch.Tensor, metas: Sequence[dict]) -> dict:
    """``batch`` with its image and label as batched MetaTensors: sample ``k`` with ``affine[k]`` (``(B, 4,
    4)``, index to RAS mm) and the metadata ``metas[k]``."""
    from monai.data import MetaTensor
    from monai.utils import MetaKeys, SpaceKeys

    meta = {k: [m[k] for m in metas] for k in metas[0]}
    meta[MetaKeys.SPACE] = [SpaceKeys.RAS] * len(metas)
    out = dict(batch)
    for name in ("image", "label"):
        if name in batch:
            spatial = tuple(batch[name].shape[2:])
            tensor = MetaTensor(batch[name], affine=affine.to(batch[name].device), meta=dict(meta))
            tensor.meta[MetaKeys.SPATIAL_SHAPE] = [np.asarray(spatial)] * len(metas)
            tensor.meta[MetaKeys.ORIGINAL_AFFINE] = list(affine.clone())
            tensor.is_batch = True
            out[name] = tensor
    return out

"""``MedloadReader``: a MONAI ``ImageReader`` for ``medload:`` URIs, for stock ``LoadImaged``.

It returns what the datasets' ``ds[i]`` returns, in the axis order of :mod:`medload.data.layout`, so a
model trained through one route and run through the other sees the same arrays: a slab is
``(depth, rows, columns)`` (``EnsureChannelFirstd`` makes it ``(1, depth, rows, columns)``), a 2.5D
stack ``(2k+1, rows, columns)`` with its channels first (``original_channel_dim = 0``), and the label of
a 2.5D stack is the centre slice's, ``(1, rows, columns)``. The affine maps those indices to RAS mm.
This is not NibabelReader's ``(x, y, z)`` order: the same voxels, transposed, with the affine to match.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from monai.config import PathLike
from monai.data import ImageReader
from monai.utils import MetaKeys, SpaceKeys

from medload.config import CacheConfig
from medload.data.layout import sample_affine
from medload.errors import ConfigError
from medload.storage.store import Store
from medload.storage.uri import ItemRef, is_item_uri, parse_item_uri

__all__ = ["MedloadReader"]


class MedloadReader(ImageReader):
    """Loads ``medload:`` URIs (see :meth:`medload.Store.items`) in MONAI pipelines.

    Args:
        cache: cache settings for the stores it opens (one Store per store path and process).

    Examples:
        >>> from monai.transforms import LoadImaged
        >>> load = LoadImaged(keys=["image"], reader=MedloadReader())
        >>> item = load(store.items(depth=16)[0])
        >>> item["image"].shape, item["image"].affine.shape    # (slices, rows, columns), as SlabDataset's
        (torch.Size([16, 512, 512]), torch.Size([4, 4]))
    """

    def __init__(self, cache: CacheConfig | str | None = None) -> None:
        super().__init__()
        self.cache = cache
        self._stores: dict[Path, Store] = {}

    def verify_suffix(self, filename: Sequence[PathLike] | PathLike) -> bool:
        names = [filename] if isinstance(filename, (str, os.PathLike)) else list(filename)
        return bool(names) and all(is_item_uri(n) for n in names)

    def read(self, data: Sequence[PathLike] | PathLike, **kwargs: Any) -> list[ItemRef] | ItemRef:
        refs = [parse_item_uri(d) for d in ([data] if isinstance(data, (str, os.PathLike)) else data)]
        return refs if len(refs) > 1 else refs[0]

    def _store(self, path: Path) -> Store:
        store = self._stores.get(path)
        if store is None:
            store = self._stores[path] = Store(path, self.cache)
        return store

    def get_data(self, img: ItemRef | list[ItemRef]) -> tuple[np.ndarray, dict]:
        refs = img if isinstance(img, list) else [img]
        arrays, metas = zip(*(self._one(r) for r in refs))
        if len(refs) == 1:
            return arrays[0], metas[0]
        meta = dict(metas[0])
        meta[MetaKeys.ORIGINAL_CHANNEL_DIM] = 0
        return np.stack(arrays), meta

    def _one(self, ref: ItemRef) -> tuple[np.ndarray, dict]:
        store = self._store(ref.store)
        rec = store.record(ref.key)
        depth = rec.shape[0]
        reader = store.read_label if ref.label else lambda *a: store.read(*a, plane=ref.plane)
        z0 = ref.z0
        if ref.context is None:
            array = reader(rec.key, ref.z0, ref.z1)
        else:
            if not 0 <= ref.z0 < depth:
                raise ConfigError(f"slice {ref.z0} is outside series {rec.key[:12]} of {depth} slices")
            context = 0 if ref.label else ref.context  # a stack's label is its centre slice's
            zs = np.clip(np.arange(z0 - context, z0 + context + 1), 0, depth - 1)
            run = reader(rec.key, int(zs[0]), int(zs[-1]) + 1)
            array = run[zs - zs[0]]  # the edge slices replicated
        affine = sample_affine(rec.affine, z0, 3 if ref.context is None else 2)
        meta = {
            MetaKeys.AFFINE: affine,
            MetaKeys.ORIGINAL_AFFINE: affine.copy(),
            MetaKeys.SPACE: SpaceKeys.RAS,
            MetaKeys.SPATIAL_SHAPE: np.asarray(array.shape if ref.context is None else array.shape[1:]),
            MetaKeys.ORIGINAL_CHANNEL_DIM: float("nan") if ref.context is None else 0,
            "medload_key": rec.key,
            "medload_z": z0,
        }
        return array, meta

"""``MedloadReader``: a MONAI ``ImageReader`` for ``medload:`` URIs, for stock ``LoadImaged``.

It returns arrays the way MONAI's own readers (NibabelReader, PydicomReader) do: spatial axes in
``(x, y, z)`` = ``(column, row, slice)`` order, with the RAS affine of the store's record moved to the
first slice read -- the same array and affine as loading ``medload export``'s NIfTI with
NibabelReader and cropping it. A 2.5D stack is ``(x, y, channels)`` with the channels last
(``original_channel_dim = -1``), so ``EnsureChannelFirstd`` makes it ``(2k+1, x, y)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from monai.data import ImageReader
from monai.utils import MetaKeys, SpaceKeys

from medload.config import CacheConfig
from medload.errors import ConfigError
from medload.storage.store import Store
from medload.storage.uri import ItemRef, is_item_uri, parse_item_uri

__all__ = ["MedloadReader"]


class MedloadReader(ImageReader):
    """Loads ``medload:`` URIs (see :meth:`medload.Store.items`) in MONAI pipelines.

    Args:
        cache: cache settings for the stores it opens (one Store per store path and process).

    Example:
        >>> from monai.transforms import LoadImaged
        >>> load = LoadImaged(keys=["image"], reader=MedloadReader())
        >>> item = load(store.items(depth=32)[0])        # doctest: +SKIP
        >>> item["image"].shape, item["image"].affine.shape
        (torch.Size([512, 512, 32]), torch.Size([4, 4]))
    """

    def __init__(self, cache: CacheConfig | str | None = None) -> None:
        super().__init__()
        self.cache = cache
        self._stores: dict[Path, Store] = {}

    def verify_suffix(self, filename: Sequence[str] | str) -> bool:
        names = [filename] if isinstance(filename, str) else list(filename)
        return bool(names) and all(is_item_uri(n) for n in names)

    def read(self, data: Sequence[str] | str, **kwargs) -> list[ItemRef] | ItemRef:
        refs = [parse_item_uri(d) for d in ([data] if isinstance(data, str) else data)]
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
        reader = store.read_label if ref.label else lambda *a: store.read(*a, window=ref.plane)
        if ref.context is None:
            z0, volume = ref.z0, reader(rec.key, ref.z0, ref.z1)
        else:
            if not 0 <= ref.z0 < depth:
                raise ConfigError(f"slice {ref.z0} is outside series {rec.key[:12]} of {depth} slices")
            z0 = ref.z0
            zs = np.clip(np.arange(ref.z0 - ref.context, ref.z0 + ref.context + 1), 0, depth - 1)
            run = reader(rec.key, int(zs[0]), int(zs[-1]) + 1)
            volume = run[zs - zs[0]]  # the edge slices replicated
        affine = np.asarray(rec.affine, dtype=np.float64).copy()
        affine[:3, 3] = (np.asarray(rec.affine) @ np.array([0.0, 0.0, z0, 1.0]))[:3]
        array = volume.transpose(2, 1, 0)  # (slice, row, column) -> (x, y, z)
        meta = {
            MetaKeys.AFFINE: affine,
            MetaKeys.ORIGINAL_AFFINE: affine.copy(),
            MetaKeys.SPACE: SpaceKeys.RAS,
            MetaKeys.SPATIAL_SHAPE: np.asarray(array.shape if ref.context is None else array.shape[:2]),
            MetaKeys.ORIGINAL_CHANNEL_DIM: float("nan") if ref.context is None else -1,
            "medload_key": rec.key,
            "medload_z0": z0,
        }
        return array, meta

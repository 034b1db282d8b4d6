"""What a 3D patch reads of a stored series: the box of voxels its resampling touches, cropped as it is decoded.

Slices are stored whole (one compressed value per slice), so a patch decodes every slice of the range its
extent reaches (:func:`~medload.data.patch_geometry.source_box`: one range read of the image, one of the
label) and keeps only the rows and columns of the box: each image slice is cropped straight out of the
decoder's scratch buffer (``Store.planes(transient=True)``), so no whole-width copy of the range is made.
What this costs per patch voxel, and why slices stay whole: docs/training.md, "3D patches".
"""

from __future__ import annotations

import numpy as np

from medload.storage.store import Store

__all__ = ["read_box"]


def read_box(store: Store, key: str, box: tuple[np.ndarray, np.ndarray], labels: bool,
             label_dtype: np.dtype | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The stored voxels ``lo <= (slice, row, column) < hi`` of series ``key`` (``box = (lo, hi)``): the
    image as stored (int16 HU for CT) and, with ``labels``, the label map (as ``label_dtype``, default its
    stored dtype)."""
    (z0, r0, c0), (z1, r1, c1) = ((int(v) for v in corner) for corner in box)
    planes = store.planes(key, z0, z1, transient=True)
    image = np.empty((z1 - z0, r1 - r0, c1 - c0), dtype=planes[0].dtype)
    for k, plane in enumerate(planes):
        image[k] = plane[r0:r1, c0:c1]
    if not labels:
        return image, None
    label = store.read_label(key, z0, z1)[:, r0:r1, c0:c1]
    return image, np.ascontiguousarray(label, dtype=label_dtype or label.dtype)

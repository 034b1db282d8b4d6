"""The axis convention of a training sample, shared by the datasets, the fast loader and the MONAI route.

A store keeps a series as ``(slices, rows, columns)`` and its affine (``SeriesRecord.affine``, as in
the NIfTI export) maps voxel ``(column, row, slice)`` to RAS mm. Samples keep the store's order, so
every route hands a model the same array:

- 2.5D, ``(2k+1, rows, columns)``: channel c is slice ``z - k + c``. Its affine maps
  ``(row, column, c - k)`` to RAS: the two spatial axes a 2D MONAI transform sees come first, in array
  order, and the third index steps along the slice normal from the centre slice z (0) to its neighbours.
- 3D, ``(1, depth, rows, columns)``: its affine maps ``(slice - z, row, column)``, z being the slab's
  first slice.

Both are 4x4 matrices, as MONAI's ``MetaTensor`` carries (a 2D transform uses the top-left 2x2 block
and the translation).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["sample_affine"]

#: Which series-affine column (0: column, 1: row, 2: slice) each sample index uses, per spatial rank.
_COLUMNS = {2: (1, 0, 2), 3: (2, 1, 0)}


def sample_affine(series_affine: npt.ArrayLike, z: int, spatial_dims: int) -> np.ndarray:
    """The affine of a sample at slice ``z`` (2.5D: its centre; 3D: its first slice) of a series.

    >>> a = np.diag([0.8, 0.7, 2.5, 1.0])                 # columns 0.8 mm, rows 0.7 mm, slices 2.5 mm
    >>> sample_affine(a, 4, 2) @ [1, 2, 0, 1]            # row 1, column 2 of the centre slice 4
    array([ 1.6,  0.7, 10. ,  1. ])
    """
    a = np.asarray(series_affine, dtype=np.float64)
    out = np.eye(4)
    out[:, :3] = a[:, list(_COLUMNS[spatial_dims])]
    out[:3, 3] = (a @ np.array([0.0, 0.0, float(z), 1.0]))[:3]
    return out

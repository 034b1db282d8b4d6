"""Resampling a stored volume onto another grid: trilinear for images, nearest neighbour for labels.

The grid is given by :func:`~medload.data.patch_geometry.voxel_to_voxel`'s map from output index
``(d, h, w)`` to source index ``(slice, row, column)``; sample points are voxel centres (NIfTI, ITK).

- Images (:func:`sample_linear`): torch ``grid_sample`` trilinear in float32, ``align_corners=False``
  with normalised coordinates ``(2 * index + 1) / size - 1`` so index ``k`` is voxel k's centre. Outside
  the volume the source is taken as ``pad`` (-1024 HU, air, for CT images): points within a voxel of
  the edge blend the edge voxel with ``pad``, as MONAI's ``padding_mode="zeros"`` blends with 0.
- Labels (:func:`sample_nearest`): each point takes the voxel whose centre is nearest
  (``numpy.rint`` of the float64 index, ties to even as ``grid_sample``'s nearest), 0 outside. Values
  are copied, never interpolated.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from medload.data.patch_geometry import source_box

__all__ = ["source_points", "sample_linear", "sample_nearest", "resample_volume", "HU_PAD"]

HU_PAD = -1024.0
"""What an image is padded with outside its volume: air, the lowest HU a CT stores."""


def source_points(v2v: np.ndarray, shape: Sequence[int], offset=(0, 0, 0)) -> np.ndarray:
    """``(D, H, W, 3)`` float64: the source index ``(slice, row, column)`` of each output voxel centre, less
    ``offset`` (the first voxel of the source block read)."""
    m = np.asarray(v2v, dtype=np.float64)
    d, h, w = (np.arange(n, dtype=np.float64) for n in shape)
    base = m[:3, 3] - np.asarray(offset, dtype=np.float64)
    return (base + d[:, None, None, None] * m[:3, 0] + h[None, :, None, None] * m[:3, 1]
            + w[None, None, :, None] * m[:3, 2])


def sample_linear(volume, points: np.ndarray, pad: float = HU_PAD) -> torch.Tensor:
    """Trilinear samples of ``volume`` (``(S, R, C)`` or channels first ``(K, S, R, C)``, any numeric dtype)
    at ``points`` (``(D, H, W, 3)`` source indices): float32 ``(D, H, W)`` or ``(K, D, H, W)``."""
    v = torch.as_tensor(volume).to(torch.float32)
    lone = v.ndim == 3
    v = v[None] if lone else v
    if pad:
        v = v - pad
    size = torch.tensor(v.shape[1:], dtype=torch.float64)  # S, R, C
    grid = (2 * torch.from_numpy(points) + 1) / size - 1   # x (column) last in points, first in grid
    out = torch.nn.functional.grid_sample(v[None], grid.flip(-1)[None].to(torch.float32), mode="bilinear",
                                          padding_mode="zeros", align_corners=False)[0]
    if pad:
        out += pad
    return out[0] if lone else out


def sample_nearest(volume: np.ndarray, points: np.ndarray, fill: int = 0) -> np.ndarray:
    """Nearest-neighbour samples of ``volume`` ``(S, R, C)`` at ``points``, in its own dtype; ``fill``
    outside."""
    index = np.rint(points).astype(np.int64)
    inside = ((index >= 0) & (index < np.asarray(volume.shape))).all(axis=-1)
    out = np.full(points.shape[:-1], fill, dtype=volume.dtype)
    s, r, c = (index[..., k][inside] for k in range(3))
    out[inside] = volume[s, r, c]
    return out


def resample_volume(volume, v2v: np.ndarray, shape: Sequence[int], pad: float = HU_PAD,
                    chunk: int = 1 << 21) -> torch.Tensor:
    """A whole volume (``(S, R, C)``, or channels first) trilinearly resampled onto the grid ``shape`` that
    ``v2v`` maps into it, float32, ``pad`` outside: ``chunk`` output voxels at a time, each from the block
    of the source it reaches (:func:`~medload.data.patch_geometry.source_box`), so only that block is
    converted to float."""
    spatial = tuple(volume.shape[-3:])
    out = torch.full((*volume.shape[:-3], *shape), float(pad), dtype=torch.float32)
    step = max(1, chunk // max(1, int(shape[1]) * int(shape[2])))
    for d0 in range(0, int(shape[0]), step):
        part = (min(step, int(shape[0]) - d0), int(shape[1]), int(shape[2]))
        m = np.asarray(v2v, dtype=np.float64).copy()
        m[:3, 3] += m[:3, 0] * d0  # the chunk's first plane is the grid's plane d0
        box = source_box(m, part, spatial)
        if box is not None:
            (z0, r0, c0), (z1, r1, c1) = box
            points = source_points(m, part, offset=box[0])
            out[..., d0 : d0 + part[0], :, :] = sample_linear(volume[..., z0:z1, r0:r1, c0:c1], points, pad)
    return out

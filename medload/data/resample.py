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

Where the grid's axes run along the source's (no rotation between them), both factor into 1D passes
(:mod:`medload.data.separable`), with the same coordinates and rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from medload.data.patch_geometry import source_box
from medload.data.separable import axis_pairs, linear_separable, nearest_separable

__all__ = ["source_points", "grid_matrix", "sample_linear", "sample_nearest", "resample_volume", "HU_PAD"]

HU_PAD = -1024.0
"""What an image is padded with outside its volume: air, the lowest HU a CT stores."""


def _coordinate(m: np.ndarray, shape: Sequence[int], k: int, dtype: type[np.floating] = np.float64) -> np.ndarray:
    """``(D, H, W)``: row ``k`` of the affine ``m`` applied to every output index ``(d, h, w)``."""
    d, h, w = (np.arange(n, dtype=dtype) for n in shape)
    a, b, c, t = (dtype(x) for x in m[k])
    return (t + a * d)[:, None, None] + (b * h)[None, :, None] + (c * w)[None, None, :]


def source_points(v2v: np.ndarray, shape: Sequence[int], offset: npt.ArrayLike = (0, 0, 0)) -> np.ndarray:
    """``(D, H, W, 3)`` float64: the source index ``(slice, row, column)`` of each output voxel centre, less
    ``offset`` (the first voxel of the source block read)."""
    m = _shifted(v2v, offset)
    return np.stack([_coordinate(m, shape, k) for k in range(3)], axis=-1)


def _shifted(v2v: np.ndarray, offset: npt.ArrayLike) -> np.ndarray:
    m = np.array(v2v, dtype=np.float64)
    m[:3, 3] -= np.asarray(offset, dtype=np.float64)
    return m


def grid_matrix(v2v: np.ndarray, source_shape: Sequence[int], offset: npt.ArrayLike = (0, 0, 0)) -> np.ndarray:
    """4x4: output index ``(d, h, w)`` to ``grid_sample``'s normalised coordinates ``(x, y, z)`` (column
    first, ``(2 * index + 1) / size - 1``) in the block ``source_shape`` ``(S, R, C)`` of the source from
    voxel ``offset``."""
    size = np.asarray(source_shape, dtype=np.float64)[::-1]
    normalise = np.diag([*(2 / size), 1.0])
    normalise[:3, 3] = 1 / size - 1
    return normalise @ _shifted(v2v, offset)[[2, 1, 0, 3]]


def sample_linear(volume: np.ndarray | torch.Tensor, v2v: np.ndarray, shape: Sequence[int],
                  offset: npt.ArrayLike = (0, 0, 0), pad: float = HU_PAD) -> torch.Tensor:
    """Trilinear samples of ``volume`` (``(S, R, C)`` or channels first ``(K, S, R, C)``, any numeric dtype;
    the block of the source from voxel ``offset``) on the grid ``shape`` that ``v2v`` maps into the
    source: float32 ``(D, H, W)`` or ``(K, D, H, W)``."""
    v = torch.as_tensor(volume).to(torch.float32, copy=bool(pad))
    lone = v.ndim == 3
    v = v[None] if lone else v
    if pad:
        v.sub_(pad)
    pairs = axis_pairs(v2v)
    if pairs is not None:  # axes along the source's: three 1D passes (medload.data.separable)
        out = linear_separable(v, _shifted(v2v, offset), pairs, shape)
        if pad:
            out += pad
        return out[0] if lone else out
    m = grid_matrix(v2v, v.shape[1:], offset)
    grid = torch.empty((*shape, 3), dtype=torch.float32)
    for k in range(3):
        grid[..., k] = torch.from_numpy(_coordinate(m, shape, k, np.float32))
    out = torch.nn.functional.grid_sample(v[None], grid[None], mode="bilinear", padding_mode="zeros",
                                          align_corners=False)[0]
    if pad:
        out += pad
    return out[0] if lone else out


def sample_nearest(volume: np.ndarray, v2v: np.ndarray, shape: Sequence[int], offset: npt.ArrayLike = (0, 0, 0),
                   fill: int = 0) -> np.ndarray:
    """Nearest-neighbour samples of ``volume`` ``(S, R, C)`` (the block of the source from voxel ``offset``)
    on the grid ``shape`` that ``v2v`` maps into the source, in its own dtype; ``fill`` outside."""
    m = _shifted(v2v, offset)
    pairs = axis_pairs(m)
    if pairs is not None:
        return nearest_separable(volume, m, pairs, shape, fill)
    # the volume framed by one voxel of ``fill``: every index clipped to the frame lands on the fill
    framed = np.full(tuple(n + 2 for n in volume.shape), fill, dtype=volume.dtype)
    framed[1:-1, 1:-1, 1:-1] = volume
    flat = np.zeros(tuple(shape), dtype=np.intp)
    for k, size in enumerate(volume.shape):
        index = _coordinate(m, shape, k)
        np.rint(index, out=index)
        np.clip(index, -1, size, out=index)
        flat *= size + 2
        flat += index.astype(np.intp)
        flat += 1
    return framed.reshape(-1).take(flat)


def resample_volume(volume: np.ndarray | torch.Tensor, v2v: np.ndarray, shape: Sequence[int], pad: float = HU_PAD,
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
            out[..., d0 : d0 + part[0], :, :] = sample_linear(volume[..., z0:z1, r0:r1, c0:c1], m, part, box[0], pad)
    return out

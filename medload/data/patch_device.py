"""The device side of the 3D patch loader: a batch of stored crops resampled onto the patch grid at once.

Each sample of a batch arrives as the box of stored voxels its patch touches (:mod:`medload.data.patch_reads`),
padded to the batch's largest box (-1024 HU and label 0 past its own: no sample point reaches past its own
box but the voxel either side that trilinear blends with the padding, as ``ds[i]`` blends with -1024), and
its map from patch index ``(d, h, w)`` to box index -- orientation, spacing and any augmentation
(:mod:`medload.data.patch_augment`) in one matrix -- twice: folded into ``grid_sample``'s normalised
coordinates of the padded box (:func:`~medload.data.resample.grid_matrix`), and as box indices.

:func:`resample_batch` then does for the whole batch what :mod:`medload.data.resample` does for one
sample, with the same arithmetic in the same order: the image by one trilinear ``grid_sample`` in float32
(less -1024, so the zero padding is air); the label by nearest neighbour, its float64 index rounded half
to even and gathered (``numpy.rint`` and fancy indexing in ``ds[i]``, :func:`~medload.data.resample.sample_nearest`;
a CPU device does not come here: its workers resample each sample as ``ds[i]`` does). A gather rather than
``grid_sample(mode="nearest")``: that re-derives the index from normalised float coordinates, and where a
point lies exactly halfway between two voxels -- a 2.1 mm grid over 3 mm slices has such points -- it
may round the other way than ``ds[i]``; labels are copied, so they are equal to ``ds[i]``'s bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from medload.data.resample import HU_PAD

__all__ = ["resample_batch", "coordinates", "gather_nearest"]


def coordinates(m: torch.Tensor, shape: Sequence[int], k: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, D, H, W)``: row ``k`` of each matrix ``m`` ``(B, 4, 4)`` applied to every index ``(d, h, w)`` of
    the grid ``shape``, in ``dtype`` (the operations of :func:`medload.data.resample.source_points`, batched)."""
    d, h, w = (torch.arange(int(n), dtype=dtype, device=m.device) for n in shape)
    a, b, c, t = (m[:, k, j].to(dtype)[:, None] for j in range(4))
    return (t + a * d)[:, :, None, None] + (b * h)[:, None, :, None] + (c * w)[:, None, None, :]


def resample_batch(image: torch.Tensor, label: torch.Tensor | None, grid: torch.Tensor, index: torch.Tensor,
                   shape: Sequence[int], label_dtype: torch.dtype | None = None,
                   pad: float = HU_PAD) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Crops ``image`` ``(B, S, R, C)`` (stored dtype, on the device) and ``label`` (same shape, or None)
    resampled onto the grid ``shape`` ``(D, H, W)``: ``grid`` ``(B, 4, 4)`` maps its index to the crop's
    normalised ``grid_sample`` coordinates, ``index`` ``(B, 4, 4)`` to the crop's index ``(slice, row,
    column)`` (float64, on the device). Image ``(B, 1, D, H, W)`` float32 (``pad`` outside), label
    ``(B, 1, D, H, W)`` as ``label_dtype`` (default its own; 0 outside)."""
    points = torch.stack([coordinates(grid, shape, k, torch.float32) for k in range(3)], dim=-1)
    source = image[:, None].to(torch.float32)
    if pad:
        source = source - pad
    out = F.grid_sample(source, points, mode="bilinear", padding_mode="zeros", align_corners=False)
    if pad:
        out += pad
    if label is None:
        return out, None
    return out, gather_nearest(label, index, shape)[:, None].to(label_dtype or label.dtype)


def gather_nearest(label: torch.Tensor, index: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``(B, D, H, W)``: the voxel of each crop ``label`` ``(B, S, R, C)`` nearest to each point of the grid
    ``shape`` that ``index`` ``(B, 4, 4)`` maps into it (its float64 index rounded half to even), 0 outside:
    :func:`~medload.data.resample.sample_nearest`, batched, in torch."""
    b = label.shape[0]
    flat = torch.zeros((b, *(int(n) for n in shape)), dtype=torch.int64, device=label.device)
    inside = torch.ones_like(flat, dtype=torch.bool)
    for k, size in enumerate(label.shape[1:]):
        at = torch.round(coordinates(index.to(torch.float64), shape, k, torch.float64)).to(torch.int64)
        inside &= (at >= 0) & (at < size)
        flat = flat * size + at
    values = label.reshape(b, -1).gather(1, torch.where(inside, flat, 0).reshape(b, -1)).reshape(flat.shape)
    return torch.where(inside, values, torch.zeros((), dtype=values.dtype, device=values.device))

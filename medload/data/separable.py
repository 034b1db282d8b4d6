"""Resampling one axis at a time where the grid's axes run along the source's axes.

When the map from output index to source index (:func:`~medload.data.patch_geometry.voxel_to_voxel`) has
one nonzero per row and column in its 3x3 block -- an axial or feet-first series onto a RAS grid without
rotation, any spacing, zoom or mirror -- each source coordinate depends on one output index only, and
trilinear interpolation (a product of 1D linear weights) and nearest-neighbour (a rounding per axis)
factor into three 1D passes: each pass gathers two planes (linear) or one (nearest) per output position
along one axis. That touches a fraction of the voxels a 3D ``grid_sample`` does; nnU-Net skips its
spatial transform for such patches for the same reason.

The arithmetic matches :mod:`medload.data.resample`'s 3D path: source coordinates are voxel centres in
float64 (``t + a * index``: the 3D path's sum with the zero terms, which add exactly nothing), linear
weights in float32 with a tap outside the source weighted 0 (``grid_sample``'s ``padding_mode="zeros"``
on the source less its pad), nearest indices rounded half to even (``numpy.rint``), 0 -- or ``fill`` --
outside. The image differs from the 3D path by float32 rounding only; the label is equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["axis_pairs", "linear_separable", "nearest_separable"]


def axis_pairs(m: np.ndarray) -> tuple[int, int, int] | None:
    """For each source axis (slice, row, column), the output axis whose index alone sets its coordinate --
    when the 3x3 block of ``m`` has exactly one nonzero per row and column -- else None (a rotation)."""
    nonzero = np.asarray(m)[:3, :3] != 0
    if not ((nonzero.sum(axis=0) == 1).all() and (nonzero.sum(axis=1) == 1).all()):
        return None
    j = nonzero.argmax(axis=1)
    return int(j[0]), int(j[1]), int(j[2])


def _axis_coordinates(m: np.ndarray, pairs: tuple[int, int, int], shape: Sequence[int], k: int) -> np.ndarray:
    j = pairs[k]
    return m[k, 3] + m[k, j] * np.arange(int(shape[j]), dtype=np.float64)


def _to_output_order(pairs: tuple[int, int, int]) -> list[int]:
    """The permutation taking arrays indexed (source axis order) to output axis order."""
    return [pairs.index(j) for j in range(3)]


def linear_separable(volume: torch.Tensor, m: np.ndarray, pairs: tuple[int, int, int],
                     shape: Sequence[int]) -> torch.Tensor:
    """Trilinear samples of ``volume`` (float32 ``(..., S, R, C)``, zero taken outside) on the grid ``shape``
    ``(D, H, W)`` that ``m`` (float64 4x4, :func:`axis_pairs` ``pairs``) maps into it: ``(..., D, H, W)``."""
    lead = volume.ndim - 3
    x = volume
    # the axis that shrinks the array most first: the later passes then work on less
    order = sorted(range(3), key=lambda k: int(shape[pairs[k]]) / max(1, volume.shape[lead + k]))
    for k in order:
        size, axis = volume.shape[lead + k], lead + k
        coord = _axis_coordinates(m, pairs, shape, k)
        low = np.floor(coord)
        w_high = coord - low
        i_low = low.astype(np.int64)
        i_high = i_low + 1
        w_low = (1.0 - w_high) * ((i_low >= 0) & (i_low < size))
        w_high = w_high * ((i_high >= 0) & (i_high < size))
        view = [1] * x.ndim
        view[axis] = -1
        out = x.index_select(axis, torch.from_numpy(np.clip(i_low, 0, size - 1)))
        out.mul_(torch.from_numpy(w_low.astype(np.float32)).view(view))
        high = x.index_select(axis, torch.from_numpy(np.clip(i_high, 0, size - 1)))
        out.add_(high.mul_(torch.from_numpy(w_high.astype(np.float32)).view(view)))
        x = out
    return x.permute(*range(lead), *(lead + k for k in _to_output_order(pairs))).contiguous()


def nearest_separable(volume: np.ndarray, m: np.ndarray, pairs: tuple[int, int, int], shape: Sequence[int],
                      fill: int = 0) -> np.ndarray:
    """Nearest-neighbour samples of ``volume`` ``(S, R, C)`` on the grid ``shape`` that ``m`` (:func:`axis_pairs`
    ``pairs``) maps into it, in its own dtype, ``fill`` outside: ``(D, H, W)``."""
    out, outside = volume, np.zeros(tuple(int(n) for n in shape), dtype=bool)
    # one axis at a time, the one that shrinks the array most first (np.take copies whole rows)
    for k in sorted(range(3), key=lambda k: int(shape[pairs[k]]) / max(1, volume.shape[k])):
        size = volume.shape[k]
        at = np.rint(_axis_coordinates(m, pairs, shape, k)).astype(np.intp)
        out = out.take(np.clip(at, 0, size - 1), axis=k)
        beyond = (at < 0) | (at >= size)
        if beyond.any():
            view = [1, 1, 1]
            view[pairs[k]] = -1
            outside |= beyond.reshape(view)
    out = np.ascontiguousarray(out.transpose(_to_output_order(pairs)))
    if outside.any():
        out[outside] = fill
    return out

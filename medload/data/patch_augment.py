"""Spatial augmentation of 3D patches in physical units, folded into the patch's resampling.

:class:`PatchAugment` draws, per sample, a rotation about the RAS axes (degrees), an isotropic zoom, a
translation (mm) and mirrors along the patch axes, and returns them as one 4x4 map of the patch grid:
the fast loader (:func:`medload.data.make_loader` over a :class:`~medload.data.PatchDataset`) composes it
with the patch's affine, so the orientation, the spacing and the augmentation are applied in one
``grid_sample`` per batch -- as nnU-Net applies its spatial transform once (Isensee et al., Nature Methods
2021) -- instead of a second resampling in voxel units, which on 0.7 x 0.7 x 5 mm voxels shears anatomy.

The draw of sample ``i`` comes from ``numpy.random.default_rng([seed, epoch, i, 1])`` (the dataset's seed
and epoch; its centre draw uses ``[seed, epoch, i]``), so it is the same in any worker and any batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from medload.data.samplers import _rng
from medload.errors import ConfigError

__all__ = ["PatchAugment", "rotation_ras"]

#: the stream of the augmentation draws beside the centre draws of the same (seed, epoch, i)
_STREAM = 1

Range = tuple[float, float]


def _ranges(name: str, value: float | Sequence[float] | Sequence[Sequence[float]]) -> tuple[Range, Range, Range]:
    """Three ``(low, high)`` ranges (z, y, x) from a number ``a`` (``(-a, a)`` each), three numbers (``(-a_k,
    a_k)``) or three pairs."""
    items: list[Any] = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(items) != 3:
        raise ConfigError(f"PatchAugment.{name} = {value!r}: give a number, three numbers (z, y, x) or three "
                          "(low, high) pairs")
    out = []
    for item in items:
        pair = (-float(item), float(item)) if isinstance(item, (int, float)) else tuple(float(v) for v in item)
        if len(pair) != 2 or not all(math.isfinite(v) for v in pair) or pair[0] > pair[1]:
            raise ConfigError(f"PatchAugment.{name} = {value!r}: each range is finite (low, high) with low <= high")
        out.append((pair[0], pair[1]))
    return out[0], out[1], out[2]


def rotation_ras(degrees: Sequence[float]) -> np.ndarray:
    """3x3 rotation of RAS mm by ``(about z (S), about y (A), about x (R))`` degrees, ``Rz @ Ry @ Rx``
    (each right-handed: about z, R turns towards A).

    >>> np.round(rotation_ras([90, 0, 0]) @ [1.0, 0.0, 0.0], 12)
    array([0., 1., 0.])
    """
    z, y, x = (math.radians(float(a)) for a in degrees)
    rz = np.array([[math.cos(z), -math.sin(z), 0], [math.sin(z), math.cos(z), 0], [0, 0, 1]])
    ry = np.array([[math.cos(y), 0, math.sin(y)], [0, 1, 0], [-math.sin(y), 0, math.cos(y)]])
    rx = np.array([[1, 0, 0], [0, math.cos(x), -math.sin(x)], [0, math.sin(x), math.cos(x)]])
    return rz @ ry @ rx


@dataclass(frozen=True)
class PatchAugment:
    """Per-sample spatial augmentation of 3D patches in mm and degrees, applied in the patch's resampling.

    Args:
        rotate_deg: rotation about the RAS axes z (S), y (A), x (R), each uniform in its range: a number ``a``
            (``(-a, a)`` on every axis), three numbers ``(z, y, x)`` or three ``(low, high)`` pairs
            (nnU-Net: 30 about each axis of a 3D patch).
        zoom: ``(low, high)``: the anatomy is magnified by a factor uniform in it (> 1: larger; nnU-Net:
            (0.7, 1.4)), about the patch centre -- the grid is sampled at ``spacing / zoom``.
        translate_mm: a shift of the patch grid, uniform in mm, as ``rotate_deg``.
        p: the probability that rotation, zoom and translation are applied to a sample at all.
        mirror: the probability of mirroring each patch axis (d, h, w), independently (nnU-Net: 0.5).

    The defaults change nothing. The patch's affine (``batch["affine"]``) is the grid actually sampled,
    augmentation included.

    Examples:
        >>> aug = PatchAugment(rotate_deg=30, zoom=(0.7, 1.4), p=0.2, mirror=0.5)
        >>> world, grid = aug.matrix(seed=0, epoch=0, index=3, centre=np.zeros(3), shape=(96, 96, 96))
        >>> world.shape, grid.shape
        ((4, 4), (4, 4))
    """

    rotate_deg: float | Sequence[float] | Sequence[Sequence[float]] = 0.0
    zoom: tuple[float, float] = (1.0, 1.0)
    translate_mm: float | Sequence[float] | Sequence[Sequence[float]] = 0.0
    p: float = 1.0
    mirror: float = 0.0
    _rotate: tuple[Range, Range, Range] = field(init=False, repr=False, compare=False)
    _shift: tuple[Range, Range, Range] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rotate", _ranges("rotate_deg", self.rotate_deg))
        object.__setattr__(self, "_shift", _ranges("translate_mm", self.translate_mm))
        zoom = tuple(float(z) for z in self.zoom)
        if len(zoom) != 2 or not 0.0 < zoom[0] <= zoom[1] or not math.isfinite(zoom[1]):
            raise ConfigError(f"PatchAugment.zoom = {self.zoom!r}: use (low, high) with 0 < low <= high")
        object.__setattr__(self, "zoom", zoom)
        for name in ("p", "mirror"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                raise ConfigError(f"PatchAugment.{name} = {getattr(self, name)}: a probability is in [0, 1]")

    def matrix(self, seed: int, epoch: int, index: int, centre: np.ndarray, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index``'s augmentation as two 4x4 maps: ``world`` of RAS mm (rotation and zoom about
        ``centre``, then the shift) and ``grid`` of the patch index ``(d, h, w)`` (the mirrors, about the
        middle of each axis of ``shape``). The sampled grid's affine is ``world @ patch_affine @ grid``."""
        rng = _rng(seed, epoch, int(index), _STREAM)
        world = np.eye(4)
        if rng.random() < self.p:
            angles = [rng.uniform(lo, hi) for lo, hi in self._rotate]
            zoom = rng.uniform(*self.zoom)
            shift = np.array([rng.uniform(lo, hi) for lo, hi in self._shift])
            # translate_mm is (z, y, x); RAS is (x, y, z)
            world[:3, :3] = rotation_ras(angles) / zoom
            world[:3, 3] = np.asarray(centre) - world[:3, :3] @ np.asarray(centre) + shift[::-1]
        flips = rng.random(3) < self.mirror
        grid = np.eye(4)
        for axis, (flip, n) in enumerate(zip(flips, shape)):
            if flip:
                grid[axis, axis], grid[axis, 3] = -1.0, float(n - 1)
        return world, grid

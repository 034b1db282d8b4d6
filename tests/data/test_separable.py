"""Resampling along the source's axes in 1D passes (medload.data.separable), against a float64 trilinear and
nearest-neighbour reference written out corner by corner, on maps with permuted, mirrored and scaled
axes reaching past the volume."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from medload.data.patch_geometry import voxel_to_voxel
from medload.data.resample import sample_linear, sample_nearest, source_points
from medload.data.separable import axis_pairs

SHAPE = (7, 9, 11)


def _reference_linear(volume: np.ndarray, v2v: np.ndarray, shape, pad: float) -> np.ndarray:
    """Trilinear in float64, each of the 8 corners outside the volume taken as ``pad``."""
    points = source_points(v2v, shape)
    low = np.floor(points).astype(np.int64)
    frac = points - low
    out = np.zeros(tuple(shape))
    for corner in itertools.product((0, 1), repeat=3):
        at = low + np.array(corner)
        inside = np.all((at >= 0) & (at < np.array(volume.shape)), axis=-1)
        clipped = np.clip(at, 0, np.array(volume.shape) - 1)
        value = np.where(inside, volume[clipped[..., 0], clipped[..., 1], clipped[..., 2]], pad)
        weight = np.prod(np.where(np.array(corner) == 1, frac, 1 - frac), axis=-1)
        out += weight * value
    return out


def _reference_nearest(volume: np.ndarray, v2v: np.ndarray, shape) -> np.ndarray:
    at = np.rint(source_points(v2v, shape)).astype(np.int64)
    inside = np.all((at >= 0) & (at < np.array(volume.shape)), axis=-1)
    clipped = np.clip(at, 0, np.array(volume.shape) - 1)
    return np.where(inside, volume[clipped[..., 0], clipped[..., 1], clipped[..., 2]], 0)


def _axis_aligned(rng: np.random.Generator) -> np.ndarray:
    """A map whose output axes run along a permutation of the source's, mirrored and scaled, its grid
    reaching a voxel or two past the volume on some sides."""
    m = np.eye(4)
    m[:3, :3] = 0.0
    for k, j in enumerate(rng.permutation(3)):
        m[k, j] = rng.choice([-1, 1]) * rng.uniform(0.4, 2.5)
    m[:3, 3] = rng.uniform(-2, 4, 3)
    return m


@pytest.mark.parametrize("seed", range(8))
def test_linear_passes_equal_trilinear_and_nearest_passes_equal_rounding(seed):
    rng = np.random.default_rng(seed)
    volume = rng.integers(-1024, 2000, (9, 8, 10)).astype(np.int16)
    label = rng.integers(0, 5, volume.shape).astype(np.uint8)
    m = _axis_aligned(rng)
    assert axis_pairs(m) is not None
    got = sample_linear(volume, m, SHAPE).numpy()
    np.testing.assert_allclose(got, _reference_linear(volume.astype(np.float64), m, SHAPE, -1024.0), atol=2e-3, rtol=0)
    assert np.array_equal(sample_nearest(label, m, SHAPE), _reference_nearest(label, m, SHAPE))


def test_points_halfway_between_voxels_round_half_to_even_as_the_3d_path():
    label = np.arange(6 * 5 * 4, dtype=np.uint8).reshape(6, 5, 4)
    m = np.diag([0.5, 1.0, 1.5, 1.0])
    m[:3, 3] = [0.5, -0.5, 0.25]  # slices at 0.5, 1.0, 1.5, ...: every other one a tie
    got = sample_nearest(label, m, (10, 7, 4))
    assert np.array_equal(got, _reference_nearest(label, m, (10, 7, 4)))
    assert np.array_equal(got[:4, 1, 0], label[[0, 1, 2, 2], 0, 0])  # rint: 0.5 -> 0, 1.5 -> 2


def test_channels_first_volumes_pass_through_the_same_passes():
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((3, 6, 7, 8)).astype(np.float32))
    m = _axis_aligned(rng)
    got = sample_linear(logits, m, SHAPE, pad=0.0)
    assert got.shape == (3, *SHAPE)
    for c in range(3):
        np.testing.assert_allclose(got[c].numpy(), _reference_linear(logits[c].double().numpy(), m, SHAPE, 0.0),
                                   atol=1e-5, rtol=0)


def test_a_rotation_takes_the_3d_path_and_float_rounding_of_right_angles_does_not():
    m = np.eye(4)
    t = math.radians(20)
    m[:2, :2] = [[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]]
    assert axis_pairs(m) is None
    # a feet-first series (z reversed, y flipped) onto a RAS grid: right angles by cos/sin leave ~1e-17 terms
    q = math.radians(90)
    series = np.array([[math.cos(q), -math.sin(q), 0, -100], [math.sin(q), math.cos(q), 0, 50], [0, 0, -2.5, 30],
                       [0, 0, 0, 1]])
    series[:3, :3] = series[:3, :3] @ np.diag([0.7, 0.8, 1.0])
    patch = np.diag([1.5, 1.5, 1.5, 1.0])
    patch[:3, 3] = [-90, 40, 10]
    assert np.count_nonzero(np.abs(series[:3, :3]) < 1e-15) > np.count_nonzero(series[:3, :3] == 0)
    v2v = voxel_to_voxel(patch, series)
    assert axis_pairs(v2v) is not None
    assert np.count_nonzero(v2v[:3, :3]) == 3

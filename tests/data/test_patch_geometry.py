"""The patch geometry's conventions against nibabel's: orientation codes, spacing order, centre voxel."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from medload.data.patch_geometry import (
    axcode_directions,
    covering_grid,
    native_directions,
    native_spacing,
    patch_affine,
    voxel_to_voxel,
)
from medload.errors import ConfigError

#: A sagittal series (columns to posterior, rows to inferior, slices to the right) with a shear of its slices.
SAGITTAL = np.array([[0.0, 0.0, 1.9, -10.0], [-0.85, 0.0, 0.3, 20.0], [0.0, -0.75, 0.0, 30.0], [0, 0, 0, 1.0]])


@pytest.mark.parametrize("code", ["RAS", "LPS", "PIR", "ASL", "ILP", "las"])
def test_orientation_codes_are_nibabels_axcodes_of_the_exported_patch(code):
    """The patch as medload exports a series -- the array transposed to (w, h, d) -- has these axcodes."""
    affine = patch_affine([1.0, 2.0, 3.0], (4, 5, 6), (2.0, 1.5, 0.7), axcode_directions(code))
    assert "".join(nib.aff2axcodes(affine[:, [2, 1, 0, 3]])) == code.upper()
    assert np.allclose(nib.affines.voxel_sizes(affine[:, [2, 1, 0, 3]]), [0.7, 1.5, 2.0])  # x, y, z: (z, y, x) reversed


def test_the_centre_is_voxel_n_over_2():
    affine = patch_affine([5.0, -5.0, 7.0], (4, 5, 6), (2.0, 1.0, 0.5), axcode_directions("LPS"))
    assert np.allclose(affine @ [2, 2, 3, 1], [5.0, -5.0, 7.0, 1.0])


def test_own_orientation_and_spacing_is_the_series_grid():
    directions = native_directions(SAGITTAL)
    assert np.allclose(native_spacing(SAGITTAL), np.linalg.norm(SAGITTAL[:3, :3], axis=0)[::-1])
    v2v = voxel_to_voxel(patch_affine(SAGITTAL[:3, 3], (3, 3, 3), native_spacing(SAGITTAL), directions), SAGITTAL)
    assert np.allclose(v2v[:3, :3], np.eye(3)) and np.allclose(v2v[:3, 3], [-1, -1, -1])


def test_own_spacing_follows_the_axis_closest_in_direction():
    """In RAS, a sagittal series' slices (1.9 mm, to the right) give W's spacing, its rows (0.75 mm,
    inferior) D's and its columns (0.85 mm, posterior) H's."""
    assert np.allclose(native_spacing(SAGITTAL, axcode_directions("RAS")), (0.75, 0.85, np.hypot(1.9, 0.3)))


def test_the_covering_grid_holds_every_voxel_centre_and_no_more():
    affine, shape = covering_grid(SAGITTAL, (10, 20, 30), (1.0, 1.0, 1.0), axcode_directions("RAS"))
    corners = np.array(np.meshgrid([0, 29], [0, 19], [0, 9], indexing="ij")).reshape(3, -1)  # column, row, slice
    index = np.linalg.solve(affine, SAGITTAL @ np.vstack([corners, np.ones(8)]))[:3]
    assert (index > -1e-9).all() and (index < np.array(shape)[:, None] - 1 + 1e-9).all()
    assert (index.min(axis=1) < 1).all() and (index.max(axis=1) > np.array(shape) - 2).all()


@pytest.mark.parametrize("code", ["RAX", "RRS", "RA", "RASL", "", None])
def test_bad_codes_say_what_is_expected(code):
    with pytest.raises(ConfigError, match="three letters"):
        axcode_directions(code)

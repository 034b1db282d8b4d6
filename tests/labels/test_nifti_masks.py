"""NIfTI masks read with nibabel under MONAI NibabelReader's affine rule, any affine."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
from monai.data import NibabelReader

from medload.labels.grid import RAS_TO_LPS, SeriesGrid
from medload.labels.masks import mask_to_grid, nifti_affine


@pytest.fixture(scope="module")
def grid() -> SeriesGrid:
    rot = np.linalg.qr(np.random.default_rng(4).normal(size=(3, 3)))[0]
    affine = np.eye(4)
    affine[:3, :3] = rot * np.array([0.8, 0.7, 2.5])
    affine[:3, 3] = (-30.0, 8.5, 60.0)
    return SeriesGrid((6, 10, 8), affine)


def _labels(seed: int = 0) -> np.ndarray:
    out = np.zeros((6, 10, 8), np.uint8)
    out[1:5, 2:8, 2:6] = np.random.default_rng(seed).integers(0, 4, size=(4, 6, 4))
    return out


def _save(path, data_zyx: np.ndarray, *, sform_lps=None, qform_lps=None, pixdim=None):
    """A NIfTI with the given transforms (code 0 where None) and pixdim (default: the voxel sizes of the
    first transform given)."""
    img = nib.Nifti1Image(data_zyx.transpose(2, 1, 0), None)
    first = sform_lps if sform_lps is not None else qform_lps
    for setter, affine in ((img.set_sform, sform_lps), (img.set_qform, qform_lps)):
        setter(np.eye(4) if affine is None else RAS_TO_LPS @ affine, code=0 if affine is None else 2)
    if pixdim is None and first is not None:
        pixdim = np.linalg.norm(first[:3, :3], axis=0)
    if pixdim is not None:
        img.header.set_zooms(tuple(float(v) for v in pixdim))
    nib.save(img, path)
    return path


def test_sform_wins_over_a_different_qform(tmp_path, grid):
    data = _labels()
    other = grid.affine_lps.copy()
    other[:3, 3] += 50.0  # a qform somewhere else: only the sform places the mask
    label = mask_to_grid(_save(tmp_path / "m.nii.gz", data, sform_lps=grid.affine_lps, qform_lps=other), grid)
    assert np.array_equal(label.data, data) and not label.resampled


def test_qform_is_used_when_sform_code_is_0(tmp_path, grid):
    data = _labels(1)
    path = _save(tmp_path / "m.nii", data, qform_lps=grid.affine_lps)
    label = mask_to_grid(path, grid)
    assert np.array_equal(label.data, data)


@pytest.mark.parametrize("case", ["sform", "qform", "both", "sform_off_pixdim", "qform_off_pixdim", "neither"])
def test_affine_is_the_one_monai_nibabelreader_uses(tmp_path, grid, case):
    """Including MONAI's correction: a transform whose voxel sizes disagree with pixdim gives way to one
    that agrees."""
    shifted = grid.affine_lps.copy()
    shifted[:3, 3] += 3.0
    scaled = grid.affine_lps.copy()
    scaled[:3, :3] *= 2.0
    sform = {"sform": grid.affine_lps, "both": grid.affine_lps, "sform_off_pixdim": scaled,
             "qform_off_pixdim": shifted}.get(case)
    qform = {"qform": shifted, "both": shifted, "sform_off_pixdim": shifted, "qform_off_pixdim": scaled}.get(case)
    pixdim = (0.8, 0.7, 2.5) if case.endswith("off_pixdim") else None
    path = _save(tmp_path / "m.nii.gz", _labels(), sform_lps=sform, qform_lps=qform, pixdim=pixdim)
    reader = NibabelReader()
    _, meta = reader.get_data(reader.read(str(path)))
    np.testing.assert_allclose(nifti_affine(nib.load(path)), np.asarray(meta["affine"]), atol=1e-5)


def test_sheared_affine_is_placed_not_refused(tmp_path, grid):
    """Non-orthonormal direction cosines (SimpleITK refuses them): mask voxel (x, y, z) lies at grid
    voxel (x + y, y, z), so the placement is known exactly."""
    data = np.zeros((6, 10, 8), np.uint8)
    data[1:5, 2:8, 0:2] = np.random.default_rng(2).integers(1, 4, size=(4, 6, 2))
    shear = np.eye(4)
    shear[0, 1] = 1.0
    path = _save(tmp_path / "m.nii.gz", data, sform_lps=grid.affine_lps @ shear)
    label = mask_to_grid(path, grid)
    expected = np.zeros_like(data)
    z, y, x = np.nonzero(data)
    keep = x + y < 8
    expected[z[keep], y[keep], x[keep] + y[keep]] = data[z[keep], y[keep], x[keep]]
    assert label.resampled and np.array_equal(label.data, expected)
    assert "share voxel centres" in label.notes[0]


def test_coverage_counts_the_voxel_centres_inside_the_grid_whatever_the_affine():
    """The row-run count of foreground inside the grid equals placing every voxel centre one by one, for
    random affines (sheared, flipped, permuted, whole-voxel shifts whose centres land on the grid's edges)."""
    from medload.labels.masks import _coverage

    rng = np.random.default_rng(7)
    for case in range(60):
        affine = np.eye(4)
        affine[:3, :3] = np.linalg.qr(rng.normal(size=(3, 3)))[0] * rng.uniform(0.5, 3, 3)
        grid = SeriesGrid(tuple(int(n) for n in rng.integers(3, 12, 3)), affine)
        labels = (rng.random(tuple(int(n) for n in rng.integers(2, 12, 3))) < 0.4).astype(np.uint8)
        mask = np.eye(4)
        if case % 2:
            mask[:3, :3] = rng.normal(size=(3, 3)) * 2
            mask[:3, 3] = rng.normal(size=3) * 5
        else:
            perm = np.eye(3)[rng.permutation(3)] * rng.choice([-1, 1], 3)
            mask[:3, :3] = affine[:3, :3] @ perm
            mask[:3, 3] = affine[:3, :3] @ rng.integers(-4, 8, 3) + affine[:3, 3]
        z, y, x = np.nonzero(labels)
        idx = (np.linalg.inv(affine) @ mask @ np.stack([x, y, z, np.ones_like(x)]))[:3]
        top = np.asarray(grid.shape[::-1])[:, None] - 0.5
        expected = (int(((idx >= -0.5) & (idx < top)).all(axis=0).sum()), len(x))
        assert _coverage(labels, mask, grid) == expected, case

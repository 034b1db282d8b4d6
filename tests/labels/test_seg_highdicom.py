"""DICOM SEG placement cross-checked against highdicom's own volume, and the TILED_FULL layout."""

from __future__ import annotations

import io

import highdicom as hd
import numpy as np
import pydicom
import pytest
from pydicom.sr.codedict import codes

from medload.labels.grid import RAS_TO_LPS, SeriesGrid
from medload.labels.seg import seg_to_grid
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.tiled_seg import to_tiled_full


def _reread(ds: pydicom.Dataset) -> pydicom.Dataset:
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return pydicom.dcmread(io.BytesIO(buf.getvalue()))


def _series(tmp_path, **spec) -> tuple[SeriesGrid, list[pydicom.Dataset]]:
    gen = make_series(tmp_path, SeriesSpec(n_slices=6, rows=24, cols=20, **spec), seed=21)
    sources = [pydicom.dcmread(p) for p in gen.paths]
    return SeriesGrid((6, 24, 20), RAS_TO_LPS @ gen.affine_ras, tuple(d.SOPInstanceUID for d in sources)), sources


def _seg(sources, mask, **kwargs) -> pydicom.Dataset:
    descriptions = [hd.seg.SegmentDescription(k + 1, name, codes.SCT.Tissue, code, hd.seg.SegmentAlgorithmTypeValues.MANUAL)
                    for k, (name, code) in enumerate([("Liver", codes.SCT.Liver), ("Spleen", codes.SCT.Spleen)])]
    return _reread(hd.seg.Segmentation(sources, mask, "BINARY", descriptions, hd.UID(), 99, hd.UID(), 1, "medload",
                                       "test", "0", "0", **kwargs))


def _mask() -> np.ndarray:
    mask = np.zeros((6, 24, 20, 2), bool)
    mask[1:4, 5:10, 3:8, 0] = True
    mask[2:6, 8:15, 6:12, 1] = True
    return mask


def _highdicom_on_grid(ds: pydicom.Dataset, grid: SeriesGrid) -> np.ndarray:
    """highdicom's volume of the SEG (its own grid and slice order), moved voxel by voxel onto ``grid``;
    the higher segment number wins where segments overlap, as in medload."""
    volume = hd.seg.Segmentation.from_dataset(ds).get_volume()
    labels = np.zeros(volume.array.shape[:3], np.uint8)
    for k in range(volume.array.shape[3]):
        labels[volume.array[..., k] > 0] = k + 1
    s, r, c = np.indices(labels.shape).reshape(3, -1)
    world = (volume.affine @ np.c_[s, r, c, np.ones_like(s)].T).T[:, :3]
    j, i, z = np.rint(grid.to_index(world)).astype(int).T
    out = np.zeros(grid.shape, np.uint8)
    out[z, i, j] = labels.ravel()
    return out


@pytest.mark.parametrize("orientation", ["axial", "oblique"])
def test_placement_equals_highdicoms_volume(tmp_path, orientation):
    grid, sources = _series(tmp_path, orientation=orientation)
    ds = _seg(sources, _mask())
    ours = seg_to_grid(ds, grid).data
    assert ours.any() and np.array_equal(ours, _highdicom_on_grid(ds, grid))


def test_tiled_full_seg_is_placed_like_the_per_frame_one(tmp_path):
    """TILED_FULL has no per-frame functional groups: highdicom computes each frame's segment and plane.
    The result equals the mask, our placement of the same SEG with per-frame groups, and highdicom's
    volume of that one (highdicom cannot build a volume of a TILED_FULL object with several planes)."""
    grid, sources = _series(tmp_path, origin=(-10.0, -12.0, 0.0), slice_spacing=2.0)
    mask = _mask()
    per_frame = _seg(sources, mask, omit_empty_frames=False)
    tiled = _reread(to_tiled_full(_seg(sources, mask, omit_empty_frames=False)))
    assert "PerFrameFunctionalGroupsSequence" not in tiled and tiled.DimensionOrganizationType == "TILED_FULL"
    label = seg_to_grid(tiled, grid)
    expected = np.where(mask[..., 1], 2, np.where(mask[..., 0], 1, 0))
    assert np.array_equal(label.data, expected) and label.classes == {1: "Liver", 2: "Spleen"}
    assert np.array_equal(label.data, seg_to_grid(per_frame, grid).data)
    assert np.array_equal(label.data, _highdicom_on_grid(per_frame, grid))


def test_tiled_full_seg_is_ingested_with_its_series(tmp_path, run_ingest):
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(n_slices=6, rows=24, cols=20, origin=(-10.0, -12.0, 0.0), slice_spacing=2.0),
                      seed=22)
    sources = [pydicom.dcmread(p) for p in gen.paths]
    mask = _mask()
    to_tiled_full(_seg(sources, mask, omit_empty_frames=False)).save_as(src / "tiled_seg.dcm", enforce_file_format=True)
    report, store = run_ingest(src)
    (rec,) = store.series()
    label = store.labels(rec.key_bytes)
    assert label is not None and label.kind == "seg" and not [r for r in report.rejects if r.stage == "labels"]
    expected = np.where(mask[..., 1], 2, np.where(mask[..., 0], 1, 0))
    assert np.array_equal(store.read_label(rec.key), expected)

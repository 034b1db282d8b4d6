"""RTSTRUCT contours land on the expected voxels of their series grid (written to disk, read back)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.tag import Tag
from pydicom.uid import RTStructureSetStorage

from medload.errors import ConfigError
from medload.labels.grid import RAS_TO_LPS, LabelProblem, SeriesGrid
from medload.labels.rtstruct import fill_polygons, rtstruct_to_grid
from medload.storage.records import kept_fraction
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.dataset import new_dataset
from medload.synthetic.rtstruct import make_rtstruct

SHAPE = (6, 32, 40)  # (D, H, W)
_CONTOUR_DATA = 0x30060050

# Polygons in (column, row) index coordinates; corners on half-integers, so the inside centres are unambiguous.
SQUARE = np.array([[4.5, 2.5], [12.5, 2.5], [12.5, 9.5], [4.5, 9.5]])  # rows 3..9, columns 5..12
OUTER = np.array([[19.5, 9.5], [29.5, 9.5], [29.5, 19.5], [19.5, 19.5]])  # rows 10..19, columns 20..29
HOLE = np.array([[22.5, 12.5], [26.5, 12.5], [26.5, 16.5], [22.5, 16.5]])  # rows 13..16, columns 23..26
ISLAND_A = np.array([[0.5, 0.5], [3.5, 0.5], [3.5, 2.5], [0.5, 2.5]])  # rows 1..2, columns 1..3
ISLAND_B = np.array([[34.5, 27.5], [38.5, 27.5], [38.5, 30.5], [34.5, 30.5]])  # rows 28..30, columns 35..38
# Right triangle whose hypotenuse x = 4.75 - y / 2 never passes through a voxel centre.
TRIANGLE = np.array([[0.5, 0.5], [4.5, 0.5], [0.5, 8.5]])


def _triangle_mask() -> np.ndarray:
    m = np.zeros(SHAPE[1:], dtype=bool)
    for row, last_col in {1: 4, 2: 3, 3: 3, 4: 2, 5: 2, 6: 1, 7: 1}.items():
        m[row, 1:last_col + 1] = True
    return m


@pytest.fixture(scope="module", params=["axial", "oblique"])
def series(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"series-{request.param}")
    gen = make_series(out, SeriesSpec(n_slices=SHAPE[0], rows=SHAPE[1], cols=SHAPE[2], orientation=request.param),
                      seed=11)
    return gen, SeriesGrid(SHAPE, affine_lps=RAS_TO_LPS @ gen.affine_ras)


@pytest.fixture
def axial(tmp_path):
    gen = make_series(tmp_path / "series", SeriesSpec(n_slices=SHAPE[0], rows=SHAPE[1], cols=SHAPE[2]), seed=5)
    return gen, SeriesGrid(SHAPE, affine_lps=RAS_TO_LPS @ gen.affine_ras)


def _roundtrip(gen, rois, path: Path, **kw) -> pydicom.Dataset:
    return pydicom.dcmread(make_rtstruct(gen, rois, path, **kw))


def test_square_triangle_hole_islands(series, tmp_path):
    gen, grid = series
    ds = _roundtrip(gen, {
        "Body": [(2, [SQUARE]), (0, [SQUARE, ISLAND_B]), (5, [TRIANGLE])],
        "Ring": [(1, [OUTER, HOLE]), (4, [ISLAND_A, ISLAND_B])],
    }, tmp_path / "rs.dcm")
    assert ds.SOPClassUID == RTStructureSetStorage
    vol = rtstruct_to_grid(ds, grid, source="rs.dcm")

    expected = np.zeros(SHAPE, dtype=np.uint8)
    expected[2, 3:10, 5:13] = 1
    expected[0, 3:10, 5:13] = 1
    expected[0, 28:31, 35:39] = 1
    expected[5][_triangle_mask()] = 1
    expected[1, 10:20, 20:30] = 2
    expected[1, 13:17, 23:27] = 0  # the hole
    expected[4, 1:3, 1:4] = 2
    expected[4, 28:31, 35:39] = 2

    assert vol.data.dtype == np.uint8 and vol.data.shape == SHAPE
    assert vol.classes == {1: "Body", 2: "Ring"} and vol.kind == "rtstruct" and vol.source == "rs.dcm"
    np.testing.assert_array_equal(vol.data, expected)
    assert vol.notes == []
    assert vol.foreground_counts()[1].tolist() == [0, 100 - 16]


def test_roi_map_case_overlap_and_unmapped(axial, tmp_path):
    gen, grid = axial
    overlap = np.array([[10.5, 5.5], [14.5, 5.5], [14.5, 12.5], [10.5, 12.5]])  # rows 6..12, columns 11..14
    ds = _roundtrip(gen, {
        "SPLEEN": [(3, [overlap])],
        "  liver ": [(3, [SQUARE])],
        "Couch": [(0, [OUTER])],
    }, tmp_path / "rs.dcm")
    vol = rtstruct_to_grid(ds, grid, roi_map={"liver": ["Liver", "LIVER_1"], "spleen": ["Spleen"]})

    expected = np.zeros(SHAPE, dtype=np.uint8)
    expected[3, 3:10, 5:13] = 1
    expected[3, 6:13, 11:15] = 2  # spleen (class 2) overwrites liver (class 1) on rows 6..9, columns 11..12
    np.testing.assert_array_equal(vol.data, expected)
    assert vol.classes == {1: "liver", 2: "spleen"}
    assert any("'Couch'" in n and "not in roi_map" in n for n in vol.notes)
    assert any("overwrote 8 voxels" in n for n in vol.notes)


def test_without_map_ids_follow_roi_number(axial, tmp_path):
    gen, grid = axial
    ds = _roundtrip(gen, {"b": [(1, [SQUARE])], "a": [(1, [ISLAND_A])]}, tmp_path / "rs.dcm")
    vol = rtstruct_to_grid(ds, grid)
    assert vol.classes == {1: "b", 2: "a"}
    assert vol.data[1, 5, 7] == 1 and vol.data[1, 1, 1] == 2


def test_off_grid_contours_are_noted(axial, tmp_path):
    gen, grid = axial
    ds = _roundtrip(gen, {"Liver": [(2, [SQUARE]), (2.5, [SQUARE]), (6, [SQUARE]), (-1, [SQUARE])]}, tmp_path / "rs.dcm")
    vol = rtstruct_to_grid(ds, grid)
    expected = np.zeros(SHAPE, dtype=np.uint8)
    expected[2, 3:10, 5:13] = 1
    np.testing.assert_array_equal(vol.data, expected)
    (note,) = [n for n in vol.notes if "off the grid" in n]
    z0, step = gen.ipp[0, 2], gen.ipp[1, 2] - gen.ipp[0, 2]
    assert "'Liver'" in note and "3 of 4 contours" in note and "between slices" in note and "outside slices" in note
    for z in (2.5, 6, -1):
        assert f"z={z0 + z * step:.2f} mm" in note


def test_contours_outside_the_grid_are_counted_as_cut(axial, tmp_path):
    """Foreground beyond the last slice, or past a slice's edge, is outside the grid: counted in ``coverage``
    (voxel centres inside the contours wherever they lie) against what lands; a contour between two slices
    is only noted (it lies within the grid)."""
    gen, grid = axial
    past_edge = SQUARE + [32.0, 0.0]  # columns 37..44: 3 of its 8 columns on the slice (W = 40)
    ds = _roundtrip(gen, {"Liver": [(1, [SQUARE]), (2, [past_edge]), (6, [SQUARE]), (2.5, [HOLE])]},
                    tmp_path / "rs.dcm")
    vol = rtstruct_to_grid(ds, grid)
    assert vol.coverage == (56 + 21, 3 * 56) and vol.kept == kept_fraction(77, 168)
    assert int(np.count_nonzero(vol.data)) == 77
    assert any("77 of the RTSTRUCT's 168 foreground voxels" in n and "(45.8%)" in n for n in vol.notes)
    inside = rtstruct_to_grid(_roundtrip(gen, {"Liver": [(1, [SQUARE])]}, tmp_path / "in.dcm"), grid)
    assert inside.coverage == (56, 56) and inside.kept == 1.0 and not any("cut off" in n for n in inside.notes)


def test_all_contours_off_grid_raise(axial, tmp_path):
    gen, grid = axial
    ds = _roundtrip(gen, {"Liver": [(1, [SQUARE])], "Ghost": [(7, [SQUARE]), (3.5, [HOLE])]}, tmp_path / "rs.dcm")
    with pytest.raises(LabelProblem, match="'Ghost'"):
        rtstruct_to_grid(ds, grid)
    # leaving the ROI out with a map places the rest
    vol = rtstruct_to_grid(ds, grid, roi_map={"liver": ["liver"]})
    assert vol.data.sum() == 7 * 8


def test_tilted_point_and_open_contours_are_skipped(axial, tmp_path):
    gen, grid = axial
    tilted = np.c_[SQUARE, [1.0, 1.0, 2.0, 2.0]]  # (column, row, slice) per vertex
    ds = _roundtrip(gen, {
        "Liver": [(1, [tilted]), (3, [SQUARE])],
        "Marker": [(2, [np.array([[5.0, 5.0]])])],
        "Line": [(2, [OUTER])],
    }, tmp_path / "rs.dcm", contour_types={"Line": "OPEN_PLANAR"})
    vol = rtstruct_to_grid(ds, grid)
    expected = np.zeros(SHAPE, dtype=np.uint8)
    expected[3, 3:10, 5:13] = 1
    np.testing.assert_array_equal(vol.data, expected)
    assert any("'Liver'" in n and "tilted" in n for n in vol.notes)
    assert any("'Marker'" in n and "POINT" in n for n in vol.notes)
    assert any("'Line'" in n and "OPEN_PLANAR" in n for n in vol.notes)


def test_written_file_references_the_series(axial, tmp_path):
    gen, _ = axial
    ds = _roundtrip(gen, {"Liver": [(4, [SQUARE])]}, tmp_path / "rs.dcm")
    slices = [pydicom.dcmread(p, stop_before_pixels=True) for p in gen.paths]
    (frame,) = ds.ReferencedFrameOfReferenceSequence
    assert frame.FrameOfReferenceUID == slices[0].FrameOfReferenceUID
    (study,) = frame.RTReferencedStudySequence
    assert study.ReferencedSOPInstanceUID == gen.study_uid == ds.StudyInstanceUID
    (ref_series,) = study.RTReferencedSeriesSequence
    assert ref_series.SeriesInstanceUID == gen.series_uid
    assert [r.ReferencedSOPInstanceUID for r in ref_series.ContourImageSequence] == [s.SOPInstanceUID for s in slices]
    contour = ds.ROIContourSequence[0].ContourSequence[0]
    assert contour.ContourImageSequence[0].ReferencedSOPInstanceUID == slices[4].SOPInstanceUID
    assert contour.NumberOfContourPoints == 4 and ds.Modality == "RTSTRUCT"
    np.testing.assert_allclose(np.asarray(contour.ContourData, float).reshape(-1, 3)[:, 2],
                               float(slices[4].ImagePositionPatient[2]))


def test_bad_inputs(axial, tmp_path):
    gen, grid = axial
    with pytest.raises(LabelProblem, match="not RT Structure Set"):
        rtstruct_to_grid(pydicom.dcmread(gen.paths[0]), grid)
    ds = _roundtrip(gen, {"Liver": [(1, [SQUARE])]}, tmp_path / "rs.dcm")
    with pytest.raises(ConfigError, match="both"):
        rtstruct_to_grid(ds, grid, roi_map={"a": ["liver"], "b": ["LIVER"]})


def test_fill_boundary_rule_and_parity():
    # edges through voxel centres: left/top edges are inside, right/bottom outside
    m = fill_polygons([np.array([[1.0, 1.0], [4.0, 1.0], [4.0, 3.0], [1.0, 3.0]])], (5, 6))
    assert np.argwhere(m).tolist() == [[1, 1], [1, 2], [1, 3], [2, 1], [2, 2], [2, 3]]
    # a polygon drawn twice cancels out (even-odd), clockwise or not
    assert not fill_polygons([SQUARE, SQUARE[::-1]], (32, 40)).any()
    # partly outside the slice: clipped
    m = fill_polygons([np.array([[-5.5, -5.5], [2.5, -5.5], [2.5, 1.5], [-5.5, 1.5]])], (4, 4))
    assert m.sum() == 6 and m[:2, :3].all()


def _in_memory_rtstruct(rois: dict[str, list[np.ndarray]]) -> pydicom.Dataset:
    """A minimal RTSTRUCT with LPS contours, written to bytes and read back (ContourData parsed from disk form)."""
    ds = new_dataset(RTStructureSetStorage, "1.2.826.0.1.3680043.8.498.1")
    ds.StructureSetROISequence, ds.ROIContourSequence = [], []
    for number, (name, contours) in enumerate(rois.items(), start=1):
        ds.StructureSetROISequence.append(Dataset())
        ds.StructureSetROISequence[-1].ROINumber, ds.StructureSetROISequence[-1].ROIName = number, name
        items = []
        for pts in contours:
            item = Dataset()
            item.ContourGeometricType, item.NumberOfContourPoints = "CLOSED_PLANAR", len(pts)
            text = "\\".join(np.char.mod("%.4f", np.ravel(pts)).tolist()).encode()
            text += b" " * (len(text) % 2)  # raw DS bytes: pydicom's per-value DS objects would take seconds here
            item[_CONTOUR_DATA] = RawDataElement(Tag(_CONTOUR_DATA), "DS", len(text), text, 0, False, True)
            items.append(item)
        roi = Dataset()
        roi.ReferencedROINumber, roi.ContourSequence = number, items
        ds.ROIContourSequence.append(roi)
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    buf.seek(0)
    return pydicom.dcmread(buf)


def test_many_classes_give_uint16():
    grid = SeriesGrid((1, 20, 20), affine_lps=np.eye(4))
    rois = {f"r{n}": [np.array([[0.5, 0.5, 0.0], [1.5, 0.5, 0.0], [1.5, 1.5, 0.0]])] for n in range(300)}
    vol = rtstruct_to_grid(_in_memory_rtstruct(rois), grid)
    assert vol.data.dtype == np.uint16 and vol.data.max() == 300 and len(vol.classes) == 300


def test_hundreds_of_contours_on_a_full_size_grid():
    """600 contours of 400 points on 100 x 512 x 512: islands and overlaps land right (no timing here: speed
    belongs in the benchmark, and a busy CI machine would make a time limit flaky)."""
    d, h, w = 100, 512, 512
    affine = np.diag([0.8, 0.8, 2.0, 1.0])
    affine[:3, 3] = (-200.0, -180.0, -90.0)
    grid = SeriesGrid((d, h, w), affine_lps=affine)
    t = np.linspace(0, 2 * np.pi, 400, endpoint=False)
    rois = {}
    for r in range(3):
        contours = []
        for k in range(d):
            for radius, centre in ((150.0 - 40 * r, (256.0, 256.0)), (30.0, (256.0, 256.0 + 60 * r))):
                col, row = centre[0] + radius * np.cos(t), centre[1] + radius * np.sin(t)
                contours.append(grid.to_world(np.c_[col, row, np.full_like(t, k)]))
        rois[f"organ{r}"] = contours
    ds = _in_memory_rtstruct(rois)  # 600 contours of 400 points
    vol = rtstruct_to_grid(ds, grid)
    # organ2 (radius 70) covers the centre; its second contour lies outside it (an island); col 120 is organ0 only
    assert vol.data[50, 256, 256] == 3 and vol.data[50, 256, 120] == 1


def test_enhanced_ct_series_references_frames(tmp_path):
    gen = make_series(tmp_path / "series", SeriesSpec(n_slices=SHAPE[0], rows=SHAPE[1], cols=SHAPE[2],
                                                      orientation="oblique", multiframe=True), seed=3)
    grid = SeriesGrid(SHAPE, affine_lps=RAS_TO_LPS @ gen.affine_ras)
    ds = _roundtrip(gen, {"Liver": [(3, [SQUARE])]}, tmp_path / "rs.dcm")
    ref = ds.ROIContourSequence[0].ContourSequence[0].ContourImageSequence[0]
    assert ref.ReferencedFrameNumber == 4
    vol = rtstruct_to_grid(ds, grid)
    expected = np.zeros(SHAPE, dtype=np.uint8)
    expected[3, 3:10, 5:13] = 1
    np.testing.assert_array_equal(vol.data, expected)

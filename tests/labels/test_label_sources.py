"""DICOM SEG and NIfTI/NRRD masks placed on the grid of their series (medload.labels.seg / .masks)."""

from __future__ import annotations

import io

import highdicom as hd
import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from conftest import DATA
from pydicom.pixels import pack_bits
from pydicom.sr.codedict import codes

from medload.deid import Pseudonymizer, load_key
from medload.labels.grid import RAS_TO_LPS, LabelProblem, SeriesGrid
from medload.labels.masks import mask_to_grid
from medload.labels.seg import read_segments, seg_to_grid
from medload.synthetic import SeriesSpec, make_series

GE = DATA / "ge_ct_3slice_seg"
LIVER_VOXELS = [36233, 35645, 35220]  # per slice, in z order (03.dcm, 02.dcm, 01.dcm)


def header_grid(datasets: list[pydicom.Dataset]) -> SeriesGrid:
    """Grid of single-frame slices from their headers alone (sorted along the normal), raw UIDs as instances."""
    iop = np.asarray(datasets[0].ImageOrientationPatient, float)
    normal = np.cross(iop[:3], iop[3:])
    ds = sorted(datasets, key=lambda d: float(normal @ np.asarray(d.ImagePositionPatient, float)))
    ipp = np.array([d.ImagePositionPatient for d in ds], float)
    row_spacing, col_spacing = (float(x) for x in ds[0].PixelSpacing)
    affine = np.eye(4)
    affine[:3, 0], affine[:3, 1] = iop[:3] * col_spacing, iop[3:] * row_spacing
    affine[:3, 2] = (ipp[-1] - ipp[0]) / (len(ds) - 1)
    affine[:3, 3] = ipp[0]
    return SeriesGrid((len(ds), int(ds[0].Rows), int(ds[0].Columns)), affine, tuple(d.SOPInstanceUID for d in ds))


def dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2 * np.logical_and(a, b).sum() / (a.sum() + b.sum())


@pytest.fixture(scope="module")
def ge_grid() -> SeriesGrid:
    return header_grid([pydicom.dcmread(f) for f in sorted((GE / "ct-3slice").glob("*.dcm"))])


# --- real data: dcmqi's liver SEG and NRRD on 3 GE slices -------------------------------------------------------

def test_real_seg_and_nrrd_land_on_the_same_voxels(ge_grid):
    seg = seg_to_grid(pydicom.dcmread(GE / "liver.dcm"), ge_grid, source="liver.dcm")
    nrrd = mask_to_grid(GE / "liver_seg.nrrd", ge_grid, class_names={1: "Liver"})
    assert seg.data.shape == nrrd.data.shape == (3, 512, 512) and seg.data.dtype == np.uint8
    assert dice(seg.data == 1, nrrd.data == 1) == 1.0 and np.array_equal(seg.data, nrrd.data)
    assert seg.foreground_counts()[:, 0].tolist() == LIVER_VOXELS  # non-empty on every slice, in z order
    assert seg.classes == nrrd.classes == {1: "Liver"} and not seg.resampled and not nrrd.resampled
    assert "segment 1: Liver (type SRT T-62000 'Liver'; category SRT T-D0050 'Tissue')" in seg.notes
    assert not any("source image" in n for n in seg.notes)  # positions agree with the referenced slices
    assert read_segments(pydicom.dcmread(GE / "liver.dcm"))[1].property_type == "SRT T-62000 'Liver'"


def test_real_seg_placed_by_pseudonymised_uid_on_an_ingested_grid(run_ingest, tmp_path, ge_grid):
    _, store = run_ingest(GE / "ct-3slice")
    pseudo = Pseudonymizer(load_key(create=False))
    rec = store.series()[0]
    grid = SeriesGrid.from_record(rec, tuple(pseudo.uid("instance", u) for u in ge_grid.instances))
    assert np.allclose(grid.affine_lps, ge_grid.affine_lps, atol=1e-3)
    ds = pydicom.dcmread(GE / "liver.dcm")
    for item in ds.PerFrameFunctionalGroupsSequence:  # leave only the source-image references
        del item.PlanePositionSequence
    label = seg_to_grid(ds, grid, uid_pseudonym=lambda uid: pseudo.uid("instance", uid))
    assert np.array_equal(label.data, mask_to_grid(GE / "liver_seg.nrrd", grid).data)
    assert "3 frames without a position placed by their referenced source image" in label.notes
    with pytest.raises(LabelProblem, match="frame 1 .*pass uid_pseudonym") as err:
        seg_to_grid(ds, grid)  # raw UIDs never match pseudonyms
    assert "1.2.392" not in str(err.value)  # messages never quote UIDs


# --- synthetic masks -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oblique_grid() -> SeriesGrid:
    rot = np.linalg.qr(np.random.default_rng(1).normal(size=(3, 3)))[0]
    affine = np.eye(4)
    affine[:3, :3] = rot * np.array([0.8, 0.7, 2.5])
    affine[:3, 3] = (-40.0, 12.5, 100.0)
    return SeriesGrid((6, 10, 8), affine)


def labels(shape=(6, 10, 8), seed=0) -> np.ndarray:
    out = np.zeros(shape, np.uint8)
    out[1:5, 2:8, 2:6] = np.random.default_rng(seed).integers(0, 4, size=(4, 6, 4))
    return out


def write_mask(path, data: np.ndarray, affine_lps: np.ndarray):
    """Write ``data`` (z, y, x) with SimpleITK, voxel (x, y, z) at ``affine_lps @ (x, y, z, 1)``."""
    spacing = np.linalg.norm(affine_lps[:3, :3], axis=0)
    image = sitk.GetImageFromArray(data)
    image.SetOrigin(tuple(affine_lps[:3, 3]))
    image.SetSpacing(tuple(float(s) for s in spacing))
    image.SetDirection(tuple((affine_lps[:3, :3] / spacing).ravel()))
    sitk.WriteImage(image, str(path))
    return path


@pytest.mark.parametrize("name", ["m.nrrd", "m.nii.gz"])
def test_mask_on_the_grid_is_taken_as_is(tmp_path, oblique_grid, name):
    data = labels()
    label = mask_to_grid(write_mask(tmp_path / name, data, oblique_grid.affine_lps), oblique_grid)
    assert np.array_equal(label.data, data) and not label.resampled and label.data.dtype == np.uint8
    assert label.classes == {1: "class_1", 2: "class_2", 3: "class_3"} and label.kind == "mask"


def test_nibabel_ras_nifti_lands_by_physical_position(tmp_path, oblique_grid):
    data = labels()
    nib.save(nib.Nifti1Image(data.transpose(2, 1, 0), RAS_TO_LPS @ oblique_grid.affine_lps), tmp_path / "m.nii.gz")
    assert np.array_equal(mask_to_grid(tmp_path / "m.nii.gz", oblique_grid).data, data)


def test_shifted_origin_resampled_to_where_physical_coordinates_say(tmp_path, oblique_grid):
    data = labels()
    shifted = oblique_grid.affine_lps.copy()
    shifted[:3, 3] = oblique_grid.to_world(np.array([[2.0, 1.0, 1.0]]))[0]  # +2 columns, +1 row, +1 slice
    label = mask_to_grid(write_mask(tmp_path / "m.nrrd", data, shifted), oblique_grid)
    expected = np.zeros_like(data)
    expected[1:, 1:, 2:] = data[:-1, :-1, :-2]
    assert np.array_equal(label.data, expected) and label.resampled
    assert "share voxel centres" in label.notes[0]


def test_flipped_and_permuted_axes_keep_physical_placement(tmp_path, oblique_grid):
    data, a = labels(), oblique_grid.affine_lps
    flipped = a.copy()
    flipped[:3, 0] = -a[:3, 0]
    flipped[:3, 3] = a[:3, 3] + 7 * a[:3, 0]  # column 7 becomes column 0
    swapped = a[:, [1, 0, 2, 3]]  # file x runs along our rows, file y along our columns
    for name, arr, affine in [("flip.nrrd", data[:, :, ::-1], flipped),
                              ("swap.nii.gz", data.transpose(0, 2, 1), swapped)]:
        label = mask_to_grid(write_mask(tmp_path / name, np.ascontiguousarray(arr), affine), oblique_grid)
        assert np.array_equal(label.data, data) and label.resampled, name


def test_finer_mask_resampled_by_nearest_neighbour(tmp_path, oblique_grid):
    data, a = labels(), oblique_grid.affine_lps
    fine = np.repeat(np.repeat(data, 2, axis=1), 2, axis=2)  # half the row and column spacing
    affine = a.copy()
    affine[:3, :2] = a[:3, :2] / 2
    affine[:3, 3] = a[:3, 3] - (a[:3, 0] + a[:3, 1]) / 4
    label = mask_to_grid(write_mask(tmp_path / "fine.nrrd", fine, affine), oblique_grid)
    assert np.array_equal(label.data, data) and "voxel centres differ" in label.notes[0]


def test_mask_partly_outside_the_grid_is_cut_and_counted(tmp_path, oblique_grid):
    """Mask voxels whose centres lie beyond the grid are cut off; ``coverage`` counts them by physical
    position (two slices of four here), whatever nearest-neighbour resampling samples."""
    data, a = labels(), oblique_grid.affine_lps
    moved = a.copy()
    moved[:3, 3] = oblique_grid.to_world(np.array([[0.0, 0.0, 3.0]]))[0]  # mask slices 1-4 at grid slices 4-7
    label = mask_to_grid(write_mask(tmp_path / "m.nrrd", data, moved), oblique_grid, source="cut.nrrd")
    inside, total = int(np.count_nonzero(data[1:3])), int(np.count_nonzero(data))  # mask slices 1, 2: grid 4, 5
    assert label.coverage == (inside, total) and label.kept < 1
    assert np.array_equal(label.data[4:], data[1:3]) and not label.data[:4].any()
    assert any(f"{inside} of the mask's {total} foreground voxels" in n for n in label.notes)
    assert mask_to_grid(write_mask(tmp_path / "on.nrrd", data, a), oblique_grid).coverage == (total, total)


def test_masks_off_the_grid_are_problems(tmp_path, oblique_grid):
    data, far = labels(), oblique_grid.affine_lps.copy()
    far[:3, 3] += 500.0
    with pytest.raises(LabelProblem, match="does not overlap the series"):
        mask_to_grid(write_mask(tmp_path / "far.nrrd", data, far), oblique_grid)
    moved = oblique_grid.affine_lps.copy()
    moved[:3, 3] = oblique_grid.to_world(np.array([[0.0, 0.0, 5.0]]))[0]  # overlaps by one slice, labels beyond
    with pytest.raises(LabelProblem, match="fall outside the series grid"):
        mask_to_grid(write_mask(tmp_path / "moved.nrrd", data, moved), oblique_grid)


def test_mask_values(tmp_path, oblique_grid):
    a = oblique_grid.affine_lps
    binary = (labels() > 0).astype(np.float32)
    label = mask_to_grid(write_mask(tmp_path / "f.nii.gz", binary, a), oblique_grid, class_names={1: "tumour"})
    assert label.data.dtype == np.uint8 and np.array_equal(label.data, binary) and label.classes == {1: "tumour"}
    with pytest.raises(LabelProblem, match="non-integer"):
        mask_to_grid(write_mask(tmp_path / "p.nii.gz", binary * 0.3, a), oblique_grid)
    with pytest.raises(LabelProblem, match="class ids must be"):
        mask_to_grid(write_mask(tmp_path / "n.nrrd", -labels().astype(np.int16), a), oblique_grid)
    big = labels().astype(np.uint16) * 100
    label = mask_to_grid(write_mask(tmp_path / "b.nrrd", big, a), oblique_grid, class_names={100: "a"})
    assert label.data.dtype == np.uint16 and np.array_equal(label.data, big)
    assert label.classes == {100: "a", 200: "class_200", 300: "class_300"}
    with pytest.raises(LabelProblem, match="does not exist"):
        mask_to_grid(tmp_path / "missing.nrrd", oblique_grid)


# --- synthetic DICOM SEG (written by highdicom) ---------------------------------------------------------------

@pytest.fixture(scope="module")
def ct(tmp_path_factory):
    """(grid, source datasets in slice order) of an oblique synthetic CT series of 8 slices of 24x20."""
    gen = make_series(tmp_path_factory.mktemp("ct"), SeriesSpec(n_slices=8, rows=24, cols=20, orientation="oblique"),
                      seed=3)
    sources = [pydicom.dcmread(p) for p in gen.paths]
    grid = SeriesGrid((8, 24, 20), RAS_TO_LPS @ gen.affine_ras, tuple(d.SOPInstanceUID for d in sources))
    return grid, sources


def make_seg(sources, mask, seg_type="BINARY", labels_=("Liver", "Spleen"), **kwargs) -> pydicom.Dataset:
    types = [codes.SCT.Liver, codes.SCT.Spleen, codes.SCT.Kidney]
    descriptions = [hd.seg.SegmentDescription(k + 1, name, codes.SCT.Tissue, types[k],
                                              hd.seg.SegmentAlgorithmTypeValues.MANUAL)
                    for k, name in enumerate(labels_)]
    seg = hd.seg.Segmentation(sources, mask, seg_type, descriptions, hd.UID(), 99, hd.UID(), 1, "medload", "test",
                              "0", "0", **kwargs)
    return reread(seg)


def reread(ds: pydicom.Dataset) -> pydicom.Dataset:
    buf = io.BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return pydicom.dcmread(io.BytesIO(buf.getvalue()))


def shuffle_frames(ds: pydicom.Dataset, seed: int = 0) -> pydicom.Dataset:
    """The same SEG with its frames (pixels and per-frame functional groups together) in a random order."""
    frames = ds.pixel_array.reshape(int(ds.NumberOfFrames), ds.Rows, ds.Columns)
    order = np.random.default_rng(seed).permutation(len(frames))
    ds.PerFrameFunctionalGroupsSequence = [ds.PerFrameFunctionalGroupsSequence[k] for k in order]
    ds.PixelData = pack_bits(frames[order]) if ds.BitsAllocated == 1 else frames[order].tobytes()
    return reread(ds)


def frame_segments(ds) -> list[int]:
    return [int(f.SegmentIdentificationSequence[0].ReferencedSegmentNumber) for f in ds.PerFrameFunctionalGroupsSequence]


def test_multi_segment_seg_shuffled_unequal_frames(ct):
    grid, sources = ct
    mask = np.zeros((8, 24, 20, 2), bool)
    mask[1:4, 5:10, 3:8, 0] = True     # liver on 3 slices
    mask[2:7, 8:15, 6:12, 1] = True    # spleen on 5 slices, overlapping the liver
    ds = shuffle_frames(make_seg(sources, mask))
    segs = frame_segments(ds)
    assert sorted(segs) == [1] * 3 + [2] * 5 and segs != sorted(segs)  # unequal and interleaved
    label = seg_to_grid(ds, grid)
    expected = np.where(mask[..., 1], 2, np.where(mask[..., 0], 1, 0))  # the higher segment number wins
    assert np.array_equal(label.data, expected) and not label.resampled
    assert label.classes == {1: "Liver", 2: "Spleen"}
    overlap = int((mask[..., 0] & mask[..., 1]).sum())
    assert overlap > 0 and f"{overlap} voxels claimed by more than one segment" in " ".join(label.notes)
    assert "segment 1: Liver (type SCT 10200004 'Liver'; category SCT 85756007 'Tissue')" in label.notes


def test_fractional_seg_thresholded_at_half_the_maximum(ct):
    grid, sources = ct
    values = np.array([0.0, 0.3, 0.49, 0.5, 0.51, 1.0])
    prob = np.zeros((8, 24, 20, 1), np.float32)
    prob[2:5, :6, 0, 0] = values  # stored as round(v * 100): 0, 30, 49, 50, 51, 100
    ds = shuffle_frames(make_seg(sources, prob, "FRACTIONAL", labels_=("Liver",), max_fractional_value=100))
    assert ds.BitsAllocated == 8 and ds.MaximumFractionalValue == 100
    label = seg_to_grid(ds, grid)
    expected = np.zeros((8, 24, 20), np.uint8)
    expected[2:5, :6, 0] = values >= 0.5
    assert np.array_equal(label.data, expected)
    assert any("thresholded at >= 0.5 x MaximumFractionalValue 100" in n for n in label.notes)


def test_labelmap_seg(ct):
    grid, sources = ct
    lab = np.zeros((8, 24, 20), np.uint8)
    lab[1:4, 5:10, 3:8], lab[3:7, 12:20, 10:15] = 1, 2
    label = seg_to_grid(make_seg(sources, lab, "LABELMAP"), grid)
    assert np.array_equal(label.data, lab) and label.classes == {1: "Liver", 2: "Spleen"}


def set_ipp(ds, frame: int, ipp) -> None:
    ds.PerFrameFunctionalGroupsSequence[frame].PlanePositionSequence[0].ImagePositionPatient = [
        f"{v:.6f}" for v in ipp]


def test_frame_positions_decide_placement(ct):
    grid, sources = ct
    mask = np.zeros((8, 24, 20, 1), bool)
    mask[2:5, 5:10, 3:8, 0] = True
    base = make_seg(sources, mask, labels_=("Liver",), omit_empty_frames=False)
    ipp = lambda ds, k: np.asarray(ds.PerFrameFunctionalGroupsSequence[k].PlanePositionSequence[0]
                                   .ImagePositionPatient, float)
    k = next(k for k in range(8) if grid.to_index(ipp(base, k)[None])[0, 2].round() == 3)

    moved = reread(base)  # one frame moved by two columns within its slice: resampled, not copied
    set_ipp(moved, k, ipp(base, k) + 2 * grid.affine_lps[:3, 0])
    label = seg_to_grid(moved, grid)
    expected = mask[..., 0].astype(np.uint8)
    expected[3] = 0
    expected[3, 5:10, 5:10] = 1
    assert np.array_equal(label.data, expected) and label.resampled
    assert any("1 frames resampled in-plane" in n for n in label.notes)

    between = reread(base)  # half a slice off: no slice to put it on
    set_ipp(between, k, ipp(base, k) + 0.5 * grid.affine_lps[:3, 2])
    with pytest.raises(LabelProblem, match=rf"SEG frame {k + 1} \(segment 1, position .*slice index 3.50"):
        seg_to_grid(between, grid)

    far = reread(base)  # an empty frame far away is only a note
    empty = next(j for j in range(8) if not far.pixel_array[j].any())
    set_ipp(far, empty, ipp(base, empty) + 50 * grid.affine_lps[:3, 2])
    label = seg_to_grid(far, grid)
    assert np.array_equal(label.data, mask[..., 0]) and "1 empty frames lie on no slice" in " ".join(label.notes)

    no_pos = reread(base)  # no positions: placed by the source image each frame references
    for item in no_pos.PerFrameFunctionalGroupsSequence:
        del item.PlanePositionSequence
    assert np.array_equal(seg_to_grid(no_pos, grid).data, mask[..., 0])
    with pytest.raises(LabelProblem, match="none of its source images"):
        seg_to_grid(no_pos, SeriesGrid(grid.shape, grid.affine_lps))


def test_not_a_seg_is_a_problem(ct):
    grid, sources = ct
    with pytest.raises(LabelProblem, match="not a DICOM SEG"):
        seg_to_grid(sources[0], grid)


def test_real_seg_frame_beyond_the_series_is_cut_off_and_counted(tmp_path, ge_grid):
    """A frame 12 slices below the series lies outside its grid: its foreground is cut off and counted (the
    ingest decides by the fraction kept), not placed; one between two slices cannot be placed at all."""
    ds = pydicom.dcmread(GE / "liver.dcm")
    whole = seg_to_grid(ds, ge_grid)
    assert whole.coverage == (sum(LIVER_VOXELS),) * 2 and whole.kept == 1.0
    first = int(np.count_nonzero(ds.pixel_array[0]))
    set_ipp(ds, 0, (-235.2, -226.8, -140.69))  # 12 slices below the series
    cut = seg_to_grid(ds, ge_grid)
    assert cut.coverage == (sum(LIVER_VOXELS) - first, sum(LIVER_VOXELS)) and 0.6 < cut.kept < 0.7
    assert int(np.count_nonzero(cut.data)) == sum(LIVER_VOXELS) - first
    assert any("1 frames with foreground lie beyond" in n for n in cut.notes)
    assert any(f"{sum(LIVER_VOXELS) - first} of the SEG's {sum(LIVER_VOXELS)} foreground frame pixels" in n
               for n in cut.notes)
    between = ge_grid.to_world(np.array([[0.0, 0.0, 0.5]]))[0]
    set_ipp(ds, 0, between)
    with pytest.raises(LabelProblem, match=r"SEG frame 1 \(segment 1, position .*not on one of the 3 slices"):
        seg_to_grid(ds, ge_grid)

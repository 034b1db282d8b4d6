"""4-D series told apart by vendor tags, DimensionIndexValues or InstanceNumber; incomplete time series;
diffusion b-values and gradients; records of every file (issue 36). Checked against dcm2niix where it
converts the same case."""

from __future__ import annotations

import subprocess

import nibabel as nib
import numpy as np
import pydicom
import pytest

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest.discover import SourceRef
from medload.ingest.headers import read_headers
from medload.storage.nifti import export_nifti
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.fourd import SIEMENS_DIRECTIONS, interrupt_time_series, without_preamble_dicm_at_128
from medload.synthetic.stacks import make_shared_positions

try:  # the PyPI build of dcm2niix (the dev extra), beside Debian's
    from dcm2niix import bin as DCM2NIIX_RECENT
except ImportError:
    DCM2NIIX_RECENT = "dcm2niix"

ORDERED = ("dwi", "siemens_dwi", "siemens_csa", "ge_dwi", "ge_fmri", "instance", "tie", "fmri")


def _dcm2niix(src, out, binary: str = "dcm2niix") -> list:
    out.mkdir()
    subprocess.run([binary, "-z", "n", "-b", "n", "-o", str(out), str(src)], check=True, capture_output=True,
                   timeout=60)
    return sorted(out.glob("*.nii"))


def _volumes(path) -> tuple[list[np.ndarray], np.ndarray]:
    img = nib.as_closest_canonical(nib.load(path))
    data = img.get_fdata()
    return ([data] if data.ndim == 3 else [data[..., i] for i in range(data.shape[3])]), img.affine


def _world(bvec_rows: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """FSL bvecs (3 x N, voxel axes of the image ``affine`` describes) as RAS unit vectors (N x 3)."""
    vectors = np.array(bvec_rows, dtype=np.float64).T
    if np.linalg.det(affine[:3, :3]) > 0:
        vectors[:, 0] = -vectors[:, 0]
    axes = affine[:3, :3] / np.linalg.norm(affine[:3, :3], axis=0)
    return vectors @ axes.T


@pytest.mark.dcm2niix
@pytest.mark.parametrize("binary", ["dcm2niix", DCM2NIIX_RECENT])
@pytest.mark.parametrize("kind", ORDERED)
def test_volumes_come_in_dcm2niix_order(tmp_path, run_ingest, kind, binary):
    """dcm2niix writes one 4-D file; its t-th volume is our t-th stack (time point, or diffusion direction
    in acquisition order), voxel for voxel: vendor tags, InstanceNumber and the tie rule order as it does."""
    made = make_shared_positions(tmp_path / "src", kind, count=4, seed=11)
    report, store = run_ingest(tmp_path / "src")
    assert report.counts["ingested"] == 4 and not report.rejects
    records = {r.split: r for r in store.series()}
    ours = [_volumes(export_nifti(store, records[label].key, tmp_path / f"{label}.nii"))[0][0]
            for label in made.stacks]  # labels in the order the stacks were acquired
    for label, gen in made.stacks.items():
        assert np.array_equal(store.read(records[label].key), gen.hu), label
    (path,) = _dcm2niix(tmp_path / "src", tmp_path / "ref", binary)
    theirs, _ = _volumes(path)
    assert len(theirs) == len(ours)
    for t, (mine, reference) in enumerate(zip(ours, theirs)):
        assert np.array_equal(mine, reference), f"volume {t}"


@pytest.mark.parametrize(("kind", "flag"), [("instance", "order_from_instance_number"),
                                            ("tie", "ties_ordered_by_instance_number"), ("ge_fmri", None),
                                            ("fmri", None)])
def test_instance_number_orders_only_as_the_last_resort_and_says_so(tmp_path, run_ingest, kind, flag):
    make_shared_positions(tmp_path / "src", kind, seed=12)
    _, store = run_ingest(tmp_path / "src")
    for rec in store.series():
        used = {f for f in rec.flags if "instance_number" in f}
        assert used == ({flag} if flag else set()), rec.flags


def test_the_tie_rule_follows_instance_number_not_acquisition_number(tmp_path, run_ingest):
    """AcquisitionNumber 3, 1, 2 with equal AcquisitionTime: the stack written first (InstanceNumber) is t_01."""
    made = make_shared_positions(tmp_path / "src", "tie", seed=13)
    numbers = {pydicom.dcmread(p).AcquisitionNumber for p in made.paths[:4]}
    assert numbers == {3}  # the first stack's AcquisitionNumber is the largest
    _, store = run_ingest(tmp_path / "src")
    first = next(r for r in store.series() if r.split == "t_01")
    assert np.array_equal(store.read(first.key), made.stacks["t_01"].hu)


@pytest.mark.dcm2niix
@pytest.mark.parametrize("kind", ["dwi", "siemens_dwi", "siemens_csa"])
def test_bval_and_bvec_match_dcm2niix(tmp_path, run_ingest, kind):
    """The record keeps b-value and gradient; the exported .bval/.bvec give dcm2niix's b-values and, in
    world coordinates, its gradients, volume by volume."""
    made = make_shared_positions(tmp_path / "src", kind, count=4, seed=14)
    _, store = run_ingest(tmp_path / "src")
    records = {r.split: r for r in store.series()}
    (path,) = _dcm2niix(tmp_path / "src", tmp_path / "ref")
    their_bval = np.loadtxt(path.with_suffix(".bval"))
    their_world = _world(np.loadtxt(path.with_suffix(".bvec")), nib.load(path).affine)
    for t, label in enumerate(made.stacks):
        rec = records[label]
        out = export_nifti(store, rec.key, tmp_path / "ours" / f"{label}.nii")
        bval = float(out.with_suffix(".bval").read_text())
        bvec = np.loadtxt(out.with_suffix(".bvec")).reshape(3, 1)
        assert bval == rec.b_value == their_bval[t]
        np.testing.assert_allclose(_world(bvec, nib.load(out).affine)[0], their_world[t], atol=1e-5)
    if kind != "dwi":  # directions numbered as acquired (x, z, y), not as sorted
        for k, direction in enumerate(SIEMENS_DIRECTIONS, 1):
            assert records[f"b1000_dir{k:02d}"].gradient == direction


def test_an_interrupted_time_series_keeps_its_complete_time_points(tmp_path, run_ingest):
    """Time point 3 stopped after 2 of 4 slices (AcquisitionNumber 1, 21, 41 as a Siemens XA writes): points
    1 and 2 are stored, point 3 rejected with the count, and each of its files is named in its record."""
    made = make_shared_positions(tmp_path / "src", "fmri", count=3, seed=15)
    interrupt_time_series(made.paths, 4, kept=2)
    report, store = run_ingest(tmp_path / "src")
    records = {r.split: r for r in store.series()}
    assert sorted(records) == ["t_01", "t_02"]
    for label, rec in records.items():
        assert np.array_equal(store.read(rec.key), made.stacks[label].hu)
    (reject,) = [r for r in store.rejects() if r.stage == "series"]
    assert reject.reason.startswith("time point 3 has 2 of 4 slices") and len(reject.sources) == 2
    assert report.counts == {**report.counts, "ingested": 2, "rejected": 1}


def test_stacks_told_apart_only_by_dimension_index_values_are_split(tmp_path, run_ingest):
    """Philips pCASL: label and control frames differ only by a private dimension of DimensionIndexValues."""
    made = make_shared_positions(tmp_path / "src", "pcasl", seed=16)
    report, store = run_ingest(tmp_path / "src")
    records = {r.split: r for r in store.series()}
    assert sorted(records) == sorted(made.stacks) and not report.rejects
    for label, gen in made.stacks.items():
        assert np.array_equal(store.read(records[label].key), gen.hu)


@pytest.mark.dcm2niix
def test_pcasl_slices_are_the_slices_dcm2niix_finds(tmp_path, run_ingest):
    """Both dcm2niix builds stack the 8 frames of this synthetic pCASL into one volume (they do not read the
    private dimension here): each of its slices is a slice of one of our two volumes."""
    make_shared_positions(tmp_path / "src", "pcasl", seed=17)
    _, store = run_ingest(tmp_path / "src")
    ours = [store.read(r.key)[z].T for r in store.series() for z in range(4)]
    (path,) = _dcm2niix(tmp_path / "src", tmp_path / "ref", DCM2NIIX_RECENT)
    data = np.asarray(nib.load(path).dataobj)
    assert data.shape[2] == len(ours)
    for k in range(data.shape[2]):
        assert any(np.array_equal(np.flip(data[..., k], 1), s) or np.array_equal(data[..., k], s) for s in ours)


def test_a_candidate_rejected_at_decode_lists_every_file(tmp_path, run_ingest):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=3, rows=16, cols=16), seed=18)
    ds = pydicom.dcmread(gen.paths[1])
    ds.PixelData = b"\xff\x7f" * (16 * 16)  # 32767 - 1024 HU: out of any scanner's range
    ds.save_as(gen.paths[1])
    report, store = run_ingest(tmp_path / "src")
    (reject,) = [r for r in store.rejects() if r.series]
    assert reject.stage in ("decode", "plausibility") and sorted(reject.sources) == sorted(map(str, gen.paths))


def test_a_file_without_preamble_that_holds_dicm_at_byte_128(tmp_path, run_ingest):
    """Read from byte 0 as the bare dataset it is (not "truncated"); damaged, it gets its own reason."""
    gen = make_series(tmp_path / "one", SeriesSpec(n_slices=1, rows=16, cols=16), seed=19)
    src = tmp_path / "src"
    src.mkdir()
    path = without_preamble_dicm_at_128(gen.paths[0], src / "bare.dcm")
    assert path.read_bytes()[128:132] == b"DICM"
    report, store = run_ingest(src)
    (rec,) = store.series()
    assert np.array_equal(store.read(rec.key), gen.hu)
    damaged = tmp_path / "bare_cut.dcm"
    damaged.write_bytes(path.read_bytes()[:200])
    ref = SourceRef(path=str(damaged), member=None, size=200)
    with pytest.raises(InputProblem, match="no DICOM preamble") as caught:
        read_headers(ref, Pseudonymizer(b"k" * 32), IngestConfig())
    assert "truncated" not in caught.value.reason


@pytest.mark.dcm2niix
def test_the_bare_dataset_with_dicm_at_128_is_the_volume_dcm2niix_makes(tmp_path, run_ingest):
    gen = make_series(tmp_path / "one", SeriesSpec(n_slices=1, rows=16, cols=16), seed=20)
    (tmp_path / "src").mkdir()
    without_preamble_dicm_at_128(gen.paths[0], tmp_path / "src" / "bare.dcm")
    _, store = run_ingest(tmp_path / "src")
    (rec,) = store.series()
    (ours,), affine = _volumes(export_nifti(store, rec.key, tmp_path / "ours.nii"))
    (path,) = _dcm2niix(tmp_path / "src", tmp_path / "ref")
    (theirs,), their_affine = _volumes(path)
    assert np.array_equal(ours, theirs)
    np.testing.assert_allclose(affine[:3, :3], their_affine[:3, :3], atol=1e-4)

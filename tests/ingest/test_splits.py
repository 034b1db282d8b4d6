"""Complete stacks at the same positions: split by what their headers say, checked against dcm2niix."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import nibabel as nib
import numpy as np
import pydicom
import pytest
from conftest import slice_header

from medload.ingest.splits import split_stacks
from medload.storage.keys import series_key
from medload.storage.nifti import export_nifti
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.stacks import SHARED_POSITION_KINDS, make_shared_positions

TIMED = {"fmri", "perfusion", "cardiac", "ge_fmri", "instance", "tie"}
try:  # the PyPI build of dcm2niix (the dev extra): newer than Debian's, it splits Enhanced 4-D objects
    from dcm2niix import bin as DCM2NIIX_RECENT
except ImportError:
    DCM2NIIX_RECENT = "dcm2niix"
CLASSIC = ("swi", "dwi", "fmri", "perfusion")


@pytest.mark.parametrize("kind", SHARED_POSITION_KINDS)
def test_each_stack_is_its_own_volume_with_a_flag_naming_it(tmp_path, run_ingest, kind):
    made = make_shared_positions(tmp_path / "src", kind, seed=3)
    report, store = run_ingest(tmp_path / "src")
    assert report.counts["ingested"] == len(made.stacks) and not report.rejects
    records = {r.split: r for r in store.series()}
    assert set(records) == set(made.stacks)
    for label, gen in made.stacks.items():
        rec = records[label]
        assert label in rec.flags
        assert np.array_equal(store.read(rec.key), gen.hu)
        np.testing.assert_allclose(rec.affine, gen.affine_ras, atol=1e-4)
    assert len({r.series for r in records.values()}) == 1 and len({r.key for r in records.values()}) == len(records)
    if kind in TIMED:  # one time series: a shared id (the key the unsplit series would have), points 1..N
        (series_id,) = {r.time_series for r in records.values()}
        assert len(series_id) == 32 and series_id not in {r.key for r in records.values()}
        assert sorted(r.time_point for r in records.values()) == list(range(1, len(records) + 1))
        assert all(r.time_point == int(r.split[2:]) for r in records.values())
    else:
        assert all(r.time_series == "" and r.time_point == 0 for r in records.values())


def _canonical(path) -> tuple[list[np.ndarray], np.ndarray]:
    img = nib.as_closest_canonical(nib.load(path))
    data = img.get_fdata()
    return ([data] if data.ndim == 3 else [data[..., i] for i in range(data.shape[3])]), img.affine


def _dcm2niix(src, out, binary: str = "dcm2niix") -> list:
    out.mkdir()
    subprocess.run([binary, "-z", "n", "-b", "n", "-o", str(out), str(src)], check=True, capture_output=True,
                   timeout=60)
    return sorted(out.glob("*.nii"))


def _each_reference_volume_is_one_of_ours(tmp_path, store, binary: str) -> None:
    ours = {}
    for rec in store.series():
        (volume,), affine = _canonical(export_nifti(store, rec.key, tmp_path / f"{rec.split}.nii"))
        ours[rec.split] = (volume, affine)
    matched = []
    for path in _dcm2niix(tmp_path / "src", tmp_path / "ref", binary):
        volumes, affine = _canonical(path)
        for volume in volumes:
            hits = [label for label, (v, a) in ours.items()
                    if v.shape == volume.shape and np.array_equal(v, volume) and np.allclose(a, affine, atol=1e-3)]
            assert len(hits) == 1, f"dcm2niix volume of {path.name} is none of ours"
            matched += hits
    assert sorted(matched) == sorted(ours)


@pytest.mark.dcm2niix
@pytest.mark.parametrize("kind", CLASSIC)
def test_splits_of_single_frame_series_are_the_volumes_dcm2niix_makes(tmp_path, run_ingest, kind):
    """dcm2niix splits these into separate files (magnitude, ``_ph``) or the volumes of one 4-D file
    (diffusion, time): each of its volumes is one of ours, voxel for voxel, with our affine."""
    make_shared_positions(tmp_path / "src", kind, seed=4)
    _, store = run_ingest(tmp_path / "src")
    _each_reference_volume_is_one_of_ours(tmp_path, store, "dcm2niix")


@pytest.mark.dcm2niix
def test_the_time_points_of_an_enhanced_4d_ct_are_the_volumes_dcm2niix_makes(tmp_path, run_ingest):
    """A recent dcm2niix (PyPI's build; Debian's 1.0.20220720 stacks every frame into one volume) writes
    the cardiac phases of an Enhanced CT as one 4-D file: each of its volumes is one of ours."""
    make_shared_positions(tmp_path / "src", "cardiac", seed=5)
    _, store = run_ingest(tmp_path / "src")
    _each_reference_volume_is_one_of_ours(tmp_path, store, DCM2NIIX_RECENT)


@pytest.mark.dcm2niix
@pytest.mark.parametrize("kind", ["b0map", "echo"])
def test_splits_of_enhanced_mr_hold_the_slices_dcm2niix_finds(tmp_path, run_ingest, kind):
    """dcm2niix (Debian's and PyPI's 1.0.20260724 alike) stacks the frames of these Enhanced MR objects, whose
    stacks differ by frame type or echo, into one volume of N x D slices in position order: every slice of it
    is a slice of one of our volumes, on the same in-plane grid."""
    made = make_shared_positions(tmp_path / "src", kind, seed=5)
    _, store = run_ingest(tmp_path / "src")
    ours = []
    for rec in store.series():
        (volume,), affine = _canonical(export_nifti(store, rec.key, tmp_path / f"{rec.split}.nii"))
        ours += [volume[..., k] for k in range(volume.shape[2])]
    (path,) = _dcm2niix(tmp_path / "src", tmp_path / "ref", DCM2NIIX_RECENT)
    (theirs,), their_affine = _canonical(path)
    assert theirs.shape[2] == len(ours) == len(made.stacks) * made.stacks[next(iter(made.stacks))].hu.shape[0]
    np.testing.assert_allclose(their_affine[:3, :2], affine[:3, :2], atol=1e-4)
    np.testing.assert_allclose(their_affine[:3, 3], affine[:3, 3], atol=1e-3)
    for k in range(theirs.shape[2]):
        assert any(np.array_equal(theirs[..., k], s) for s in ours)


def test_time_series_policy_reject_names_the_points(tmp_path, run_ingest):
    make_shared_positions(tmp_path / "src", "fmri", count=5, seed=6)
    report, store = run_ingest(tmp_path / "src", time_series="reject")
    assert store.series() == []
    (outcome,) = report.series
    assert outcome.status == "rejected" and "time series of 5 points" in outcome.reason
    assert "TemporalPositionIdentifier" in outcome.reason and "--time-series split" in outcome.reason
    (rec,) = [r for r in store.rejects() if r.stage == "series"]
    assert rec.status == "rejected" and len(rec.sources) == 5 * 4


def test_stacks_that_nothing_tells_apart_are_conflicting_duplicates_naming_frames(tmp_path, run_ingest):
    made = make_shared_positions(tmp_path / "src", "cardiac", seed=7)
    ds = pydicom.dcmread(made.paths[0])
    for item in ds.PerFrameFunctionalGroupsSequence:
        del item.FrameContentSequence[0].TemporalPositionIndex
    ds.save_as(made.paths[0])
    report, store = run_ingest(tmp_path / "src")
    assert store.series() == []
    (outcome,) = report.series
    assert outcome.status == "rejected" and "conflicting duplicates" in outcome.reason
    name = made.paths[0].name
    assert f"{name} frame 1 and" in outcome.reason and f"{name} frame 5" in outcome.reason


def test_a_series_without_repeated_positions_keeps_its_key(tmp_path, run_ingest):
    """Keys of series that are not split come from the descriptor they always had: no ``split:`` in it."""
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=5, rows=20, cols=16), seed=8)
    report, store = run_ingest(tmp_path / "src")
    (rec,) = store.series()
    descriptor = "|".join(("image", "20x16", "1.000,0.000,0.000,0.000,1.000,0.000", "0.7000,0.8000", "", ""))
    assert rec.key == series_key(rec.series, descriptor).hex()
    assert rec.split == "" and b'"split"' not in rec.to_json() and b"time_point" not in rec.to_json()
    assert np.array_equal(store.read(rec.key), gen.hu)


def test_a_single_stack_with_per_slice_times_is_not_split():
    """Acquisition times differ per slice in any 2-D acquisition: without repeated positions, no split."""
    headers = [slice_header((0.0, 0.0, 2.0 * k), instance=str(k)) for k in range(4)]
    (only,) = split_stacks(headers, 0.01)
    assert only.labels == () and only.headers == headers


def test_ls_lists_the_split(tmp_path, run_ingest):
    make_shared_positions(tmp_path / "src", "swi", seed=9)
    _, store = run_ingest(tmp_path / "src")
    out = subprocess.run([sys.executable, "-m", "medload.cli", "ls", str(store.path)], capture_output=True,
                         text=True, check=True, env=os.environ.copy()).stdout
    assert "split magnitude" in out and "split phase" in out
    cat = store.catalog()
    assert sorted(cat.split) == ["magnitude", "phase"] and "phase" in cat.set_index("split")["flags"]["phase"]


def test_cli_time_series_reject(tmp_path):
    make_shared_positions(tmp_path / "src", "perfusion", count=4, seed=10)
    proc = subprocess.run([sys.executable, "-m", "medload.cli", "ingest", str(tmp_path / "src"), str(tmp_path / "s"),
                           "--workers", "1", "--no-progress", "--time-series", "reject"], capture_output=True, text=True,
                          env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert "1 rejected" in proc.stdout and "time series of 4 points" in proc.stdout.replace("\n", " ")


def test_a_perfusion_crossing_midnight_is_ordered_by_acquisition_date_and_time(tmp_path, run_ingest):
    """Time points 23:59:59, 00:00:00.5 and 00:00:02 of the next day: the time of day alone would put the
    first last."""
    made = make_shared_positions(tmp_path / "src", "perfusion", seed=6)
    clocks = [("20240301", "235959.000000"), ("20240302", "000000.500000"), ("20240302", "000002.000000")]
    for path in (tmp_path / "src").glob("*.dcm"):
        ds = pydicom.dcmread(path)
        stack = int(path.stem.split("_")[-2])
        ds.AcquisitionDate, time = clocks[stack]
        ds.AcquisitionTime = time[:-3] + f"{int(path.stem.split('_')[-1]):03d}"  # slices a millisecond apart
        ds.save_as(path)
    report, store = run_ingest(tmp_path / "src")
    assert report.counts["ingested"] == 3
    for rec in store.series():
        assert np.array_equal(store.read(rec.key), made.stacks[rec.split].hu), rec.split


@pytest.mark.parametrize(("keyword", "values", "expected"), [
    ("AcquisitionTime", {"AcquisitionDate": "20240102", "AcquisitionTime": "000001.5"}, 738_887 * 86_400 + 1.5),
    ("AcquisitionTime", {"AcquisitionTime": "101010"}, 36_610.0),  # no date: seconds of the day
    ("AcquisitionTime", {"AcquisitionDateTime": "20240102000001"}, 738_887 * 86_400 + 1),
    ("FrameAcquisitionDateTime", {"FrameAcquisitionDateTime": "20240102000001.25+0100"},
     738_887 * 86_400 + 1.25 - 3600),
    ("FrameAcquisitionDateTime", {"FrameAcquisitionDateTime": "20240230120000"}, None),  # no such day
    ("AcquisitionTime", {"AcquisitionTime": "1"}, None),
])
def test_acquisition_clocks_count_seconds_from_one_date(keyword, values, expected):
    from pydicom import Dataset

    from medload.ingest.planes import _clock_seconds

    ds = Dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom warns of the malformed values on purpose here
        for name, value in values.items():
            setattr(ds, name, value)
        got = _clock_seconds(ds, keyword)
    assert (got == "") if expected is None else float(got) == pytest.approx(expected)

"""Ingest acceptance on real scanner data (shipped in sample_data/ and tests/scans/, see tests/scans/README.md)."""

from __future__ import annotations

import hashlib
import shutil

import nibabel as nib
import numpy as np
import pydicom
import pytest
from conftest import DATA, PHILIPS, file_hashes

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.ingest.discover import discover, read_source
from medload.ingest.headers import read_headers
from medload.ingest.pixels import LoadedFile, decode_plane
from medload.storage.nifti import export_nifti


@pytest.fixture(scope="module")
def philips(tmp_path_factory):
    from medload.ingest.run import ingest
    from medload.storage.store import open_store

    path = tmp_path_factory.mktemp("philips") / "store"
    report = ingest(PHILIPS / "dicom", path, config=IngestConfig(workers=2))
    return report, open_store(path)


def test_philips_one_volume_of_28_slices(philips):
    report, store = philips
    records = store.series()
    assert len(records) == 1
    rec = records[0]
    assert rec.shape == (28, 512, 512) and rec.dtype == "int16" and rec.modality == "CT"
    assert rec.manufacturer == "Philips" and rec.kernel == "UB"
    assert rec.spacing == pytest.approx((0.451171875, 0.451171875, 5.0))
    assert report.counts["ingested"] == 1


@pytest.mark.dcm2niix
def test_philips_export_equals_dcm2niix_reference(philips, tmp_path):
    _, store = philips
    rec = store.series()[0]
    out = export_nifti(store, rec.key[:8], tmp_path / "ours.nii.gz")
    ours = nib.as_closest_canonical(nib.load(out))
    ref = nib.as_closest_canonical(nib.load(next((PHILIPS / "ref").glob("*.nii.gz"))))
    assert ours.shape == ref.shape
    assert np.array_equal(np.asarray(ours.dataobj), np.asarray(ref.dataobj))  # voxel for voxel, HU
    assert np.abs(ours.affine - ref.affine).max() < 1e-3


def test_philips_localizer_and_secondary_captures_skipped_with_reasons(philips):
    report, store = philips
    skipped = store.rejects()
    localizer = [r for r in skipped if "localizer" in r.reason]
    captures = [r for r in skipped if "Secondary Capture" in r.reason]
    assert len(localizer) == 1 and localizer[0].status == "skipped" and "S1000" in localizer[0].sources[0]
    assert len(captures) == 6 and all(r.status == "skipped" and "S4010" in r.source for r in captures)
    assert store.rejects(include_skipped=False) == []  # nothing in this study is broken


def test_ge_three_slices_ordered_by_position_not_file_name(run_ingest):
    report, store = run_ingest(DATA / "ge_ct_3slice_seg" / "ct-3slice")
    (rec,) = store.series()
    assert rec.shape == (3, 512, 512)
    z = [p[2] for p in rec.positions]
    assert z == sorted(z) and z[0] == pytest.approx(-128.69, abs=1e-3)  # file 03.dcm comes first
    files = sorted((DATA / "ge_ct_3slice_seg" / "ct-3slice").iterdir())  # 01, 02, 03: positions decrease
    expected = []
    for f in reversed(files):
        ds = pydicom.dcmread(f)
        hu = ds.pixel_array.astype(np.int32) * int(ds.RescaleSlope) + int(ds.RescaleIntercept)
        hu[ds.pixel_array == ds.PixelPaddingValue] = -1024  # padding becomes air (documented policy)
        expected.append(hu)
    assert np.array_equal(store.read(rec.key), np.stack(expected))
    assert rec.padding_voxels > 0


def test_monai_four_slices_rejected_for_irregular_spacing(run_ingest):
    report, store = run_ingest(DATA / "monai_ct_4slice" / "CT_DICOM")
    assert store.series() == []
    (outcome,) = report.series
    assert outcome.status == "rejected" and "irregular spacing" in outcome.reason
    (record,) = store.rejects()
    assert record.stage == "geometry" and len(record.sources) == 4


def test_transfer_syntaxes_decode_identically_and_collapse_to_one_slice(run_ingest):
    files = sorted((DATA / "transfer_syntaxes" / "In").glob("*.dcm"))
    assert len(files) == 9
    pseudo = Pseudonymizer(b"k" * 32)
    planes = []
    for ref in discover([str(f) for f in files]):
        (h,) = read_headers(ref, pseudo, IngestConfig())
        planes.append(decode_plane(LoadedFile(read_source(ref)), h, h.modality, "int16")[0])
    assert all(np.array_equal(planes[0], p) for p in planes[1:])
    assert planes[0].std() > 0
    report, store = run_ingest(DATA / "transfer_syntaxes" / "In")
    (rec,) = store.series()
    assert rec.shape == (1, 384, 384) and rec.modality == "MR"
    assert "duplicates_collapsed" in rec.flags and "single_slice" in rec.flags and "mosaic" in rec.flags
    assert np.array_equal(store.read(rec.key)[0], planes[0])


def test_bad_files_quarantined_good_series_still_ingested(run_ingest, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DATA / "ge_ct_3slice_seg" / "ct-3slice", src / "good")
    good = (src / "good" / "01.dcm").read_bytes()
    (src / "truncated.dcm").write_bytes(good[: len(good) // 2])
    (src / "notes.txt").write_text("not an image\n")
    ds = pydicom.dcmread(src / "good" / "02.dcm")
    del ds.PixelData
    ds.SOPInstanceUID = pydicom.uid.generate_uid()
    ds.save_as(src / "nopixels.dcm")
    report, store = run_ingest(src)
    assert [r.shape for r in store.series()] == [(3, 512, 512)]
    rejects = {r.source.rsplit("/", 1)[-1]: r for r in store.rejects()}
    assert {name: r.status for name, r in rejects.items()} == {
        "truncated.dcm": "rejected", "notes.txt": "ignored", "nopixels.dcm": "rejected"}
    assert [r.source for r in store.rejects(include_skipped=False)] == [str(src / "nopixels.dcm"),
                                                                      str(src / "truncated.dcm")]
    assert "truncated" in rejects["truncated.dcm"].reason
    assert rejects["notes.txt"].reason == "not DICOM: text"
    assert "no Pixel Data" in rejects["nopixels.dcm"].reason
    assert rejects["truncated.dcm"].sha256 == hashlib.sha256(good[: len(good) // 2]).hexdigest()
    assert report.exit_code(strict=False) == 0 and report.exit_code(strict=True) == 1


def test_second_ingest_reports_present_and_changes_no_byte(tmp_path):
    from medload.ingest.run import ingest

    store = tmp_path / "store"
    first = ingest(PHILIPS / "dicom", store, config=IngestConfig(workers=1))
    before = file_hashes(store)
    second = ingest(PHILIPS / "dicom", store, config=IngestConfig(workers=2))
    assert first.counts["ingested"] == 1
    assert second.counts["present"] == 1 and second.counts["ingested"] == 0
    assert second.counts["skipped"] == first.counts["skipped"]
    assert file_hashes(store) == before


def test_a_missing_source_is_an_error_before_anything_is_created(tmp_path):
    from medload.errors import ConfigError
    from medload.ingest.run import ingest

    with pytest.raises(ConfigError, match="source not found"):
        ingest(tmp_path / "typo", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_index_sub_databases_point_to_the_series(philips):
    from conftest import store_dump

    _, store = philips
    rec = store.series()[0]
    entries = {(db, k, v) for db, k, v in store_dump(store) if db.startswith(b"idx_")}
    key = rec.key_bytes
    assert (b"idx_modality", b"CT", key) in entries
    assert (b"idx_study", rec.study.encode(), key) in entries
    assert (b"idx_patient", rec.patient.encode(), key) in entries
    assert (b"idx_body_part", b"BRAIN", key) in entries

"""Predictions back to the PACS as DICOM SEG (medload.writeback), against a real Orthanc.

The round trip: the sample study is ingested from Orthanc over DICOMweb, a fixed prediction (voxels above
300 HU) is pushed as a SEG (STOW-RS), and ingesting the study again brings the SEG back as the series'
label on exactly the same voxels; Orthanc lists the SEG in the study of the CT; no raw UID or patient
identifier reaches the store, the log, warnings or messages. Also: C-STORE to ``dimse://``, the
``medload push-seg`` command, and the refusals (the series is not in the PACS, its instances or its grid
differ from the stored ones, a mask off the grid or with ids a SEG cannot number).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
from conftest import PHILIPS, REPO, write_key
from helpers.orthanc_server import ORTHANC, Orthanc, Proxy
from pydicom.sr.codedict import codes

from medload.config import IngestConfig
from medload.errors import ConfigError
from medload.ingest.run import ingest
from medload.pacs.dicomweb import DicomWebClient, SeriesRef
from medload.pacs.endpoint import Credentials, parse_endpoint
from medload.pacs.ingest import ingest_dicomweb
from medload.storage.store import open_store
from medload.writeback import Segment, WritebackError, connect, push_seg, to_seg

pytestmark = pytest.mark.orthanc

MEDLOAD = [sys.executable, "-m", "medload.cli"]
DICOM = PHILIPS / "dicom"
needs_orthanc = pytest.mark.skipif(ORTHANC is None, reason="Orthanc is not installed (make test installs the Debian "
                                                           "packages orthanc and orthanc-dicomweb)")
ONE_WORKER = IngestConfig(workers=1)


def _headers() -> list[pydicom.Dataset]:
    return [pydicom.dcmread(p, stop_before_pixels=True) for p in sorted(DICOM.rglob("*")) if p.is_file()]


HEADERS = _headers()
CT = [h for h in HEADERS if int(h.SeriesNumber) == 201]  # the 28-slice head CT
STUDY = str(CT[0].StudyInstanceUID)
#: what must never be written to the store or a message: every UID of the sample, and its patient's ID
IDENTIFIERS = sorted({str(h.get(k)) for h in HEADERS for k in ("StudyInstanceUID", "SeriesInstanceUID",
                                                               "SOPInstanceUID", "FrameOfReferenceUID", "PatientID")
                      if h.get(k)})


def _bone(store_path: Path) -> tuple[str, np.ndarray]:
    """The CT's key and the fixed prediction: voxels above 300 HU (class 1)."""
    store = open_store(store_path)
    (rec,) = [r for r in store.series() if r.shape[0] == len(CT)]
    return rec.key, (store.read(rec.key) > 300).astype(np.uint8)


def _leaks(texts: list[str], folder: Path, extra: list[str]) -> list[str]:
    """The identifiers found in ``texts`` or in any file under ``folder``."""
    stored = [p.read_bytes() for p in folder.rglob("*") if p.is_file()]
    return [s for s in IDENTIFIERS + extra
            if any(s in t for t in texts) or any(s.encode() in data for data in stored)]


@pytest.fixture
def orthanc(tmp_path, monkeypatch):
    """A fresh Orthanc holding the sample study (DICOMweb, and DIMSE for C-FIND/C-GET/C-STORE from MEDLOAD)."""
    (tmp_path / "orthanc").mkdir()
    server = Orthanc(tmp_path / "orthanc", dimse=True)
    try:
        assert server.upload(DICOM) == len(HEADERS)
        monkeypatch.setenv("MEDLOAD_DICOMWEB_USER", server.user)
        monkeypatch.setenv("MEDLOAD_DICOMWEB_PASSWORD", server.password)
        yield server
    finally:
        server.stop()


def _segs_in_study(server: Orthanc) -> list[SeriesRef]:
    """The SEG series Orthanc lists in the sample study (QIDO-RS)."""
    with _client(server) as client:
        return client.search_series({"StudyInstanceUID": STUDY, "Modality": "SEG"})


def _client(server: Orthanc) -> DicomWebClient:
    return DicomWebClient(parse_endpoint(server.dicomweb_url), Credentials(server.user, server.password))


@needs_orthanc
def test_round_trip_lands_on_the_same_voxels_and_leaks_no_identifier(orthanc, tmp_path, caplog, recwarn):
    caplog.set_level(logging.DEBUG)
    store = tmp_path / "store"
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    key, bone = _bone(store)
    before = open_store(store)
    result = push_seg(store, key, bone, {1: Segment("bone", property_type=codes.SCT.Bone)}, to=orthanc.dicomweb_url)
    assert result.key == key and result.study == before.record(key).study and result.segments == ("bone",)
    assert result.frames == int((bone.reshape(len(bone), -1) > 0).any(axis=1).sum())

    (seg_series,) = _segs_in_study(orthanc)  # Orthanc files it in the CT's study
    report = ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    (label,) = [o for o in report.labels if o.status == "ingested"]
    assert label.key == key and label.kind == "seg"
    back = open_store(store)
    assert back.labels(key).classes == {"1": "bone"} and not back.labels(key).resampled
    got = back.read_label(key)
    dice = 2 * np.logical_and(got > 0, bone > 0).sum() / ((got > 0).sum() + (bone > 0).sum())
    assert dice == 1.0 and np.array_equal(got, bone)

    with _client(orthanc) as client:
        seg_uids = [seg_series.series, *(i.uid for i in client.search_instances(seg_series))]
    texts = [caplog.text, repr(result), *(str(w.message) for w in recwarn)]
    assert not _leaks(texts, store, [*seg_uids, str(CT[0].PatientName)])


@needs_orthanc
def test_c_store_to_dimse_and_push_seg_command(orthanc, tmp_path):
    store = tmp_path / "store"
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    key, bone = _bone(store)
    result = push_seg(store, key, bone, {1: "bone"}, to=orthanc.dimse_url)  # C-FIND, C-GET, then C-STORE
    assert len(_segs_in_study(orthanc)) == 1 and result.frames > 0

    rec = open_store(store).record(key)
    mask = tmp_path / "bone.nii.gz"
    nib.save(nib.Nifti1Image(bone.transpose(2, 1, 0), np.asarray(rec.affine)), mask)  # as `medload export` writes
    proc = subprocess.run([*MEDLOAD, "-vv", "push-seg", str(store), key[:8], str(mask), "--to", orthanc.dicomweb_url,
                           "--segment", "1=bone", "--algorithm", "threshold-300HU"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"sent a SEG of series {key[:12]} (bone;" in proc.stdout
    assert len(_segs_in_study(orthanc)) == 2
    assert not _leaks([proc.stdout + proc.stderr], store, [])


@needs_orthanc
def test_push_seg_with_a_lineage_record_names_it_in_the_seg(orthanc, tmp_path):
    """``push-seg --lineage RECORD``: the SEG Orthanc holds carries the record's digest as Algorithm Parameters
    (0066,0032) of each segment's algorithm, read back with pydicom."""
    import io

    import medload.lineage
    from medload.data import SliceDataset
    from medload.writeback.seg import LINEAGE_PARAMETER

    store = tmp_path / "store"
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    key, bone = _bone(store)
    record = medload.lineage.save(SliceDataset(open_store(store), labels=False).lineage(), tmp_path / "lineage.json")
    digest = medload.lineage.load(record).digest
    rec = open_store(store).record(key)
    mask = tmp_path / "bone.nii.gz"
    nib.save(nib.Nifti1Image(bone.transpose(2, 1, 0), np.asarray(rec.affine)), mask)
    proc = subprocess.run([*MEDLOAD, "push-seg", str(store), key[:8], str(mask), "--to", orthanc.dicomweb_url,
                           "--segment", "1=bone", "--lineage", str(record)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    (seg_series,) = _segs_in_study(orthanc)
    with _client(orthanc) as client:
        (instance,) = client.search_instances(seg_series)
        data = io.BytesIO()
        client.retrieve_instance(seg_series, instance, data, 1 << 30)
    seg = pydicom.dcmread(io.BytesIO(data.getvalue()))
    (algorithm,) = seg.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence
    assert algorithm.AlgorithmParameters == f"{LINEAGE_PARAMETER}={digest}"
    assert algorithm.AlgorithmName == "medload"


@needs_orthanc
def test_one_connection_searches_the_pacs_once(orthanc, tmp_path):
    """Two SEGs over one connection: one QIDO-RS series search (counted by a proxy), two retrievals."""
    store = tmp_path / "store"
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    key, bone = _bone(store)
    proxy = Proxy(orthanc.http_url)
    try:
        with connect(proxy.url()) as pacs:
            first, second = (to_seg(store, key, bone, pacs=pacs) for _ in range(2))
    finally:
        proxy.stop()
    searches = [p for p in proxy.paths if p.startswith("/dicom-web/series?")]
    retrievals = [p for p in proxy.paths if "/instances/" in p]
    assert len(searches) == 1 and len(retrievals) == 2 * len(CT)
    assert first.SOPInstanceUID != second.SOPInstanceUID and first.SeriesInstanceUID != second.SeriesInstanceUID


def _copy_ct(tmp_path: Path, change) -> Path:
    """The CT series copied with ``change(dataset)`` applied; where it returns False the file is left out."""
    out = tmp_path / "changed"
    out.mkdir()
    for i, path in enumerate(p for p in sorted(DICOM.rglob("*")) if p.is_file()):
        ds = pydicom.dcmread(path)
        if int(ds.SeriesNumber) == 201 and change(ds) is not False:
            ds.save_as(out / f"{i:03d}.dcm")
    return out


TOP = max(float(h.ImagePositionPatient[2]) for h in CT)


def _without_top_slice(ds: pydicom.Dataset) -> bool:
    return float(ds.ImagePositionPatient[2]) != TOP


def _half_a_millimetre_higher(ds: pydicom.Dataset) -> None:
    x, y, z = (float(v) for v in ds.ImagePositionPatient)
    ds.ImagePositionPatient = [x, y, z + 0.5]


@needs_orthanc
@pytest.mark.parametrize(("change", "reason"), [
    (_without_top_slice, r"other instances in series .* \(28 plane\(s\) now, 27 slice\(s\) stored\)"),
    (_half_a_millimetre_higher, r"does not match the stored grid \(slice positions up to 0.500 mm"),
])
def test_refuses_when_the_pacs_copy_is_not_the_stored_volume(orthanc, tmp_path, change, reason):
    """The store was ingested from a copy of the CT that differs from Orthanc's (the top slice missing; every
    slice 0.5 mm higher, with the same UIDs): a SEG made on the stored grid would not fit Orthanc's series."""
    store = tmp_path / "store"
    ingest(_copy_ct(tmp_path, change), store, config=ONE_WORKER)
    (rec,) = open_store(store).series()
    with pytest.raises(WritebackError, match=reason) as info:
        to_seg(store, rec.key, np.zeros(rec.shape, np.uint8), pacs=orthanc.dicomweb_url)
    assert not [s for s in IDENTIFIERS if s in str(info.value)]
    assert _segs_in_study(orthanc) == []


@needs_orthanc
def test_a_series_the_pacs_does_not_hold_is_refused(orthanc, tmp_path):
    from medload.synthetic import SeriesSpec, make_series

    make_series(tmp_path / "other", SeriesSpec(n_slices=4, rows=16, cols=16), seed=3)
    store = tmp_path / "store"
    ingest(tmp_path / "other", store, config=ONE_WORKER)
    (rec,) = open_store(store).series()
    with pytest.raises(WritebackError, match=r"has no series whose SeriesInstanceUID has the pseudonym .* \(\d+ "
                                             r"series searched, query Modality=CT&StudyDate=20150101-20151231\)"):
        to_seg(store, rec.key, np.zeros(rec.shape, np.uint8), pacs=orthanc.dicomweb_url,
               query="StudyDate=20150101-20151231")


# ---- without a server: what is checked before the PACS is asked ------------------------------------
@pytest.fixture(scope="module")
def file_store(tmp_path_factory) -> tuple[Path, str, np.ndarray]:
    store = tmp_path_factory.mktemp("files") / "store"
    ingest(DICOM, store, config=ONE_WORKER)
    return (store, *_bone(store))


UNREACHABLE = "dicomweb://127.0.0.1:9/dicom-web"  # never contacted: every case fails before


@pytest.mark.parametrize(("mask", "labels", "message"), [
    (lambda b: b[:-1], None, r"mask shape \(27, 512, 512\) is not the shape \(28, 512, 512\)"),
    (lambda b: b * 0.5, None, "give class ids as integers"),
    (lambda b: b * 3, {1: "a", 3: "c"}, r"segment ids \[1, 3\]: name ids 1..N"),
    (lambda b: b * 2, {1: "a"}, r"class id\(s\) \[2\] that labels do not name"),
])
def test_masks_a_seg_cannot_carry_are_refused(file_store, mask, labels, message):
    store, key, bone = file_store
    with pytest.raises(ConfigError, match=message):
        to_seg(store, key, mask(bone), labels, pacs=UNREACHABLE)


def test_a_nifti_mask_off_the_stored_grid_is_refused(file_store, tmp_path):
    store, key, bone = file_store
    affine = np.asarray(open_store(store).record(key).affine)
    shifted = affine.copy()
    shifted[:3, 3] += affine[:3, 0]  # one column over
    path = tmp_path / "shifted.nii.gz"
    nib.save(nib.Nifti1Image(bone.transpose(2, 1, 0), shifted), path)
    with pytest.raises(ConfigError, match=r"shifted.nii.gz is not on the grid of series .*medload export"):
        to_seg(store, key, path, {1: "bone"}, pacs=UNREACHABLE)


def test_another_key_is_refused(file_store, tmp_path):
    store, key, bone = file_store
    other = write_key(tmp_path / "other.key", "ff" * 32)
    with pytest.raises(ConfigError, match="was built with pseudonymisation key"):
        to_seg(store, key, bone, pacs=UNREACHABLE, key_file=other)


# ---- the example pipeline ----------------------------------------------------------------------------
def _predict_script():
    spec = importlib.util.spec_from_file_location("predict_to_seg", REPO / "pipelines" / "predict_to_seg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_orthanc
def test_pipeline_sends_the_model_prediction_of_each_validation_series(orthanc, tmp_path):
    """predict_to_seg.py with a saved 2.5D UNet (train_segmentation.py's --quick architecture): the SEG it sends
    comes back onto exactly the voxels the model predicts."""
    from medload.models import segmentation_unet

    store = tmp_path / "store"
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    key, _ = _bone(store)
    torch.manual_seed(0)
    net = segmentation_unet(2, 3, small=True)
    torch.save(net.state_dict(), tmp_path / "model.pt")
    script = _predict_script()
    summary = script.main(["--store", str(store), "--model", str(tmp_path / "model.pt"), "--quick", "--to",
                           orthanc.dicomweb_url, "--label", "brain", "--out", str(tmp_path / "out")])
    assert [s["key"] for s in summary["sent"]] == [key] and summary["refused"] == {}
    assert len(_segs_in_study(orthanc)) == 1

    args = script.parse_args(["--store", str(store), "--model", "m", "--quick", "--to", "x"])
    expected = script.predict(net.eval(), script.SliceDataset(open_store(store), context=1, labels=False), key, args)
    assert 0 < expected.sum() == summary["sent"][0]["foreground_voxels"] < expected.size
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    assert open_store(store).labels(key).classes == {"1": "brain"}
    assert np.array_equal(open_store(store).read_label(key), expected)


@needs_orthanc
def test_pipeline_demo_target_needs_no_model(orthanc, tmp_path):
    store = tmp_path / "store"
    ingest_dicomweb(orthanc.dicomweb_url, store, config=ONE_WORKER)
    key, bone = _bone(store)
    summary = _predict_script().main(["--store", str(store), "--demo-target", "bone", "--to", orthanc.dimse_url,
                                      "--out", str(tmp_path / "out")])
    assert summary["sent"] == [{"key": key, "frames": len(CT), "foreground_voxels": int(bone.sum())}]
    assert json.loads((tmp_path / "out" / "predictions.json").read_text())["sent"] == summary["sent"]
    assert len(_segs_in_study(orthanc)) == 1

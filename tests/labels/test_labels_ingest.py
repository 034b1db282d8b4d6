"""Labels through ingest and the store: SEG, NRRD/NIfTI and RTSTRUCT land on the series' voxels."""

from __future__ import annotations

import json
import shutil

import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
import torch
from conftest import DATA, DEVICES

from medload.config import IngestConfig
from medload.data import ForegroundSampler, SlabDataset, SliceDataset, make_loader
from medload.ingest import ingest
from medload.storage.nifti import export_nifti
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

GE = DATA / "ge_ct_3slice_seg"
CFG = IngestConfig(workers=1)


def _ge_uid() -> str:
    return str(pydicom.dcmread(GE / "ct-3slice" / "01.dcm", stop_before_pixels=True).SeriesInstanceUID)


def test_seg_and_nrrd_land_on_the_same_voxels_of_the_ge_series(tmp_path):
    """Acceptance: the liver SEG (found beside its slices) and the NRRD (mapped to the series) agree."""
    src = tmp_path / "src"
    shutil.copytree(GE / "ct-3slice", src / "ct")
    shutil.copy(GE / "liver.dcm", src / "liver.dcm")
    report = ingest(src, tmp_path / "seg_store", config=CFG)
    assert [(o.status, o.kind) for o in report.labels] == [("ingested", "seg")]
    seg_store = open_store(tmp_path / "seg_store")
    (rec,) = seg_store.series()
    seg = seg_store.read_label(rec.key)

    mapping = tmp_path / "map.csv"
    mapping.write_text(f"series,label\n{_ge_uid()},{GE / 'liver_seg.nrrd'}\n")
    ingest(GE / "ct-3slice", tmp_path / "nrrd_store", config=CFG, labels=[mapping])
    nrrd = open_store(tmp_path / "nrrd_store").read_label(rec.key)

    assert seg.shape == nrrd.shape == rec.shape and seg.dtype == np.uint8
    a, b = seg > 0, nrrd > 0
    assert a.sum() > 100_000 and 2 * (a & b).sum() / (a.sum() + b.sum()) == 1.0
    label = seg_store.labels(rec.key)
    assert label.kind == "seg" and "Liver" in " ".join(label.classes.values())
    counts = np.asarray(label.foreground).reshape(3, -1).sum(axis=1)
    assert counts.tolist() == [int(x) for x in a.sum(axis=(1, 2))]  # per-slice foreground counts match


def test_export_label_overlays_the_image(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(GE / "ct-3slice", src / "ct")
    shutil.copy(GE / "liver.dcm", src / "liver.dcm")
    ingest(src, tmp_path / "s", config=CFG)
    store = open_store(tmp_path / "s")
    key = store.series()[0].key
    image = nib.load(export_nifti(store, key, tmp_path / "image.nii.gz"))
    label = nib.load(export_nifti(store, key, tmp_path / "label.nii.gz", label=True))
    assert label.shape == image.shape and np.allclose(label.affine, image.affine)
    assert np.array_equal(np.asarray(label.dataobj), store.read_label(key).transpose(2, 1, 0))


@pytest.fixture
def labelled(tmp_path):
    """A synthetic series with an RTSTRUCT beside it: a square on slices 2-4 and an island on slice 5."""
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(n_slices=8, rows=32, cols=40, orientation="oblique"), seed=12)
    square = np.array([[9.5, 7.5], [20.5, 7.5], [20.5, 15.5], [9.5, 15.5]])  # (column, row) index corners
    island = np.array([[30.5, 20.5], [34.5, 20.5], [34.5, 24.5], [30.5, 24.5]])
    make_rtstruct(gen, {"Liver": [(z, [square]) for z in (2, 3, 4)], "TUMOUR_1": [(5, [island])]},
                  src / "rtstruct.dcm")
    return src, gen


def test_rtstruct_beside_its_series_is_rasterised_with_the_roi_map(labelled, tmp_path):
    src, gen = labelled
    report = ingest(src, tmp_path / "s", config=CFG, roi_map={"liver": ["liver"], "tumour": ["Tumour_1"]})
    assert [(o.status, o.classes) for o in report.labels] == [("ingested", ("liver", "tumour"))]
    store = open_store(tmp_path / "s")
    (rec,) = store.series()
    label = store.read_label(rec.key)
    expected = np.zeros(gen.hu.shape, dtype=np.uint8)
    expected[2:5, 8:16, 10:21] = 1  # rows 8..15, columns 10..20
    expected[5, 21:25, 31:35] = 2
    assert np.array_equal(label, expected)
    assert store.labels(rec.key).classes == {"1": "liver", "2": "tumour"}
    assert np.array_equal(np.asarray(store.labels(rec.key).foreground),
                          np.stack([(expected == c).sum(axis=(1, 2)) for c in (1, 2)], axis=1))


def test_a_mask_with_a_shifted_origin_lands_where_its_coordinates_say(labelled, tmp_path):
    src, gen = labelled
    (src / "rtstruct.dcm").unlink()
    ingest(src, tmp_path / "s", config=CFG)
    store = open_store(tmp_path / "s")
    (rec,) = store.series()
    truth = np.zeros(gen.hu.shape, dtype=np.uint8)
    truth[3, 10:14, 12:20] = 1
    # the same physical mask on a grid whose origin is two columns and one row further on
    shifted = np.zeros_like(truth)
    shifted[3, 9:13, 10:18] = 1
    image = sitk.GetImageFromArray(shifted)
    affine_lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(gen.affine_ras)
    image.SetOrigin(tuple(affine_lps[:3] @ np.array([2.0, 1.0, 0.0, 1.0])))
    spacing = np.linalg.norm(affine_lps[:3, :3], axis=0)
    image.SetSpacing(tuple(spacing))
    image.SetDirection(tuple((affine_lps[:3, :3] / spacing).ravel()))
    masks = tmp_path / "masks"
    masks.mkdir()
    sitk.WriteImage(image, str(masks / f"{gen.series_uid}.nii.gz"))
    report = ingest(src, tmp_path / "s", config=CFG, labels=[masks])
    assert [o.status for o in report.labels] == ["ingested"] and report.counts["present"] == 1
    store.refresh()
    assert np.array_equal(store.read_label(rec.key), truth)
    assert store.labels(rec.key).resampled
    assert store.labels(rec.key).shard != rec.shard  # labels of a stored series go into a new shard


def test_labels_are_idempotent_and_a_different_label_is_a_conflict(labelled, tmp_path):
    src, gen = labelled
    assert [o.status for o in ingest(src, tmp_path / "s", config=CFG).labels] == ["ingested"]
    assert [o.status for o in ingest(src, tmp_path / "s", config=CFG).labels] == ["present"]
    other = tmp_path / "other"
    other.mkdir()
    make_rtstruct(gen, {"Liver": [(1, [np.array([[1.5, 1.5], [5.5, 1.5], [5.5, 5.5]])])]}, other / "rt.dcm")
    report = ingest(src, tmp_path / "s", config=CFG, labels=[other])
    assert sorted(o.status for o in report.labels) == ["conflict", "present"]


def test_a_label_for_no_known_series_is_quarantined(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(GE / "liver.dcm", src / "liver.dcm")
    report = ingest(src, tmp_path / "s", config=CFG)
    (outcome,) = report.labels
    assert outcome.status == "rejected" and "references no series" in outcome.reason
    (reject,) = open_store(tmp_path / "s").rejects()
    assert reject.stage == "labels" and reject.source.endswith("liver.dcm")


def test_datasets_read_labels_and_the_foreground_sampler_uses_them(labelled, tmp_path):
    src, gen = labelled
    ingest(src, tmp_path / "s", config=CFG)
    ds = SliceDataset(open_store(tmp_path / "s"), context=1, labels=True)
    assert ds.labels and ds.foreground.tolist() == [False, False, True, True, True, True, False, False]
    item = ds[3]
    assert item["label"].shape == (1, 32, 40) and int(item["label"].sum()) == 8 * 11
    sampler = ForegroundSampler(ds.foreground, p=1.0, num_samples=50, seed=0)
    loader = make_loader(ds, batch_size=5, sampler=sampler, window="soft_tissue")
    for batch in loader:
        assert (batch["label"].flatten(1).amax(dim=1) > 0).all()  # p=1: every sample has foreground
        assert batch["label"].dtype == torch.uint8


@pytest.mark.parametrize("device", DEVICES)
def test_labels_ride_with_their_images_whether_batches_are_cast_as_read_or_slotted(labelled, tmp_path, device):
    import multiprocessing as mp

    src, gen = labelled
    ingest(src, tmp_path / "s", config=CFG)
    store = open_store(tmp_path / "s")
    for ds in (SliceDataset(store, context=1, labels=True), SlabDataset(store, depth=3, stride=2, labels=True)):
        runs = [list(make_loader(ds, batch_size=2, num_workers=w, device=device, window="soft_tissue", shuffle=True, seed=1,
                                 multiprocessing_context=mp.get_context("fork") if w else None))
                for w in (0, 1)]  # on the CPU, 0: cast as read, labels through the slot; 1: all through it
        assert len(runs[0]) == len(runs[1]) > 1
        for a, b in zip(*runs):
            assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])
            assert torch.equal(a["label"], b["label"]) and a["label"].device.type == device
            for i, label in zip(a["index"].tolist(), a["label"].cpu()):
                assert torch.equal(label, ds[i]["label"].as_tensor())


def test_cli_ingest_labels_and_roi_map(labelled, tmp_path):
    import subprocess
    import sys

    src, _ = labelled
    roi_map = tmp_path / "roi.json"
    roi_map.write_text(json.dumps({"organ": ["LIVER"]}))
    out = subprocess.run([sys.executable, "-m", "medload.cli", "ingest", str(src), str(tmp_path / "s"), "--workers", "1",
                          "--roi-map", str(roi_map), "--no-progress"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "label ingested" in out.stdout and "organ" in out.stdout

"""``medload repair`` and labels, on a real labelled store: NIfTI masks given with ``--labels``, a DICOM SEG and an
RTSTRUCT among the sources. Labels that went with a damaged copy come back bit for bit -- in the repair that
ingests the series again, or in a later one given only the labels."""

from __future__ import annotations

import shutil
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from conftest import DATA, flip_stored_value

from medload.config import IngestConfig
from medload.ingest.repair import repair_store
from medload.ingest.run import ingest
from medload.storage.keys import slice_key
from medload.storage.manifest import read_manifest, shard_path
from medload.storage.store import open_store
from medload.storage.verify import verify_store
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

CFG = IngestConfig(workers=1)
SQUARE = [[2.5, 2.5], [8.5, 2.5], [8.5, 10.5], [2.5, 10.5]]  # (column, row) index corners


def medload(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Sources of four labelled series -- two with NIfTI masks in masks/, one with an RTSTRUCT beside its slices,
    the GE series with its SEG -- and a store of them (one shard). Returns (root, {key: (label record, label map)},
    the keys labelled by masks)."""
    root = tmp_path_factory.mktemp("repair_labels")
    (root / "masks").mkdir()
    for i in range(2):
        gen = make_series(root / "src" / f"m{i}", SeriesSpec(n_slices=5, rows=16, cols=12), seed=i, series_number=i + 1)
        label = np.zeros(gen.hu.shape, np.uint8)
        label[1:4, 3:9, 2:7] = i + 1
        label[2, 5, 5] = 7
        nib.save(nib.Nifti1Image(label.transpose(2, 1, 0), gen.affine_ras), root / "masks" / f"{gen.series_uid}.nii.gz")
    gen = make_series(root / "src" / "rt", SeriesSpec(n_slices=5, rows=16, cols=12), seed=9, series_number=9)
    make_rtstruct(gen, {"Liver": [(z, [np.array(SQUARE)]) for z in range(1, 4)]}, root / "src" / "rt" / "rt.dcm")
    shutil.copytree(DATA / "ge_ct_3slice_seg" / "ct-3slice", root / "src" / "ge")
    shutil.copy(DATA / "ge_ct_3slice_seg" / "liver.dcm", root / "src" / "ge" / "liver.dcm")
    report = ingest(root / "src", root / "store", config=CFG, labels=[root / "masks"])
    assert sorted(o.kind for o in report.labels if o.status == "ingested") == ["mask", "mask", "rtstruct", "seg"]
    st = open_store(root / "store")
    labels = {r.key: (st.labels(r.key), st.read_label(r.key)) for r in st.series()}
    masked = sorted(k for k, (rec, _) in labels.items() if rec.kind == "mask")
    assert len(labels) == 4 and len(masked) == 2 and len(read_manifest(root / "store").shards) == 1
    return root, labels, masked


@pytest.fixture
def store(built, tmp_path):
    shutil.copytree(built[0] / "store", tmp_path / "store")
    return tmp_path / "store"


def _every_label_back(store, labels) -> None:
    """Each series has its original label map, bit for bit, and the store verifies clean with no label lost."""
    st = open_store(store)
    for key, (record, data) in labels.items():
        back = st.read_label(key)
        assert back.dtype == data.dtype and np.array_equal(back, data), key
        assert st.labels(key).digest == record.digest and st.labels(key).kind == record.kind
    report = verify_store(store)
    assert report.ok and report.labels == len(labels) and report.labels_lost == [], report.damage


def test_labels_lost_with_a_deleted_shard_come_back_in_a_later_repair(built, store):
    root, labels, masked = built
    (shard_path(store, read_manifest(store).shards[0].name) / "data.mdb").unlink()

    first = medload("repair", store, "--sources", root / "src", "--workers", "1", "--no-progress")
    assert first.returncode == 1, first.stdout + first.stderr
    assert sorted(line.split()[2].rstrip(":") for line in first.stdout.splitlines()
                  if line.startswith("labels lost")) == masked  # SEG and RTSTRUCT came back with their sources
    assert "2 label map(s) stored again, 2 lost" in first.stdout
    report = verify_store(store)
    assert report.ok and report.labels_lost == masked and report.labels == 2
    assert sorted(n.where for n in report.notes if n.kind == "label") == masked

    second = medload("repair", store, "--labels", root / "masks", "--workers", "1", "--no-progress")  # no sources
    assert second.returncode == 0, second.stdout + second.stderr
    assert sorted(line.split()[1].rstrip(":") for line in second.stdout.splitlines()
                  if line.startswith("labels ")) == masked
    _every_label_back(store, labels)
    assert medload("repair", store, "--no-progress").stdout.strip().endswith("ok: no damage, nothing to repair")


def test_labels_given_to_the_repair_that_ingests_the_series_again_come_back_with_it(built, store):
    root, labels, _ = built
    (shard_path(store, read_manifest(store).shards[0].name) / "data.mdb").unlink()
    result = repair_store(store, [root / "src"], labels=[root / "masks"], config=CFG)
    assert result.ok and result.labels_dropped == [] and len(result.labels) == 4 and len(result.retired) == 1
    _every_label_back(store, labels)


def test_labels_of_a_series_with_a_flipped_byte_come_back_in_a_later_repair(built, store):
    """The damaged shard stays (resealed), holding the superseded labels: they are lost all the same."""
    root, labels, masked = built
    assert flip_stored_value(shard_path(store, read_manifest(store).shards[0].name), slice_key(bytes.fromhex(masked[0]), 2))
    first = repair_store(store, [root / "src"], config=CFG)
    assert not first.ok and first.after.ok and first.labels_dropped == [masked[0]] and first.resealed
    again = repair_store(store, [root / "src"], config=CFG)  # still lost: not given
    assert not again.ok and again.labels_dropped == [masked[0]] and again.series == []
    last = repair_store(store, labels=[root / "masks"], config=CFG)
    assert last.ok and [o.key for o in last.labels] == [masked[0]]
    _every_label_back(store, labels)

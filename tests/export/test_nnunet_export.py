"""``export_nnunet`` and ``medload export-nnunet`` on a real store with labels: nnU-Net v2's own planner and
preprocessor accept the dataset, nibabel and nnU-Net's reader get the stored voxels and affines back, and the
folds of ``splits_final.json`` split by patient, the same for the same seed."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("nnunetv2", reason="nnU-Net v2 is an optional extra (medload[nnunet]); `make test` installs it")

from conftest import PHILIPS, flip_stored_value  # noqa: E402
from helpers.identifiers import IDENTIFYING, UIDS, _dicom_files, _pattern, _raw_values  # noqa: E402
from helpers.labelled_store import make_labelled_store, make_liver_bone_store  # noqa: E402

from medload.errors import ChecksumError, ConfigError  # noqa: E402
from medload.export import export_nnunet  # noqa: E402
from medload.export.classes import dataset_classes  # noqa: E402
from medload.export.folds import patient_folds  # noqa: E402
from medload.storage.keys import slice_key  # noqa: E402
from medload.storage.manifest import shard_path  # noqa: E402
from medload.storage.records import LabelRecord  # noqa: E402
from medload.storage.store import open_store  # noqa: E402

BIN = Path(sys.executable).parent
LABEL_MAP = {"liver": ["liver"], "bone": ["class_1"]}  # RTSTRUCT ROI "Liver"; the bone mask's class_1


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    """Six synthetic series of five patients with an RTSTRUCT "Liver" (the first patient has two), a sheared
    series with one too, an unlabelled series, and the sample study with a bone mask (> 300 HU) as NIfTI."""
    return make_liver_bone_store(tmp_path_factory.mktemp("nnunet"))


@pytest.fixture(scope="module")
def exported(store_path, tmp_path_factory):
    """The whole store exported with the label map, 5 folds, seed 0, into a fresh nnUNet_raw."""
    raw = tmp_path_factory.mktemp("nnUNet_raw")
    return export_nnunet(store_path, raw, dataset_id=501, name="LiverBone", label_map=LABEL_MAP, folds=5, seed=0)


def _cases(result) -> dict:
    return json.loads((result.path / "medload_cases.json").read_text())


def test_nnunet_verifies_plans_and_preprocesses_the_export(exported, tmp_path):
    env = {**os.environ, "nnUNet_raw": str(exported.path.parent), "nnUNet_preprocessed": str(tmp_path / "pre"),
           "nnUNet_results": str(tmp_path / "results")}
    proc = subprocess.run([str(BIN / "nnUNetv2_plan_and_preprocess"), "-d", "501", "--verify_dataset_integrity",
                           "-c", "3d_fullres", "-np", "1", "-npfp", "1"], capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "verify_dataset_integrity Done" in log
    assert "Error" not in log and "mismatch" not in log, log
    pre = tmp_path / "pre" / "Dataset501_LiverBone"
    cases = sorted(c.case for c in exported.cases)
    assert sorted(p.name.split(".")[0] for p in (pre / "nnUNetPlans_3d_fullres").glob("*.pkl")) == cases
    # the planner copies our folds to where training reads them
    assert json.loads((pre / "splits_final.json").read_text()) == json.loads(
        (exported.path / "splits_final.json").read_text())
    plans = json.loads((pre / "nnUNetPlans.json").read_text())
    assert plans["configurations"]["3d_fullres"]["normalization_schemes"] == ["CTNormalization"]


def test_dataset_json_and_left_out_series(exported, store_path):
    doc = json.loads((exported.path / "dataset.json").read_text())
    assert doc["channel_names"] == {"0": "CT"}
    assert doc["labels"] == {"background": 0, "liver": 1, "bone": 2}
    assert doc["numTraining"] == 7 and doc["file_ending"] == ".nii.gz"
    assert len(list((exported.path / "imagesTr").iterdir())) == len(list((exported.path / "labelsTr").iterdir())) == 7
    store = open_store(store_path)
    reasons = dict(exported.left_out)
    (tilted,) = [r for r in store.series() if any(f.startswith("sheared") for f in r.flags)]
    assert "sheared" in reasons.pop(tilted.key)
    (unlabelled,) = [r for r in store.series() if store.labels(r.key) is None]
    assert reasons.pop(unlabelled.key) == "no label map stored"
    assert not reasons
    assert {c.series for c in exported.cases} == {r.key for r in store.series()} - {tilted.key, unlabelled.key}
    assert exported.notes == ()


def test_no_raw_identifier_or_uid_in_the_dataset(exported, store_path):
    sources = [*_dicom_files(PHILIPS / "dicom"), *_dicom_files(store_path.parent / "src"),
               *_dicom_files(store_path.parent / "more")]
    raw = _raw_values(sources, IDENTIFYING + UIDS)
    assert "LIT-0" in raw["PatientID"] and len(raw["SeriesInstanceUID"]) >= 9  # images, RTSTRUCTs, the SC
    secrets = {v for values in raw.values() for v in values}
    files = {p: p.read_bytes() for p in exported.path.rglob("*") if p.is_file()}
    files = {p: gzip.decompress(data) if p.name.endswith(".gz") else data for p, data in files.items()}
    leaks = [f"{p.name}: {s}" for p, data in files.items() for s in secrets if _pattern(s).search(data)]
    assert not leaks


def test_nibabel_and_nnunet_read_back_the_stored_voxels_and_affines(exported, store_path):
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    store = open_store(store_path)
    for case in exported.cases:
        rec, stored_label = store.record(case.series), store.read_label(case.series)
        image = nib.load(exported.path / "imagesTr" / f"{case.case}_0000.nii.gz")
        label = nib.load(exported.path / "labelsTr" / f"{case.case}.nii.gz")
        hu = np.asanyarray(image.dataobj).transpose(2, 1, 0)
        assert hu.dtype == np.int16 and np.array_equal(hu, store.read(rec.key))
        for img in (image, label):
            assert int(img.header["sform_code"]) == int(img.header["qform_code"]) == 1
            # exactly the series affine, as NIfTI keeps it (float32 rows)
            assert np.array_equal(img.affine, np.asarray(rec.affine, np.float32).astype(np.float64))
        want = np.where(stored_label == 1, 2 if rec.manufacturer == "Philips" else 1, 0)
        assert np.array_equal(np.asanyarray(label.dataobj).transpose(2, 1, 0), want)
        images, props = SimpleITKIO().read_images([str(exported.path / "imagesTr" / f"{case.case}_0000.nii.gz")])
        assert np.array_equal(images[0], store.read(rec.key))
        assert np.allclose(props["spacing"], rec.spacing[::-1])
        assert np.allclose(props["sitk_stuff"]["origin"], np.asarray(rec.affine)[:3, 3] * [-1, -1, 1], atol=1e-4)


def test_folds_split_by_patient_and_come_back_from_the_seed(exported, store_path, tmp_path):
    splits = json.loads((exported.path / "splits_final.json").read_text())
    cases = {c.case: c for c in exported.cases}
    assert len(splits) == 5
    for fold, split in enumerate(splits):
        assert split["val"] and sorted(split["train"] + split["val"]) == sorted(cases)
        assert {cases[c].fold for c in split["val"]} == {fold}
    folds_of_patient = {}
    for c in exported.cases:
        folds_of_patient.setdefault(c.patient, set()).add(c.fold)
    assert len(folds_of_patient) == 6 and all(len(f) == 1 for f in folds_of_patient.values())
    assert max(Counter(c.patient for c in exported.cases).values()) == 2  # a patient's two series: one fold
    again = export_nnunet(store_path, tmp_path, dataset_id=501, name="LiverBone", label_map=LABEL_MAP, seed=0)
    for path in sorted(p for p in exported.path.rglob("*") if p.is_file()):
        assert (again.path / path.relative_to(exported.path)).read_bytes() == path.read_bytes(), path
    other = export_nnunet(store_path, tmp_path, dataset_id=502, name="LiverBone", label_map=LABEL_MAP, seed=1)
    assert json.loads((other.path / "splits_final.json").read_text()) != splits
    assert _cases(other)["seed"] == 1 and [c["series"] for c in _cases(other)["cases"]] == [
        c["series"] for c in _cases(exported)["cases"]]


def test_without_a_map_the_stored_classes_are_kept_where_series_agree(store_path, tmp_path):
    result = export_nnunet(store_path, tmp_path, dataset_id=3, name="Liver", query="manufacturer != 'Philips'",
                           folds=2)
    assert result.labels == {"background": 0, "Liver": 1}
    store = open_store(store_path)
    for case in result.cases:
        label = nib.load(result.path / "labelsTr" / f"{case.case}.nii.gz")
        assert np.array_equal(np.asanyarray(label.dataobj).transpose(2, 1, 0), store.read_label(case.series))
    with pytest.raises(ConfigError, match=r"class 1 is 'Liver' in some series and 'class_1'.*--label-map") as err:
        export_nnunet(store_path, tmp_path, dataset_id=4, name="All")
    assert '{"class_1": ["class_1"], "liver": ["Liver"]}' in str(err.value)  # a map the user can start from
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Dataset003_Liver"]
    with pytest.raises(ConfigError, match="already holds nnU-Net dataset 3"):
        export_nnunet(store_path, tmp_path, dataset_id=3, name="Other")
    with pytest.raises(ConfigError, match="cannot fill 9 folds"):
        export_nnunet(store_path, tmp_path, dataset_id=5, name="Many", label_map=LABEL_MAP, folds=9)


def test_a_failed_export_leaves_no_folder(tmp_path):
    path = make_labelled_store(tmp_path, patients=2)
    store = open_store(path)
    last = store.series()[-1]
    assert flip_stored_value(shard_path(path, last.shard), slice_key(last.key_bytes, 3)) >= 1
    raw = tmp_path / "raw"
    # No L1: this process's L1 is keyed by shard digest, and another test here may have read a byte-identical
    # shard, whose verified slices would then be served instead of the damaged bytes on disk.
    with pytest.raises(ChecksumError):
        export_nnunet(open_store(path, cache=0), raw, dataset_id=9, name="Broken", folds=2)
    assert list(raw.iterdir()) == []


def test_cli_writes_the_dataset_and_explains_refusals(store_path, tmp_path):
    def medload(*args):
        return subprocess.run([sys.executable, "-m", "medload.cli", "export-nnunet", str(store_path), str(tmp_path),
                               *args], capture_output=True, text=True)

    (tmp_path / "map.json").write_text(json.dumps(LABEL_MAP))
    proc = medload("--dataset-id", "77", "--name", "Cli", "--label-map", str(tmp_path / "map.json"), "--folds", "3",
                   "--seed", "4", "--query", "slices >= 6")
    assert proc.returncode == 0, proc.stderr
    assert "7 case(s) of 6 patient(s); labels background=0, liver=1, bone=2" in proc.stdout
    assert proc.stdout.count("left out  series") == 2
    assert len(json.loads((tmp_path / "Dataset077_Cli" / "splits_final.json").read_text())) == 3
    proc = medload("--dataset-id", "78", "--name", "Cli", "--query", "colour == 'red'")
    assert proc.returncode == 2 and "does not run on the catalog" in proc.stderr and "kernel" in proc.stderr
    (tmp_path / "bad.json").write_text("{liver: 1}")
    proc = medload("--dataset-id", "78", "--name", "Cli", "--label-map", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "must hold JSON" in proc.stderr
    proc = medload("--dataset-id", "1000", "--name", "Cli")
    assert proc.returncode == 2 and "1<=x<=999" in proc.stderr


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=3, max_size=40), st.integers(2, 5), st.integers(0, 2**32), st.randoms())
def test_patient_folds_never_split_a_patient_and_balance_cases(owners, folds, seed, rnd):
    patients = [f"p{o}" for o in owners]
    if len(set(patients)) < folds:
        with pytest.raises(ConfigError, match="cannot fill"):
            patient_folds(patients, folds, seed)
        return
    fold_of = patient_folds(patients, folds, seed)
    by_patient = {}
    for p, f in zip(patients, fold_of):
        by_patient.setdefault(p, set()).add(f)
    assert all(len(f) == 1 for f in by_patient.values())
    load = [fold_of.count(f) for f in range(folds)]
    assert min(load) >= 1 and max(load) - min(load) <= max(patients.count(p) for p in by_patient)
    shuffled = list(patients)
    rnd.shuffle(shuffled)  # the input order does not change any patient's fold
    assert dict(zip(shuffled, patient_folds(shuffled, folds, seed))) == dict(zip(patients, fold_of))


def _label_record(classes: dict[str, str], dtype: str = "uint8") -> LabelRecord:
    return LabelRecord("ab" * 16, dtype, classes, (), "mask", "m.nii.gz", "f", "d")


def test_class_rules_refuse_what_nnunet_cannot_take():
    with pytest.raises(ConfigError, match="not consecutive"):
        dataset_classes([_label_record({"1": "a", "3": "b"})])
    with pytest.raises(ConfigError, match="nnU-Net's name for label 0"):
        dataset_classes([_label_record({"1": "Background"})])
    with pytest.raises(ConfigError, match="list of stored class names"):
        dataset_classes([_label_record({"1": "a"})], {"a": "a"})
    with pytest.raises(ConfigError, match="under two classes"):
        dataset_classes([_label_record({"1": "a"})], {"x": ["a"], "y": ["A"]})
    with pytest.raises(ConfigError, match="other than 'background'"):
        dataset_classes([_label_record({"1": "a"})], {"background": ["a"]})
    labels, (lut,), notes = dataset_classes([_label_record({"1": "a", "2": "b"}, "uint16")], {"b": ["B"], "c": ["c"]})
    assert labels == {"background": 0, "b": 1, "c": 2}
    assert lut.size == 65536 and lut[:3].tolist() == [0, 0, 1]
    assert notes == [f"series {'ab' * 6}: class 1 'a' is not in the label map: exported as background",
                     "label 'c' (2): no exported series has any of its classes"]

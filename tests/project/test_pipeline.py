"""pipelines/train_segmentation.py --quick, for real, on the shipped sample study."""

from __future__ import annotations

import importlib.util
import logging
import math

import pytest
import torch
from conftest import PHILIPS, REPO
from helpers.labelled_store import make_partly_labelled_store

from medload.config import IngestConfig
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipeline") / "store"
    ingest(PHILIPS / "dicom", path, config=IngestConfig(workers=1))
    return path


def _pipeline():
    spec = importlib.util.spec_from_file_location("train_segmentation", REPO / "pipelines" / "train_segmentation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_2p5d_training_loss_falls_and_saves_a_model(sample_store, tmp_path):
    summary = _pipeline().main(["--store", str(sample_store), "--quick", "--demo-target", "bone",
                                "--out", str(tmp_path / "run")])
    losses = [h["train_loss"] for h in summary["history"]]
    assert summary["mode"] == "2.5d" and len(losses) == 4
    assert losses[-1] < losses[0]
    assert 0.0 < summary["best_val_dice"] <= 1.0
    assert (tmp_path / "run" / "best_model.pt").stat().st_size > 0
    assert (tmp_path / "run" / "summary.json").exists()


def test_quick_3d_training_runs_on_slabs(sample_store, tmp_path):
    summary = _pipeline().main(["--store", str(sample_store), "--quick", "--3d", "--depth", "8", "--demo-target",
                                "bone", "--out", str(tmp_path / "run3d")])
    assert summary["mode"] == "3d" and all(math.isfinite(h["train_loss"]) for h in summary["history"])


def test_the_recap_says_what_a_quick_runs_dice_means(sample_store, tmp_path):
    module = _pipeline()
    args = module.parse_args(["--store", str(sample_store), "--quick", "--demo-target", "bone"])
    text = module.recap(args, module.SliceDataset(module.open_store(sample_store), context=1), 0.29)
    assert "smoke test" in text and "0.29" in text and "28 samples" in text and "Next:" in text


def test_a_store_without_labels_needs_a_demo_target(sample_store, tmp_path):
    with pytest.raises(SystemExit, match="no labels"):
        _pipeline().main(["--store", str(sample_store), "--quick", "--out", str(tmp_path / "x")])


def test_quick_training_on_stored_labels(tmp_path):
    import numpy as np

    from medload.synthetic import SeriesSpec, make_rtstruct, make_series

    for s in range(2):  # two patients, so validation is a patient of its own
        gen = make_series(tmp_path / "src" / f"p{s}", SeriesSpec(n_slices=10, rows=48, cols=48), seed=30 + s,
                          patient_id=f"P{s}")
        square = np.array([[10.5, 10.5], [30.5, 10.5], [30.5, 30.5], [10.5, 30.5]])
        make_rtstruct(gen, {"Organ": [(z, [square]) for z in range(2, 8)]}, tmp_path / "src" / f"p{s}" / "rt.dcm")
    ingest(tmp_path / "src", tmp_path / "store", config=IngestConfig(workers=1))
    summary = _pipeline().main(["--store", str(tmp_path / "store"), "--quick", "--out", str(tmp_path / "run")])
    assert summary["train_samples"] + summary["val_samples"] == 20
    assert all(math.isfinite(h["train_loss"]) for h in summary["history"])


@pytest.fixture(scope="module")
def partly_labelled(tmp_path_factory):
    """9 patients, 6 labelled: 'Liver' on four, 'Spleen' (value 1) and 'Liver' (value 2) on two."""
    return make_partly_labelled_store(tmp_path_factory.mktemp("partly"))


def test_a_partly_labelled_store_trains_on_its_labelled_series_one_channel_per_class(partly_labelled, tmp_path,
                                                                                       caplog):
    with caplog.at_level(logging.INFO):
        summary = _pipeline().main(["--store", str(partly_labelled), "--quick", "--epochs", "2", "--labels", "only",
                                    "--classes", "liver,spleen", "--out", str(tmp_path / "run")])
    assert summary["series"] == 6 and summary["unlabelled_left_out"] == 3 and summary["classes"] == ["liver", "spleen"]
    assert summary["train_samples"] + summary["val_samples"] == 6 * 6
    assert all(math.isfinite(h["train_loss"]) for h in summary["history"]) and 0.0 < summary["best_val_dice"] <= 1.0
    assert "3 of 9 selected series" in caplog.text and "channel 1 = spleen" in caplog.text
    weights = torch.load(tmp_path / "run" / "best_model.pt", weights_only=True)
    assert list(weights.values())[-1].shape[0] == 2  # two output channels


def test_several_stored_classes_are_not_merged_into_one_foreground_without_being_asked(partly_labelled, tmp_path):
    run = ["--store", str(partly_labelled), "--quick", "--epochs", "1", "--max-steps", "1", "--out", str(tmp_path)]
    with pytest.warns(UserWarning, match="mean different classes"), pytest.raises(
            ConfigError, match=r"hold 2 classes \(Liver, Spleen\): training one foreground would merge them.*"
                               r"--classes 'foreground=Liver\+Spleen'"):
        _pipeline().main(run)
    summary = _pipeline().main([*run, "--classes", "organs=Liver+Spleen"])  # a merge, asked for
    assert summary["classes"] == ["organs"]


def test_the_pipeline_takes_the_datasets_series_filters(partly_labelled, tmp_path):
    store = open_store(partly_labelled)
    liver_only = [r.key for r in store.series() if (lab := store.labels(r.key)) and lab.classes == {"1": "Liver"}]
    run = ["--store", str(partly_labelled), "--quick", "--epochs", "1", "--max-steps", "1", "--out", str(tmp_path)]
    summary = _pipeline().main([*run, "--keys", *(k[:10] for k in liver_only), "--modality", "ct"])
    assert summary["series"] == 4 and summary["unlabelled_left_out"] == 0 and summary["classes"] is None
    summary = _pipeline().main([*run, "--query", "labelled and orientation == 'axial'", "--classes", "liver"])
    assert summary["series"] == 6 and summary["unlabelled_left_out"] == 0
    with pytest.raises(ConfigError, match=r"modality='MR' matched 0 of 9 \(stored modalities: CT\)"):
        _pipeline().main([*run, "--modality", "MR"])
    with pytest.raises(ConfigError, match="3 of 9 series have no labels"):
        _pipeline().main([*run, "--labels", "all", "--classes", "liver"])

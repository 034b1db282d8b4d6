"""pipelines/train_segmentation.py --quick, for real, on the shipped sample study."""

from __future__ import annotations

import importlib.util
import math

import pytest
from conftest import PHILIPS, REPO

from medload.config import IngestConfig
from medload.ingest import ingest


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

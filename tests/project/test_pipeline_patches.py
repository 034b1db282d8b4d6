"""pipelines/train_segmentation.py --3d --patch, for real: a few CPU steps of 3D patch training on a small
labelled store of oblique, anisotropic, feet-first series (tests/helpers/patch_store.py), validated by
sliding-window inference on whole series."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from conftest import REPO
from helpers.patch_store import make_patch_store

from medload.errors import ConfigError
from medload.storage.store import open_store


def _pipeline():
    spec = importlib.util.spec_from_file_location("train_segmentation", REPO / "pipelines" / "train_segmentation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """4 patients of one series each, labelled with two classes ('class_1', 'class_2')."""
    return make_patch_store(tmp_path_factory.mktemp("patch-pipeline"))


PATCH = ["--3d", "--patch", "8", "16", "16", "--spacing", "2", "2", "2"]


def test_quick_3d_patch_training_trains_validates_on_whole_series_and_saves(store_path, tmp_path):
    out = tmp_path / "run"
    summary = _pipeline().main(["--store", str(store_path), "--quick", *PATCH, "--foreground", "0.5", "--epochs", "2",
                                "--classes", "class_1,class_2", "--out", str(out)])
    assert summary["mode"] == "3d-patch" and summary["patch"] == [8, 16, 16] and summary["spacing"] == [2.0, 2.0, 2.0]
    assert summary["axcodes"] == "RAS" and summary["foreground"] == 0.5 and summary["patches_per_epoch"] == 8
    assert len(summary["history"]) == 2 and all(math.isfinite(h["train_loss"]) for h in summary["history"])
    assert all(0.0 <= h["val_dice"] <= 1.0 for h in summary["history"]) and summary["classes"] == ["class_1", "class_2"]
    patient = {r.key: r.patient for r in open_store(store_path).series()}
    train, val = {patient[k] for k in summary["train_series"]}, {patient[k] for k in summary["val_series"]}
    assert summary["val_held_out"] and val and train and train.isdisjoint(val) and len(train | val) == 4
    assert json.loads((out / "summary.json").read_text())["best_val_dice"] == summary["best_val_dice"]
    weights = torch.load(out / "best_model.pt", weights_only=True)
    assert weights["output_block.conv.conv.weight"].shape[0] == 2  # the DynUNet's head: one channel per class


def test_native_axcodes_and_a_demo_target_on_unlabelled_series(store_path, tmp_path):
    summary = _pipeline().main(["--store", str(store_path), "--quick", *PATCH, "--axcodes", "native", "--demo-target",
                                "bone", "--patches-per-epoch", "4", "--epochs", "1", "--max-steps", "1",
                                "--out", str(tmp_path / "run")])
    assert summary["axcodes"] is None and summary["classes"] is None and summary["patches_per_epoch"] == 4
    assert math.isfinite(summary["history"][0]["train_loss"]) and (tmp_path / "run" / "best_model.pt").exists()


def test_several_stored_classes_need_classes_in_patch_mode_too(store_path, tmp_path):
    with pytest.raises(ConfigError, match=r"hold 2 classes \(class_1, class_2\)"):
        _pipeline().main(["--store", str(store_path), "--quick", *PATCH, "--out", str(tmp_path)])


@pytest.mark.parametrize(("flags", "message"), [
    (["--3d", "--patch", "96", "96"], "argument --patch: expected 3 arguments"),
    (["--3d", "--patch", "96", "0", "96"], "--patch: sizes are voxels"),
    (["--3d", "--patch", "96", "96", "96", "--spacing", "1.5", "-1.5", "1.5"], "--spacing: mm between voxels, positive"),
    (["--3d", "--patch", "96", "96", "96", "--foreground", "1.5"], r"--foreground: a share of the patches, in \[0, 1\]"),
    (["--3d", "--patch", "96", "96", "96", "--patches-per-epoch", "0"], "--patches-per-epoch: at least 1"),
    (["--3d", "--patch", "96", "96", "96", "--axcodes", "RAP"], "--axcodes: three letters"),
    (["--3d", "--patch", "96", "96", "96", "--downsample", "2"], "--downsample pools slices and slabs"),
    (["--patch", "96", "96", "96"], "--patch trains 3D patches: add --3d"),
    (["--3d", "--spacing", "1.5", "1.5", "1.5", "--foreground", "0.3"], "--spacing, --foreground set 3D patches"),
])
def test_bad_patch_flags_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _pipeline().parse_args(["--store", "s", *flags])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_patch_defaults_follow_nnunet():
    args = _pipeline().parse_args(["--store", "s", "--3d", "--patch", "96", "96", "96"])
    assert args.batch_size == 2 and args.patches_per_epoch == 250 * 2 and args.foreground == 0.33
    assert args.axcodes == "RAS" and args.spacing is None

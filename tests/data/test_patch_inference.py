"""Sliding-window inference at a target grid, answered on the stored grid (medload.data.predict_series).

The oracle: each series' image *is* its label (HU = 1000 x class - 1000, two ellipsoids), so a model that
rounds HU back to classes returns, for any window, the label patch (one-hot) -- as nearest neighbour
would place it, up to where trilinear blending meets the rounding at an ellipsoid's edge. What comes
back on the stored grid is compared with the stored label.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.patch_store import label_from_image
from monai.transforms import LoadImage, SpatialResample

from medload.config import IngestConfig
from medload.data import predict_series, target_grid
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.nifti import export_nifti
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

SHAPE = (24, 56, 48)
#: name: (spec, seed)
SERIES = {
    "feet-first": (SeriesSpec(n_slices=SHAPE[0], rows=SHAPE[1], cols=SHAPE[2], pixel_spacing=(0.9, 0.7),
                              slice_spacing=2.5, orientation=(-1.0, 0.0, 0.0, 0.0, 1.0, 0.0)), 21),
    "oblique": (SeriesSpec(n_slices=SHAPE[0], rows=SHAPE[1], cols=SHAPE[2], pixel_spacing=(0.8, 0.75),
                           slice_spacing=2.5, orientation="oblique"), 22),
}


def _ellipsoids() -> np.ndarray:
    """Class 1, an ellipsoid of about 27 x 21 x 16 mm radii, holding class 2 (no voxel of 2 next to 0: a
    trilinear blend of 2 and 0 would read as 1)."""
    s, r, c = np.meshgrid(np.arange(SHAPE[0]) * 2.5, np.arange(SHAPE[1]) * 0.85, np.arange(SHAPE[2]) * 0.75,
                          indexing="ij")
    label = np.zeros(SHAPE, np.int16)
    label[((s - 30) / 27) ** 2 + ((r - 24) / 21) ** 2 + ((c - 18) / 16) ** 2 <= 1] = 1
    label[((s - 28) / 15) ** 2 + ((r - 26) / 12) ** 2 + ((c - 20) / 8) ** 2 <= 1] = 2
    return label


def _classes(hu: np.ndarray) -> np.ndarray:
    return np.rint((hu + 1000) / 1000).astype(np.uint8)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    for p, (name, (spec, seed)) in enumerate(SERIES.items()):
        make_series(root / "src" / name, spec, seed=seed, patient_id=f"PRED-{p}", hu=1000 * _ellipsoids() - 1000)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    label_from_image(root / "store", root / "masks", root / "src", rule=_classes)
    return open_store(root / "store")


def _key(store, name: str) -> str:
    orientation = SERIES[name][0].orientation
    (rec,) = [r for r in store.series() if (np.asarray(r.affine)[2, 2] < 0) == (orientation != "oblique")]
    return rec.key


def oracle(x: torch.Tensor) -> torch.Tensor:
    """The label patch, one-hot, read back from the image window."""
    classes = torch.clamp(torch.round((x[:, 0] + 1000) / 1000), 0, 2).long()
    return torch.nn.functional.one_hot(classes, 3).permute(0, 4, 1, 2, 3).float()


def _dice(a: np.ndarray, b: np.ndarray, c: int) -> float:
    return 2 * float(((a == c) & (b == c)).sum()) / float((a == c).sum() + (b == c).sum())


@pytest.mark.parametrize("name", list(SERIES))
def test_the_oracle_prediction_comes_back_on_the_stored_grid(store, name):
    """Feet-first or oblique, anisotropic, resampled to RAS at another anisotropic spacing (finer than the
    series): Dice >= 0.99 per class."""
    key = _key(store, name)
    truth = store.read_label(key)
    pred = predict_series(store, key, oracle, patch=(16, 32, 32), spacing=(1.7, 0.6, 0.55), overlap=0.5)
    assert pred.shape == store.record(key).shape and pred.dtype == np.uint8
    assert min(_dice(pred, truth, c) for c in (1, 2)) >= 0.99


def test_an_oblique_series_at_a_coarser_grid_loses_no_more_than_monai_nearest_both_ways(store, tmp_path):
    """An oblique series at isotropic 1.5 mm cannot come back whole (the grid is coarser and rotated):
    what comes back is as good as MONAI's own nearest-neighbour round trip of the label
    (``SpatialResample`` onto the same target grid and back), and Dice >= 0.95."""
    key = _key(store, "oblique")
    truth = store.read_label(key)
    pred = predict_series(store, key, oracle, patch=(16, 32, 32), spacing=(1.5, 1.5, 1.5), overlap=0.25)
    label = LoadImage(image_only=True, ensure_channel_first=True)(export_nifti(store, key, tmp_path / "l.nii.gz",
                                                                               label=True))
    affine, shape = target_grid(store, key, (1.5, 1.5, 1.5))
    nearest = SpatialResample(mode="nearest", padding_mode="zeros")
    there = nearest(label, dst_affine=torch.as_tensor(affine[:, [2, 1, 0, 3]]), spatial_size=shape[::-1])
    back = nearest(there, dst_affine=label.affine, spatial_size=label.shape[1:]).numpy()[0].transpose(2, 1, 0)
    for c in (1, 2):
        assert _dice(pred, truth, c) >= max(0.95, _dice(back, truth, c) - 0.005)


def test_the_target_grid_holds_the_whole_series(store):
    for rec in store.series():
        affine, shape = target_grid(store, rec.key, (1.5, 1.1, 0.9), "LPS")
        corners = np.array(np.meshgrid(*[[0, n - 1] for n in rec.shape], indexing="ij")).reshape(3, -1).T
        ras = np.asarray(rec.affine) @ np.c_[corners[:, ::-1], np.ones(len(corners))].T  # (column, row, slice)
        index = np.linalg.solve(affine, ras)[:3]
        assert (index > -1e-6).all() and (index < np.array(shape)[:, None] - 1 + 1e-6).all()
        assert np.allclose(np.abs(affine[:3, :3]).sum(axis=0), [1.5, 1.1, 0.9])


def test_one_channel_models_are_thresholded_and_preprocess_runs_first(store):
    key = _key(store, "feet-first")
    truth = store.read_label(key)
    seen = []

    def preprocess(x):
        seen.append(x.shape)
        return (x + 1000) / 1000  # classes 0, 1, 2

    pred = predict_series(store, key, lambda x: x - 0.5, patch=(16, 32, 32), spacing=(2.5, 0.9, 0.7),
                          preprocess=preprocess)
    assert len(seen) == 1 and seen[0][:2] == (1, 1)
    assert _dice(pred, (truth > 0).astype(np.uint8), 1) >= 0.99


def test_make_series_writes_the_hu_it_is_given(store, tmp_path):
    """The oracle's premise: the stored image is the ``hu=`` written (``make_series`` without it writes
    its phantom), and a wrong shape is refused."""
    for rec in store.series():
        assert np.array_equal(store.read(rec.key), 1000 * _ellipsoids() - 1000)
    with pytest.raises(ConfigError, match=r"hu has shape \(2, 3, 4\)"):
        make_series(tmp_path, SERIES["oblique"][0], hu=np.zeros((2, 3, 4), np.int16))

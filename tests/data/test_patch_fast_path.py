"""make_loader over a PatchDataset: crops read by the workers, resampled a batch at a time on the device.

Reference: ``ds[i]`` (itself equal to MONAI's ``SpatialResample``, tests/data/test_patches.py) on the same
store of oblique, anisotropic, feet-first, sagittal and tilted labelled series, same seed. Tolerances: the
image within 0.01 HU (both interpolate in float32; the fast path computes its grid in float64 and rounds
it once, ``ds[i]`` computes it in float32), the label exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.patch_store import make_patch_store

from medload.data import AugmentConfig, BatchAugment, PatchAugment, PatchDataset, make_loader
from medload.data.patch_device import gather_nearest
from medload.data.patch_geometry import source_box, voxel_to_voxel
from medload.data.patch_loader import _PatchBatch, _PatchCrops
from medload.data.resample import sample_linear, sample_nearest, source_points
from medload.errors import ConfigError
from medload.storage.observe import ReadObserver
from medload.storage.store import open_store

PATCH = (10, 18, 22)
GRIDS = [("RAS", (2.1, 1.13, 0.97)), ("LPS", (1.7, 0.77, 1.31)), (None, None)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(make_patch_store(tmp_path_factory.mktemp("patches")))


def _batches(ds, **kwargs) -> list[dict]:
    return list(make_loader(ds, batch_size=kwargs.pop("batch_size", 4), **kwargs))


@pytest.mark.parametrize(("orientation", "spacing"), GRIDS)
def test_the_fast_path_equals_ds_i_for_every_sample(store, orientation, spacing):
    ds = PatchDataset(store, PATCH, spacing, orientation, samples_per_epoch=24, seed=3)
    seen = []
    for batch in _batches(ds):
        assert batch["image"].shape[1:] == (1, *PATCH) and batch["image"].dtype == torch.float32
        assert batch["label"].shape == batch["image"].shape and batch["label"].dtype == torch.uint8
        for k, i in enumerate(batch["index"].tolist()):
            sample = ds[i]
            np.testing.assert_allclose(batch["image"][k].numpy(), sample["image"].numpy(), atol=0.01, rtol=0)
            assert torch.equal(batch["label"][k], sample["label"].as_tensor()), f"sample {i}: label differs"
            np.testing.assert_array_equal(batch["affine"][k].numpy(), sample["image"].affine.numpy())
            assert batch["key"][k] == sample["key"] and bool(batch["foreground"][k]) == sample["foreground"]
            np.testing.assert_array_equal(batch["centre"][k].numpy(), sample["centre"].numpy())
            seen.append(i)
    assert seen == list(range(24))


def test_zero_and_two_workers_give_the_same_batches_augmented_and_per_epoch(store):
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=12, seed=5)
    aug = PatchAugment(rotate_deg=25, zoom=(0.8, 1.25), translate_mm=6, p=0.8, mirror=0.5)
    loaders = [make_loader(ds, batch_size=3, num_workers=w, augment=aug) for w in (0, 2)]
    for epoch in (0, 1):
        for loader in loaders:
            loader.set_epoch(epoch)
        one, two = ([b for b in loader] for loader in loaders)
        assert len(one) == len(two) == 4
        for a, b in zip(one, two):
            assert all(torch.equal(a[name], b[name]) for name in ("image", "label", "affine", "index"))
        if epoch == 0:
            first = one[0]["affine"]
        else:
            assert not torch.equal(one[0]["affine"], first)  # persistent workers drew the new epoch


def test_identity_augmentation_changes_nothing(store):
    ds = PatchDataset(store, PATCH, (1.7, 0.77, 1.31), "LPS", samples_per_epoch=8, seed=2)
    plain = _batches(ds)
    for aug in (PatchAugment(), PatchAugment(rotate_deg=0, zoom=(1.0, 1.0), translate_mm=0, p=1.0, mirror=0.0)):
        for a, b in zip(plain, _batches(ds, augment=aug)):
            assert all(torch.equal(a[name], b[name]) for name in ("image", "label", "affine"))


def test_augmented_patches_are_the_volume_sampled_on_their_reported_affine(store):
    """Rotation, zoom, shift and mirrors in one matrix: each patch is its series resampled (CPU, whole
    volume) onto the affine the batch reports."""
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=12, seed=8)
    aug = PatchAugment(rotate_deg=(40, 20, 20), zoom=(0.7, 1.4), translate_mm=(4, 8, 8), mirror=0.5)
    for batch in _batches(ds, augment=aug):
        for k, key in enumerate(batch["key"]):
            rec = store.record(key)
            v2v = voxel_to_voxel(batch["affine"][k].numpy(), rec.affine)
            np.testing.assert_allclose(batch["image"][k, 0].numpy(), sample_linear(store.read(key), v2v, PATCH).numpy(),
                                       atol=0.01, rtol=0)
            assert np.array_equal(batch["label"][k, 0].numpy(), sample_nearest(store.read_label(key), v2v, PATCH))


def test_a_90_degree_turn_about_z_in_mm_turns_the_patch_on_its_own_grid(store):
    """Rotating the grid 90 degrees about S, on a patch with equal in-plane spacing and an odd in-plane size
    (its centre voxel the middle one), gives the unrotated patch turned a quarter: (h, w) <- (w, W-1-h).
    The series' pixels are not square (0.7 x 0.8, 0.9 x 0.6 mm ...): a turn in voxel units would not."""
    patch = (6, 15, 15)
    ds = PatchDataset(store, patch, (2.0, 0.9, 0.9), "RAS", samples_per_epoch=8, seed=4)
    turn = PatchAugment(rotate_deg=((90, 90), (0, 0), (0, 0)))
    for a, b in zip(_batches(ds), _batches(ds, augment=turn)):
        np.testing.assert_allclose(b["image"].numpy(), torch.rot90(a["image"], 1, dims=(-2, -1)).numpy(), atol=0.01)
        assert torch.equal(b["label"], torch.rot90(a["label"], 1, dims=(-2, -1)))
        np.testing.assert_allclose(b["affine"][:, :3, :3].numpy(),
                                   np.broadcast_to([[0, -0.9, 0], [0, 0, 0.9], [2.0, 0, 0]], (len(b["key"]), 3, 3)),
                                   atol=1e-12)


def test_a_patch_shifted_wholly_outside_its_series_is_air_and_background(store):
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=3, seed=2)
    away = PatchAugment(translate_mm=((0, 0), (0, 0), (900, 900)))  # 900 mm to the right of every series
    (batch,) = _batches(ds, augment=away)
    assert torch.equal(batch["image"], torch.full_like(batch["image"], -1024.0))
    assert not batch["label"].any()
    np.testing.assert_allclose(batch["affine"][:, 0, 3] - _batches(ds)[0]["affine"][:, 0, 3], 900.0)


class _Reads(ReadObserver):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def read(self, slices: int, seconds: float) -> None:
        self.calls.append(slices)


def test_a_patch_reads_one_range_of_image_and_label_slices_no_wider_than_it_reaches(store):
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=8, seed=6)
    reads = store.observe(_Reads())
    try:
        batches = _batches(ds, batch_size=1, augment=PatchAugment(rotate_deg=30))
    finally:
        store.unobserve(reads)
    ranges = []
    for batch in batches:
        rec = store.record(batch["key"][0])
        box = source_box(voxel_to_voxel(batch["affine"][0].numpy(), rec.affine), PATCH, rec.shape)
        ranges += [int(box[1][0] - box[0][0])] * 2  # image, label
    foreground = sum(bool(b["foreground"][0]) for b in batches)  # a foreground centre reads its label slice
    assert sorted(reads.calls) == sorted(ranges + [1] * foreground)
    assert max(ranges) <= int(np.ceil(np.sqrt(3) * max(np.multiply(PATCH, (2.1, 1.13, 0.97))) / 1.9)) + 2


def test_window_half_precision_meta_and_a_batch_augmentation_after(store):
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=4, seed=1)
    (plain,) = _batches(ds)
    (batch,) = _batches(ds, window="soft_tissue", dtype=torch.bfloat16, meta=True,
                        augment=BatchAugment(AugmentConfig(flip_prob=0.0, affine_prob=0.0, intensity_prob=0.0, noise_prob=0.0)))
    assert batch["image"].dtype == torch.bfloat16 and 0 <= float(batch["image"].min()) <= float(batch["image"].max()) <= 1
    assert torch.equal(batch["image"].affine, batch["affine"]) and torch.equal(batch["label"].affine, batch["affine"])
    assert batch["image"].meta["medload_key"] == batch["key"]
    assert torch.equal(batch["label"].as_tensor(), plain["label"])


def test_settings_the_patch_loader_refuses(store):
    ds = PatchDataset(store, PATCH, samples_per_epoch=4)
    with pytest.raises(ConfigError, match="float"):
        make_loader(ds, batch_size=2, dtype=torch.int16)
    with pytest.raises(ConfigError, match="auto"):
        make_loader(ds, batch_size=2, num_workers="auto")
    with pytest.raises(ConfigError, match="zoom"):
        PatchAugment(zoom=(1.2, 0.8))
    with pytest.raises(ConfigError, match="rotate_deg"):
        PatchAugment(rotate_deg=(10, 20))


@pytest.mark.parametrize(("orientation", "spacing"), GRIDS)
def test_the_torch_gather_of_labels_a_gpu_runs_equals_the_numpy_one(store, orientation, spacing):
    """On a CPU device labels go through ``sample_nearest`` (numpy); on a GPU through ``gather_nearest``
    (torch), here run on the CPU: equal bit for bit, on grids where points lie exactly halfway between
    two slices (2.1 mm over 3 mm slices)."""
    ds = PatchDataset(store, PATCH, spacing, orientation, samples_per_epoch=24, seed=3)
    ties = 0
    crops = _PatchCrops(ds, None, resample=False)  # what a GPU's workers send: the crops, before resampling
    for raw in (crops.__getitems__(_PatchBatch(list(range(b, b + 4)), 0)) for b in range(0, len(ds), 4)):
        torch_labels = gather_nearest(raw["label"], raw["v2v"], PATCH)
        for k in range(len(raw["index"])):
            expected = sample_nearest(raw["label"][k].numpy(), raw["v2v"][k].numpy(), PATCH)
            assert np.array_equal(torch_labels[k].numpy(), expected)
            points = source_points(raw["v2v"][k].numpy(), PATCH)
            ties += int((points - np.floor(points) == 0.5).any(axis=-1).sum())
    assert ties > 0 or orientation != "RAS"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the resampling on the GPU")
def test_on_cuda_the_batches_equal_the_cpu_ones(store):
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=8, seed=9)
    aug = PatchAugment(rotate_deg=30, zoom=(0.8, 1.2), translate_mm=5, mirror=0.5)
    for a, b in zip(_batches(ds, augment=aug), _batches(ds, augment=aug, device="cuda", num_workers=2)):
        assert b["image"].is_cuda and b["label"].is_cuda
        np.testing.assert_allclose(b["image"].cpu().numpy(), a["image"].numpy(), atol=0.01, rtol=0)
        assert torch.equal(b["label"].cpu(), a["label"]) and torch.equal(b["affine"], a["affine"])


def test_a_gpus_crops_sent_through_pipes_resample_to_the_same_batch(store):
    """Where /dev/shm cannot hold the batches in flight the workers send arrays, not tensors (pickled through
    their pipes): the trainer's resampling of a GPU's crops, run here on the CPU, gives the same batch."""
    from medload.data.patch_loader import PatchLoader

    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=8, seed=9)
    aug = PatchAugment(rotate_deg=30, zoom=(0.8, 1.2), translate_mm=5, mirror=0.5)
    as_tensors, as_arrays = _PatchCrops(ds, aug, resample=False), _PatchCrops(ds, aug, resample=False, via_pipe=True)
    trainer = PatchLoader(torch.utils.data.DataLoader(as_tensors), ds, torch.device("cpu"), None, torch.float32,
                          None, False)
    batch = _PatchBatch(list(range(4)), 0)
    raw = as_arrays.__getitems__(batch)
    assert isinstance(raw["image"], np.ndarray) and not any(isinstance(v, torch.Tensor) for v in raw.values())
    a, b = trainer.resample(as_tensors.__getitems__(batch)), trainer.resample(raw)
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    assert torch.equal(a["affine"], b["affine"]) and a["key"] == b["key"]


@pytest.mark.parametrize(("orientation", "spacing"), GRIDS)
@pytest.mark.parametrize("augment", [None, PatchAugment(rotate_deg=45, zoom=(0.7, 1.3), translate_mm=5, mirror=0.5)])
def test_no_crop_is_larger_than_the_bound_the_loader_plans_shared_memory_by(store, orientation, spacing, augment):
    """How many bytes a GPU's batches in flight take is read from a bound on each sample's crop: it must hold
    for every sample (on the oblique, feet-first, sagittal and tilted series of the store)."""
    from medload.data.patch_loader import _crop_bound

    ds = PatchDataset(store, PATCH, spacing, orientation, samples_per_epoch=64, seed=4)
    bounds = {rec.key: _crop_bound(ds, rec, augment) for rec in ds.records}
    for i in range(len(ds)):
        centre, draw, affine = ds.locate(i)
        rec = ds.records[draw.series]
        if augment is not None:
            world, grid = augment.matrix(ds.seed, ds.epoch, i, centre, ds.patch)
            affine = world @ affine @ grid
        box = source_box(voxel_to_voxel(affine, rec.affine), ds.patch, rec.shape)
        if box is not None:
            assert int(np.prod(box[1] - box[0])) <= bounds[rec.key], (i, rec.key[:8])
    if augment is None:  # not merely "the whole series" (rotated and zoomed, these small series are reached whole)
        assert any(bounds[rec.key] < np.prod(rec.shape) for rec in ds.records)

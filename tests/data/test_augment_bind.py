"""BatchAugment bound to a loader: device and spatial dims from the loader, no silent misuse on raw HU."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

from medload.config import IngestConfig
from medload.data import SlabDataset, make_loader
from medload.data.augment import AugmentConfig, BatchAugment
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

CPU = torch.device("cpu")
GEOMETRIC = AugmentConfig(intensity_prob=0.0, noise_prob=0.0)


def _batch(spatial: tuple[int, ...], batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, 1, *spatial) image in 0..1 and its (B, 1, *spatial) uint8 label (a box)."""
    image = torch.rand(batch, 1, *spatial, generator=torch.Generator().manual_seed(0))
    label = torch.zeros(batch, 1, *spatial, dtype=torch.uint8)
    label[(slice(None), slice(None)) + tuple(slice(n // 4, n // 2) for n in spatial)] = 1
    return image, label


def test_unbound_defaults_are_the_cpu_and_2d():
    aug = BatchAugment(AugmentConfig(affine_prob=1.0), seed=1)
    assert aug.device == CPU and aug.spatial_dims == 2
    image, label = _batch((12, 14))
    out_img, out_lab = aug(image, label)
    assert out_img.shape == image.shape and out_lab.shape == label.shape and not torch.equal(out_lab, label)
    with pytest.raises(ConfigError, match="spatial_dims=3"):  # a slab needs dims, from the user or a loader
        aug(*_batch((4, 12, 14)))


def test_bind_fills_device_and_dims_and_keeps_the_seeded_stream():
    image, label = _batch((5, 12, 14))
    aug = BatchAugment(AugmentConfig(affine_prob=1.0), seed=4)
    aug.set_epoch(2)  # before bind: kept
    assert aug.bind(device=CPU, spatial_dims=3, scaled=True) is aug
    assert aug.device == CPU and aug.spatial_dims == 3
    told = BatchAugment(AugmentConfig(affine_prob=1.0), seed=4, device="cpu", spatial_dims=3)
    told.set_epoch(2)
    first = aug(image, label)
    assert all(torch.equal(a, b) for a, b in zip(first, told(image, label)))
    aug.set_epoch(2)
    assert torch.equal(aug(image, label)[1], first[1])
    aug.bind(device=CPU, spatial_dims=3, scaled=True)  # the same loader settings again: fine


@pytest.mark.parametrize("device", DEVICES)
def test_3d_batch_through_a_bound_augment(device):
    image, label = (t.to(device) for t in _batch((6, 16, 18), batch=4))
    aug = BatchAugment(AugmentConfig(affine_prob=1.0, rotate_deg=30.0), seed=2)
    aug.bind(device=torch.device(device), spatial_dims=3, scaled=True)
    params = aug.draw(4)
    assert params.angles.shape == (4, 3) and params.flip.shape == (4, 3)  # drawn as 3D, on the device
    assert params.angles.device.type == torch.device(device).type
    out_img, out_lab = aug(image, label)
    assert out_img.shape == (4, 1, 6, 16, 18) and out_lab.shape == (4, 1, 6, 16, 18)
    assert out_lab.dtype == torch.uint8 and out_img.device == image.device
    assert not torch.equal(out_lab, label) and set(out_lab.unique().tolist()) <= {0, 1}


def test_dims_that_contradict_the_loader_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"spatial_dims=2\).*3D \(B, C, D, H, W\)"):
        BatchAugment(spatial_dims=2).bind(device=CPU, spatial_dims=3, scaled=True)
    BatchAugment(spatial_dims=3).bind(device=CPU, spatial_dims=3, scaled=True)  # agreeing is fine


def test_a_device_that_contradicts_the_loader_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"'cpu'.*'cuda:0'"):  # refused before CUDA is touched
        BatchAugment(device="cpu").bind(device=torch.device("cuda", 0), spatial_dims=2, scaled=True)


def test_a_second_loader_with_other_settings_is_refused():
    aug = BatchAugment().bind(device=CPU, spatial_dims=2, scaled=True)
    with pytest.raises(ConfigError, match="one BatchAugment per loader"):
        aug.bind(device=CPU, spatial_dims=3, scaled=True)
    assert aug.spatial_dims == 2


@pytest.mark.parametrize(
    "config",
    [AugmentConfig(), AugmentConfig(noise_prob=0.0), AugmentConfig(intensity_prob=0.0),
     AugmentConfig(intensity_shift=0.0, noise_std=0.0)],
    ids=["default", "intensity", "noise", "scale-only"],
)
def test_intensity_or_noise_on_raw_hu_is_refused(config):
    with pytest.raises(ConfigError, match=r"set window= on the loader.*AugmentConfig"):
        BatchAugment(config).bind(device=CPU, spatial_dims=2, scaled=False)
    BatchAugment(config).bind(device=CPU, spatial_dims=2, scaled=True)  # fine on 0..1 batches


def test_geometric_only_augmentation_on_raw_hu_is_fine():
    off = AugmentConfig(intensity_scale=0.0, intensity_shift=0.0, noise_std=0.0)  # zero ranges: nothing to tune
    for config in (GEOMETRIC, off):
        aug = BatchAugment(config, seed=3).bind(device=CPU, spatial_dims=2, scaled=False)
        image, label = _batch((12, 14))
        hu = image * 2000.0 - 1000.0
        out, _ = aug(hu, label)
        params = aug.draw(3)
        assert params.gain is None and params.noise_std is None
        assert out.min() >= hu.min() - 1e-3 and out.max() <= hu.max() + 1e-3  # no intensity change on HU


def test_bind_validates_its_arguments():
    with pytest.raises(ConfigError, match="spatial_dims"):
        BatchAugment().bind(device=CPU, spatial_dims=4, scaled=True)
    with pytest.raises(ConfigError, match="spatial_dims"):
        BatchAugment(spatial_dims=True)


@pytest.fixture(scope="module")
def slab_store(tmp_path_factory):
    """A real store of one 8-slice 20x24 series."""
    root = tmp_path_factory.mktemp("bind")
    make_series(root / "src", SeriesSpec(n_slices=8, rows=20, cols=24), seed=5)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


def test_make_loader_binds_the_augment_to_slab_batches(slab_store):
    ds = SlabDataset(open_store(slab_store), depth=4, stride=4)
    aug = BatchAugment(AugmentConfig(affine_prob=1.0))
    batch = next(iter(make_loader(ds, 2, augment=aug, window="soft_tissue")))
    assert batch["image"].shape == (2, 1, 4, 20, 24) and batch["image"].dtype == torch.float32
    assert aug.spatial_dims == 3 and aug.device == CPU


def test_make_loader_refuses_intensity_augmentation_of_raw_hu(slab_store):
    ds = SlabDataset(open_store(slab_store), depth=4, stride=4)
    with pytest.raises(ConfigError, match="set window= on the loader"):
        make_loader(ds, 2, augment=BatchAugment())
    make_loader(ds, 2, augment=BatchAugment(GEOMETRIC))  # geometric only: fine on HU

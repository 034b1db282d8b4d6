"""make_loader over a PatchDataset: the patch path (medload.data.patch_loader) gives ds[i]'s
patches, windowed on the device, with their affines, and workers draw the epoch the loader was set to."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.patch_store import make_patch_store

from medload import windows
from medload.data import PatchDataset, make_loader
from medload.errors import ConfigError
from medload.storage.store import open_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(make_patch_store(tmp_path_factory.mktemp("patch-loader")))


def _dataset(store, **kwargs) -> PatchDataset:
    return PatchDataset(store, patch=(6, 12, 10), spacing=(2.5, 1.5, 1.5), foreground=0.5, samples_per_epoch=4,
                        seed=7, **kwargs)


def _windowed(hu: torch.Tensor) -> torch.Tensor:
    lo, hi = windows.get("soft_tissue").bounds
    return ((hu - lo) / (hi - lo)).clamp(0, 1)


def test_batches_are_the_datasets_samples_windowed_with_their_affines(store):
    ds = _dataset(store)
    batches = list(make_loader(ds, batch_size=2, window="soft_tissue", meta=True))
    assert len(batches) == 2
    for batch in batches:
        assert batch["image"].shape == (2, 1, 6, 12, 10) and batch["image"].dtype == torch.float32
        for b, i in enumerate(batch["index"].tolist()):
            sample = ds[i]
            torch.testing.assert_close(batch["image"][b].as_tensor(), _windowed(sample["image"].as_tensor()))
            assert torch.equal(batch["label"][b].as_tensor(), sample["label"].as_tensor())
            assert batch["key"][b] == sample["key"] and torch.equal(batch["centre"][b], sample["centre"])
            np.testing.assert_array_equal(batch["image"].affine[b].numpy(), ds.item_affine(i))


def test_persistent_workers_draw_the_epoch_the_loader_was_set_to(store):
    ds = _dataset(store)
    loader = make_loader(ds, batch_size=4, num_workers=1, persistent_workers=True)
    centres = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        centres.append(next(iter(loader))["centre"])
    expected = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)  # the worker's copy of the dataset was set through the indices only
        expected.append(torch.stack([ds[i]["centre"] for i in range(4)]))
    assert torch.equal(centres[0], expected[0]) and torch.equal(centres[1], expected[1])
    assert torch.equal(centres[2], centres[0]) and not torch.equal(centres[0], centres[1])


def test_half_precision_is_windowed_then_cast(store):
    ds = _dataset(store, labels=False)
    batch = next(iter(make_loader(ds, batch_size=2, window="soft_tissue", dtype=torch.bfloat16)))
    assert batch["image"].dtype == torch.bfloat16 and "label" not in batch
    reference = _windowed(torch.stack([ds[i]["image"].as_tensor() for i in range(2)]))
    torch.testing.assert_close(batch["image"].float(), reference, atol=2**-8, rtol=0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": torch.int16}, "their batches are float"),
    ({"num_workers": "auto"}, "tunes the slice and slab loaders only"),
])
def test_settings_the_sample_path_cannot_honour_say_so(store, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_loader(_dataset(store), batch_size=2, **kwargs)


def test_a_restored_patch_loader_continues_the_epoch_with_the_same_patches_and_augmentation(store):
    """loader.state_dict() after two batches of epoch 1; a new loader restored from it gives the rest of that
    epoch as the uninterrupted one did (same indices, same augmented voxels), then the same epoch 2."""
    from medload.data import PatchAugment

    def build():
        return make_loader(_dataset(store), batch_size=1, num_workers=2, shuffle=True, seed=3,
                           augment=PatchAugment(rotate_deg=20, zoom=(0.9, 1.1), p=1.0))

    def epoch(loader, number):
        loader.set_epoch(number)
        return [(b["index"].tolist(), b["image"]) for b in loader]

    whole = build()
    epoch(whole, 0)
    reference = epoch(whole, 1)
    cut = build()
    cut.set_epoch(1)
    seen = iter(cut)
    for _ in range(2):
        next(seen)
    state = cut.state_dict()
    assert state["loader"] == "PatchLoader" and state["epoch"] == 1 and state["batches"] == 2
    del seen
    restored = build()
    restored.load_state_dict(state)
    rest = epoch(restored, 1)
    assert [i for i, _ in rest] == [i for i, _ in reference[2:]]
    for (_, a), (_, b) in zip(rest, reference[2:], strict=True):
        torch.testing.assert_close(a, b)
    assert [i for i, _ in epoch(restored, 2)] == [i for i, _ in epoch(whole, 2)]


def test_workers_share_the_l1_where_the_series_are_far_larger_than_it(store):
    """Patches read whole stored slices (image and label) through each worker's L1: the slice loaders'
    rule applies (medload.data.slots.worker_l1), counted on both."""
    decoded = sum(int(np.prod(r.shape)) for r in _dataset(store).records) * (2 + 1)  # int16 HU + uint8 label
    small = open_store(store.path, cache=decoded // 10)
    ds = _dataset(small)
    loader = make_loader(ds, batch_size=2, num_workers=2)
    assert loader.loader.worker_init_fn.budget == (decoded // 10) // 2
    assert next(iter(loader))["image"].shape == (2, 1, 6, 12, 10)
    assert make_loader(ds, batch_size=2, num_workers=1).loader.worker_init_fn.budget is None
    roomy = open_store(store.path, cache=decoded)
    assert make_loader(_dataset(roomy), batch_size=2, num_workers=2).loader.worker_init_fn.budget is None

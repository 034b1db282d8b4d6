"""The training API composes with stock PyTorch and MONAI: map-style datasets, one sample schema and one
axis convention for ``ds[i]``, the fast loader and the MONAI route, MetaTensor batches for MONAI's
post-processing."""

from __future__ import annotations

import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import DataLoader as MonaiDataLoader
from monai.data import decollate_batch
from monai.inferers import sliding_window_inference
from monai.transforms import Compose, EnsureChannelFirstd, Flipd, Invertd, LoadImaged, SaveImaged

from medload.config import IngestConfig
from medload.data import MedloadReader, SlabDataset, SliceDataset, make_loader
from medload.data.transforms import train_transforms, val_transforms
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.rtstruct import make_rtstruct


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A non-square oblique series (8 x 32 x 40) with an RTSTRUCT, and a 6 x 20 x 24 series without labels.
    Returns (store path, key of the labelled series, key of the other)."""
    root = tmp_path_factory.mktemp("api")
    gen = make_series(root / "src" / "a", SeriesSpec(n_slices=8, rows=32, cols=40, orientation="oblique"), seed=12,
                      series_number=1)
    square = np.array([[9.5, 7.5], [20.5, 7.5], [20.5, 15.5], [9.5, 15.5]])  # (column, row) index corners
    make_rtstruct(gen, {"Liver": [(z, [square]) for z in (2, 3, 4)]}, root / "src" / "a" / "rtstruct.dcm")
    make_series(root / "src" / "b", SeriesSpec(n_slices=6, rows=20, cols=24), seed=13, series_number=2)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    store = open_store(root / "store")
    (with_label,) = [r.key for r in store.series() if store.labels(r.key) is not None]
    (without,) = [r.key for r in store.series() if r.key != with_label]
    return root / "store", with_label, without


def _datasets(path, key):
    store = open_store(path)
    return {"2.5d": SliceDataset(store, context=1, keys=[key]), "3d": SlabDataset(store, depth=4, stride=1, keys=[key])}


@pytest.mark.parametrize("kind", ["2.5d", "3d"])
def test_stock_torch_and_monai_dataloaders_batch_the_sample_schema(labelled, kind):
    path, key, _ = labelled
    ds = _datasets(path, key)[kind]
    item = ds[3]
    assert set(item) == {"image", "label", "key", "z", "index"} and item["index"] == 3 and item["key"] == key
    for loader in (torch.utils.data.DataLoader(ds, batch_size=4), MonaiDataLoader(ds, batch_size=4, num_workers=0)):
        batch = next(iter(loader))
        assert batch["image"].shape == (4, *item["image"].shape)
        assert batch["label"].shape == (4, *item["label"].shape)
        assert batch["key"] == [key] * 4 and batch["index"].tolist() == [0, 1, 2, 3]
        assert batch["z"].tolist() == [ds[i]["z"] for i in range(4)]
        assert torch.equal(batch["image"][3].as_tensor(), item["image"].as_tensor())
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds[-1]["index"] == len(ds) - 1


@pytest.mark.parametrize("kind", ["2.5d", "3d"])
def test_monai_route_and_fast_loader_give_every_sample_exactly_as_the_dataset(labelled, kind):
    """Parity on a non-square series with labels: same array, affine, label shape for every sample."""
    path, key, _ = labelled
    store = open_store(path)
    ds = _datasets(path, key)[kind]
    spans = {"2.5d": {"context": 1}, "3d": {"depth": 4, "stride": 1}}[kind]
    items = store.items(labels=True, keys=[key], **spans)
    load = Compose([LoadImaged(keys=["image", "label"], reader=MedloadReader()), EnsureChannelFirstd(keys=["image", "label"])])
    fast = [b for b in make_loader(ds, batch_size=3, dtype=torch.int16)]
    fast_image = torch.cat([b["image"] for b in fast])
    fast_label = torch.cat([b["label"] for b in fast])
    assert len(items) == len(ds) == len(fast_image)
    for i, uri in enumerate(items):
        sample, monai_sample = ds[i], load(uri)
        assert (uri["key"], uri["z"], uri["index"]) == (sample["key"], sample["z"], sample["index"]) == (key, sample["z"], i)
        assert monai_sample["image"].shape == sample["image"].shape == fast_image[i].shape
        assert monai_sample["label"].shape == sample["label"].shape == fast_label[i].shape
        assert sample["label"].shape[0] == 1  # one label channel for a 1-channel segmentation head
        assert np.array_equal(monai_sample["image"].numpy(), sample["image"].numpy())
        assert np.array_equal(monai_sample["label"].numpy(), sample["label"].numpy())
        assert np.array_equal(fast_image[i].numpy(), sample["image"].numpy())
        assert np.array_equal(fast_label[i].numpy(), sample["label"].numpy())
        assert np.allclose(monai_sample["image"].affine.numpy(), sample["image"].affine.numpy(), atol=1e-9)
        assert np.allclose(monai_sample["label"].affine.numpy(), sample["image"].affine.numpy(), atol=1e-9)
    assert sum(int(fast_label[i].sum() > 0) for i in range(len(ds))) > 0  # the labels are not all empty


def test_sample_affine_maps_indices_to_the_series_voxel_they_hold(labelled):
    """Applied as documented: 2.5D (row, column, channel - k), 3D (slice - z, row, column)."""
    path, key, _ = labelled
    series = np.asarray(open_store(path).record(key).affine)
    ds = _datasets(path, key)
    item = ds["2.5d"][5]
    for r, c, ch in ((0, 0, 1), (31, 39, 0), (7, 11, 2)):
        got = item["image"].affine.numpy() @ [r, c, ch - 1, 1]
        assert np.allclose(got, series @ [c, r, item["z"] + ch - 1, 1], atol=1e-6)
    slab = ds["3d"][1]
    for s, r, c in ((0, 0, 0), (3, 31, 39)):
        assert np.allclose(slab["image"].affine.numpy() @ [s, r, c, 1], series @ [c, r, slab["z"] + s, 1], atol=1e-6)


def test_monai_presets_give_a_one_channel_label_for_a_one_channel_head(labelled):
    path, key, _ = labelled
    items = open_store(path).items(context=1, labels=True, keys=[key])
    for pipeline in (val_transforms("soft_tissue"), train_transforms("soft_tissue", seed=1)):
        out = pipeline(items[3])
        assert out["image"].shape == (3, 32, 40) and out["label"].shape == (1, 32, 40)


def test_meta_batches_carry_each_samples_affine_into_monai_post_processing(labelled, tmp_path):
    path, key, _ = labelled
    ds = _datasets(path, key)["3d"]
    batch = next(iter(make_loader(ds, batch_size=2, window="soft_tissue", meta=True)))
    image = batch["image"]
    assert image.affine.shape == (2, 4, 4) and batch["label"].affine.shape == (2, 4, 4)
    for b, i in enumerate(batch["index"].tolist()):
        assert np.allclose(image.affine[b].numpy(), ds.item_affine(i))
    # sliding-window inference keeps the metadata
    pred = sliding_window_inference(image, roi_size=(4, 16, 16), sw_batch_size=2, predictor=lambda x: x * 2)
    assert np.allclose(pred.affine.numpy(), image.affine.numpy()) and torch.allclose(pred.as_tensor(), image.as_tensor() * 2)
    # decollated samples: SaveImaged writes each where it belongs; Invertd undoes a transform
    pre = Flipd(keys="image", spatial_axis=1)
    saver = SaveImaged(keys="image", output_dir=tmp_path, output_postfix="", separate_folder=False, print_log=False)
    for sample in decollate_batch(batch):
        assert sample["key"] == key
        saved = saver(dict(sample))
        written = nib.load(str(next(tmp_path.glob(f"{key}_z{sample['z']:04d}*.nii.gz"))))
        assert np.allclose(written.affine, ds.item_affine(sample["index"]), atol=1e-5)
        assert np.allclose(np.asarray(written.dataobj), saved["image"][0].numpy(), atol=1e-6)
        flipped = pre(dict(sample))
        flipped["pred"] = flipped["image"].clone()
        restored = Invertd(keys="pred", transform=pre, orig_keys="image")(flipped)["pred"]
        assert torch.equal(restored.as_tensor(), sample["image"].as_tensor())
        assert np.allclose(restored.affine.numpy(), sample["image"].affine.numpy())


def test_partial_labels_warn_and_thin_series_warn(labelled):
    path, key, other = labelled
    store = open_store(path)
    with pytest.warns(UserWarning, match="1 of 2 series .* have no labels"):
        ds = SliceDataset(store, context=1)
    assert not ds.labels and "label" not in ds[0]
    with pytest.raises(ConfigError, match="1 of 2 series have no labels"):
        SliceDataset(store, labels=True)
    with pytest.warns(UserWarning, match="1 of 2 series have fewer than depth=7"):
        assert len(SlabDataset(store, depth=7, labels=False)) == 2  # the 8-slice series: slabs at 0 and 1
    with pytest.raises(ConfigError, match="every selected series has fewer than depth=9"):
        SlabDataset(store, depth=9)


def test_loader_order_defaults_like_torch_and_refuses_ignored_arguments(labelled):
    path, key, _ = labelled
    ds = _datasets(path, key)["2.5d"]
    order = [i for b in make_loader(ds, batch_size=3) for i in b["index"].tolist()]
    assert order == list(range(len(ds)))  # shuffle=False by default, as torch's and MONAI's DataLoader
    shuffled = [i for b in make_loader(ds, batch_size=3, shuffle=True, seed=4) for i in b["index"].tolist()]
    assert sorted(shuffled) == order and shuffled != order
    with pytest.raises(ConfigError, match="only orders a shuffled loader"):
        make_loader(ds, batch_size=3, seed=4)
    with pytest.raises(ConfigError, match="a sampler decides the order"):
        make_loader(ds, batch_size=3, sampler=[0, 1, 2], shuffle=True)


def test_importing_the_datasets_does_not_import_monai():
    code = "import sys, medload.data; from medload.data import SliceDataset, make_loader; print('monai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_monai_route_warns_about_thin_series_as_the_dataset_does(labelled):
    path, key, other = labelled
    with pytest.warns(UserWarning, match="1 of 2 series have fewer than depth=7"):
        items = open_store(path).items(depth=7)
    assert {it["key"] for it in items} == {key}

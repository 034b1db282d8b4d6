"""Store.items, the MONAI route's sample list: the datasets' filters, samples and schema."""

from __future__ import annotations

import numpy as np
import pydicom
import pytest
from monai.data import Dataset
from monai.transforms import LoadImaged

from medload.config import IngestConfig
from medload.data import MedloadReader, SlabDataset, SliceDataset
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.storage.uri import parse_item_uri
from medload.synthetic import SeriesSpec, make_rtstruct, make_series


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three series: 9 slices of 1 mm (labelled by an RTSTRUCT), 6 of 3 mm with kernel BONE, 5 oblique;
    ingested with a stored lung plane."""
    root = tmp_path_factory.mktemp("items")
    gens = [make_series(root / "src", SeriesSpec(n_slices=9, rows=20, cols=24, slice_spacing=1.0), seed=1,
                        series_number=1),
            make_series(root / "src", SeriesSpec(n_slices=6, rows=20, cols=24, slice_spacing=3.0), seed=2,
                        series_number=2),
            make_series(root / "src", SeriesSpec(n_slices=5, rows=16, cols=16, orientation="oblique"), seed=3,
                        series_number=3)]
    for path in gens[1].paths:
        ds = pydicom.dcmread(path)
        ds.ConvolutionKernel = "BONE"
        ds.save_as(path)
    square = np.array([[4.0, 4.0], [12.0, 4.0], [12.0, 12.0], [4.0, 12.0]])
    make_rtstruct(gens[0], {"Liver": [(z, [square]) for z in (3, 4, 5)]}, root / "src" / "rtstruct.dcm")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, windows=("lung",)))
    return open_store(root / "store")


def _samples(dataset) -> list[tuple[str, int]]:
    return [(dataset.index.keys[s], int(z)) for s, z in zip(dataset.index.series, dataset.index.z)]


def _filters(store) -> list[dict]:
    labelled = next(r.key for r in store.series() if store.labels(r.key) is not None)
    return [{}, {"kernel": "BONE"}, {"thickness": (0.5, 1.5)}, {"thickness": (2.0, 3.0)}, {"modality": ["CT"]},
            {"keys": labelled[:8]}, {"keys": store.catalog().query("rows == 20")}]


def test_items_select_the_samples_of_the_dataset_with_the_same_filters(store):
    for filters in _filters(store):
        stacks = store.items(context=1, **filters)
        assert [(it["key"], it["z"]) for it in stacks] == _samples(SliceDataset(store, context=1, **filters)), filters
        slabs = store.items(depth=4, stride=3, **filters)
        assert [(it["key"], it["z"]) for it in slabs] == _samples(SlabDataset(store, depth=4, stride=3, **filters))
        assert [it["index"] for it in stacks] == list(range(len(stacks)))
        assert [it["index"] for it in slabs] == list(range(len(slabs)))
    assert {it["key"] for it in store.items(context=0, kernel="BONE")} == {
        r.key for r in store.series() if r.kernel == "BONE"}
    with pytest.raises(ConfigError, match="no series"):
        store.items(context=1, modality="MR")


def test_items_carry_key_and_z_of_their_uris(store):
    for it in store.items(context=2):
        ref = parse_item_uri(it["image"])
        assert (ref.key, ref.z0, ref.context) == (it["key"], it["z"], 2)  # z: the centre slice
    for it in store.items(depth=4, stride=3):
        ref = parse_item_uri(it["image"])
        assert (ref.key, ref.z0, ref.z1) == (it["key"], it["z"], it["z"] + 4)  # z: the first slice
    assert [it["z"] for it in store.items(depth=4, stride=3, thickness=(0.5, 1.5))] == [0, 3, 5]


def test_items_check_labels_and_planes_before_loading(store):
    labelled = next(r.key for r in store.series() if store.labels(r.key) is not None)
    items = store.items(context=1, labels=True, keys=[labelled])
    assert len(items) == 9 and all(parse_item_uri(it["label"]).label for it in items)
    with pytest.raises(ConfigError, match="2 of 3 series have no labels"):
        store.items(context=1, labels=True)
    lung = store.items(context=0, plane="lung")
    assert {parse_item_uri(it["image"]).plane for it in lung} == {"lung"}
    with pytest.raises(ConfigError, match="no stored 'bone' planes"):
        store.items(context=0, plane="bone")


def test_monai_dataset_over_items_keeps_the_sample_schema(store):
    items = store.items(context=1, labels=True, thickness=(0.5, 1.5))
    dataset = SliceDataset(store, context=1, labels=True, thickness=(0.5, 1.5))
    monai = Dataset(items, transform=LoadImaged(keys=["image", "label"], reader=MedloadReader()))
    for i in (0, 4, 8):
        sample = monai[i]
        assert {"image", "label", "key", "z", "index"} <= set(sample)
        assert (sample["key"], sample["z"], sample["index"]) == (dataset[i]["key"], dataset[i]["z"], i)
        assert sorted(sample["image"].shape) == sorted(dataset[i]["image"].shape)

"""Samplers: epoch determinism, series grouping, foreground rate, from_dataset (the distributed sampler:
test_partition.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.labelled_store import make_labelled_store
from torch.utils.data import DataLoader, TensorDataset

from medload.data import SlabDataset, SliceDataset, sample_layout
from medload.data.distributed import DistributedPatientSampler
from medload.data.samplers import ForegroundSampler, SeriesGroupedSampler, UniformSampler
from medload.errors import ConfigError
from medload.storage.store import open_store


# ------------------------------------------------------------------------------------ Uniform / grouped
def test_uniform_sampler_permutation_reproducible_and_epochs():
    s = UniformSampler(1000, seed=5)
    first = list(s)
    assert sorted(first) == list(range(1000)) and len(s) == 1000
    assert list(UniformSampler(1000, seed=5)) == first and list(s) == first
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == list(range(1000))
    s.set_epoch(0)
    assert list(s) == first
    assert list(UniformSampler(1000, seed=6)) != first


def test_uniform_sampler_num_samples_and_replacement():
    chained = np.array(list(UniformSampler(10, num_samples=25)))
    assert chained.size == 25 and set(np.bincount(chained, minlength=10)) <= {2, 3}
    drawn = np.array(list(UniformSampler(10, num_samples=500, replacement=True, seed=1)))
    assert drawn.size == 500 and drawn.min() >= 0 and drawn.max() < 10 and np.unique(drawn).size == 10
    for bad in (dict(n=0), dict(n=5, num_samples=0), dict(n=2.5)):
        with pytest.raises(ConfigError):
            UniformSampler(**bad)


def _runs(values: list[int]) -> list[int]:
    """The distinct values in order of their runs (a value seen in two runs appears twice)."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("block", [None, 1, 3, 50])
def test_series_grouped_sampler(contiguous, block):
    rng = np.random.default_rng(2)
    series = np.repeat(rng.permutation(30) * 7 + 1000, rng.integers(1, 12, 30)).astype(np.int32)
    if not contiguous:
        series = rng.permutation(series)
    s = SeriesGroupedSampler(series, seed=11, block=block)
    order = list(s)
    assert sorted(order) == list(range(series.size)) and len(s) == series.size
    visits = _runs(series[order].tolist())
    assert len(visits) == len(set(visits)) == 30  # each series visited once, contiguously
    assert list(SeriesGroupedSampler(series, seed=11, block=block)) == order
    for sid in np.unique(series):  # blocks: runs of `block` consecutive members of the series, in order
        members = np.flatnonzero(series == sid)
        rank_in_series = np.searchsorted(members, [i for i in order if series[i] == sid])
        blocks = rank_in_series // (members.size if block is None else block)
        assert len(_runs(blocks.tolist())) == len(set(blocks.tolist()))  # each block visited once ...
        starts = np.r_[True, blocks[1:] != blocks[:-1]]
        assert np.all(np.diff(rank_in_series)[~starts[1:]] == 1)  # ... as a run of consecutive members
        assert np.all(rank_in_series[starts] % (members.size if block is None else block) == 0)
    s.set_epoch(1)
    assert list(s) != order and sorted(s) == list(range(series.size))


def test_series_grouped_sampler_without_shuffle_is_first_appearance_order():
    series = np.array([5, 5, 2, 9, 2, 5, 9], np.int32)
    assert list(SeriesGroupedSampler(series, shuffle=False)) == [0, 1, 5, 2, 4, 3, 6]
    assert list(SeriesGroupedSampler(np.sort(series), shuffle=False, block=2)) == list(range(7))


# ------------------------------------------------------------------------------------------- foreground
@pytest.mark.parametrize("p", [0.0, 0.33, 0.8])
def test_foreground_rate(p):
    fg = np.zeros(1000, bool)
    fg[np.random.default_rng(0).choice(1000, 100, replace=False)] = True  # base rate 0.1
    s = ForegroundSampler(fg, p=p, num_samples=20_000, seed=3)
    drawn = np.array(list(s))
    assert drawn.size == len(s) == 20_000 and drawn.min() >= 0 and drawn.max() < 1000
    assert abs(fg[drawn].mean() - (p + (1 - p) * 0.1)) < 0.02
    s.set_epoch(1)
    assert not np.array_equal(np.array(list(s)), drawn)


def test_foreground_all_background():
    with pytest.raises(ConfigError, match="no sample has foreground"):
        ForegroundSampler(np.zeros(50, bool))
    s = ForegroundSampler(np.zeros(50, bool), p=0)
    assert len(list(s)) == 50
    with pytest.raises(ConfigError, match="probability"):
        ForegroundSampler(np.ones(5, bool), p=1.5)
    counts = np.array([0, 0, 3, 0])  # per-sample foreground counts work as a mask
    assert set(ForegroundSampler(counts, p=1.0, num_samples=30)) == {2}


# ------------------------------------------------------------------------------------------- DataLoader
def test_samplers_drive_a_dataloader():
    data = TensorDataset(torch.arange(24))
    series = np.repeat(np.arange(6), 4).astype(np.int32)
    samplers = [UniformSampler(24, seed=1), SeriesGroupedSampler(series, block=2),
                ForegroundSampler(np.arange(24) % 5 == 0, num_samples=10),
                DistributedPatientSampler(series // 2, rank=1, world_size=2)]
    for sampler in samplers:
        loader = DataLoader(data, batch_size=4, sampler=sampler)
        got = torch.cat([batch[0] for batch in loader]).tolist()
        assert got == list(sampler)


# ----------------------------------------------------------------------------------------- from_dataset
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(make_labelled_store(tmp_path_factory.mktemp("samplers")))


def _orders(sampler, epochs=(0, 1, 2)) -> list[list[int]]:
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("kind", ["2.5d", "3d"])
def test_from_dataset_equals_the_sampler_built_from_the_datasets_arrays(store, kind):
    ds = SliceDataset(store, context=1) if kind == "2.5d" else SlabDataset(store, depth=3, stride=2)
    assert ds.foreground.any() and not ds.foreground.all() and np.unique(ds.index.patients).size == 5
    patients, shards, slices = sample_layout(ds)  # cost="slices" weighs a sample by the slices it first covers
    pairs = [
        (UniformSampler.from_dataset(ds, seed=4, num_samples=50), UniformSampler(len(ds), seed=4, num_samples=50)),
        (ForegroundSampler.from_dataset(ds, p=0.5, seed=4), ForegroundSampler(ds.foreground, p=0.5, seed=4)),
        (SeriesGroupedSampler.from_dataset(ds, seed=4, block=2), SeriesGroupedSampler(ds.index.series, seed=4, block=2)),
        (DistributedPatientSampler.from_dataset(ds, rank=1, world_size=2, seed=4, cost="slices"),
         DistributedPatientSampler(patients, rank=1, world_size=2, seed=4, shards=shards, weights=slices)),
    ]
    for made, by_hand in pairs:
        assert type(made) is type(by_hand) and len(made) == len(by_hand)
        orders = _orders(made)
        assert orders == _orders(by_hand) and orders[0] != orders[1]
        assert set(orders[0]) <= set(range(len(ds)))


def test_foreground_sampler_from_a_dataset_without_labels_says_labels_are_needed(store):
    ds = SliceDataset(store, context=0, labels=False)
    assert ds.foreground is None
    with pytest.raises(ConfigError, match="needs labels"):
        ForegroundSampler.from_dataset(ds)
    assert len(UniformSampler.from_dataset(ds)) == len(ds) == 36  # the others need no labels


@pytest.mark.parametrize("sampler", [UniformSampler, ForegroundSampler, SeriesGroupedSampler,
                                     DistributedPatientSampler])
def test_from_dataset_refuses_arrays_and_names_the_constructor(sampler):
    with pytest.raises(ConfigError, match=f"{sampler.__name__}.from_dataset takes a SliceDataset"):
        sampler.from_dataset(np.zeros(10, np.int32))

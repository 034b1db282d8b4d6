"""Shape buckets (medload.data.buckets): a real store of two matrix sizes through make_loader, a few training
steps on it, and the batch sampler's invariants (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from medload.config import IngestConfig
from medload.data import SlabDataset, SliceDataset, UniformSampler, make_loader
from medload.data.buckets import ShapeBucketBatchSampler, shape_buckets
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

SIZES = [(48, 40), (64, 64)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Six patients, one series each, alternating 48x40 and 64x64 matrices (5..10 slices: 45 in all)."""
    root = tmp_path_factory.mktemp("buckets")
    for p in range(6):
        rows, cols = SIZES[p % 2]
        make_series(root / "src" / f"p{p}", SeriesSpec(n_slices=5 + p, rows=rows, cols=cols), seed=40 + p,
                    patient_id=f"BKT-{p}")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return open_store(root / "store")


def _size_of(ds, i: int) -> tuple[int, int]:
    return tuple(ds.records[ds.index.series[i]].shape[1:])


def _epoch(loader, ds) -> list[np.ndarray]:
    """The index array of every batch of one pass, checking each batch holds one matrix size."""
    out = []
    for batch in loader:
        index = batch["index"].numpy()
        assert {_size_of(ds, i) for i in index.tolist()} == {tuple(batch["image"].shape[-2:])}
        out.append(index)
    return out


def test_buckets_follow_the_series_matrix_sizes(store):
    ds = SliceDataset(store, context=1)
    buckets = shape_buckets(ds)
    assert buckets.shape == (len(ds),) == (45,)
    assert {_size_of(ds, i): int(b) for i, b in enumerate(buckets.tolist())} == {SIZES[0]: 0, SIZES[1]: 1}
    with pytest.raises(ConfigError, match="mixes matrix sizes"):  # direct batch reads still refuse a mix
        ds.read_samples(list(range(len(ds))))


def test_mixed_sizes_load_one_shape_per_batch_every_sample_once(store):
    ds = SliceDataset(store, context=1)
    loader = make_loader(ds, batch_size=4, num_workers=0, shuffle=True, seed=3)  # EpochShuffle: no set_epoch
    epochs = []
    for _ in range(2):
        expected = len(loader)
        batches = _epoch(loader, ds)
        assert len(batches) == expected == 12  # 21 + 24 samples per size: 6 + 6 batches
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(ds)))
        epochs.append(np.concatenate(batches))
    assert not np.array_equal(epochs[0], epochs[1])  # a new order each pass
    batch = next(iter(loader))  # the values are the samples' own
    for b, i in enumerate(batch["index"].tolist()):
        assert torch.equal(batch["image"][b], ds[i]["image"].as_tensor().float())


def test_two_workers_reproduce_each_epoch_and_drop_last_per_size(store):
    ds = SlabDataset(store, depth=4, stride=2)
    sampler = UniformSampler(len(ds), seed=1, num_samples=3 * len(ds))  # chained permutations: repeats
    loader = make_loader(ds, batch_size=3, num_workers=2, sampler=sampler, drop_last=True)
    per_size = np.bincount(shape_buckets(ds)[np.array(list(sampler))], minlength=2)
    assert len(loader) == (per_size // 3).sum()
    runs = {}
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        batches = _epoch(loader, ds)
        assert len(batches) == len(loader) and all(b.size == 3 for b in batches)
        runs.setdefault(epoch, []).append(np.concatenate(batches))
    assert np.array_equal(*runs[0])  # the same epoch, the same batches
    assert not np.array_equal(runs[0][0], runs[1][0])
    kept = np.bincount(shape_buckets(ds)[runs[0][0]], minlength=2)
    assert np.array_equal(kept, per_size - per_size % 3)  # only each size's last partial batch is dropped


def test_a_few_training_steps_on_mixed_sizes(store):
    torch.manual_seed(0)
    ds = SliceDataset(store, context=1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 1, 1))
    before = [p.detach().clone() for p in model.parameters()]
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-2)
    shapes, losses = set(), []
    for step, batch in enumerate(make_loader(ds, batch_size=4, window="soft_tissue", shuffle=True, seed=0)):
        image = batch["image"]
        loss = torch.nn.functional.mse_loss(model(image), image[:, 1:2])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        shapes.add(tuple(image.shape[2:]))
        losses.append(loss.item())
        if step == 7:
            break
    assert shapes == set(SIZES) and len(losses) == 8 and np.isfinite(losses).all()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ------------------------------------------------------------------------------ the batch sampler alone
@st.composite
def epochs(draw):
    """(bucket per dataset index, the sampler's order: a permutation, or draws with repeats)."""
    n = draw(st.integers(1, 60))
    buckets = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.int64) * 7  # sparse ids
    if draw(st.booleans()):
        order = draw(st.permutations(range(n)))
    else:
        order = draw(st.lists(st.integers(0, n - 1), max_size=80))
    return buckets, list(order)


@settings(max_examples=200, deadline=None)
@given(epochs(), st.integers(1, 8), st.booleans())
def test_batch_sampler_invariants(epoch, batch_size, drop_last):
    buckets, order = epoch
    sampler = ShapeBucketBatchSampler(order, buckets, batch_size, drop_last)
    expected = len(sampler)
    batches = list(sampler)
    assert len(batches) == expected and list(sampler) == batches  # len is right; a list sampler repeats
    assert all(len({int(buckets[i]) for i in b}) == 1 and 1 <= len(b) <= batch_size for b in batches)
    for k in np.unique(buckets).tolist():
        wanted = [i for i in order if buckets[i] == k]
        got = [i for b in batches if buckets[b[0]] == k for i in b]
        keep = len(wanted) - len(wanted) % batch_size if drop_last else len(wanted)
        assert got == wanted[:keep]  # the sampler's order within each bucket; only drop_last's tail goes
        assert sum(len(b) < batch_size for b in batches if buckets[b[0]] == k) <= (0 if drop_last else 1)
    full = [b for b in batches if len(b) == batch_size]
    if len(set(order)) == len(order):  # a permutation: a full batch goes out when its last sample comes up
        position = {i: p for p, i in enumerate(order)}
        done = [max(position[i] for i in b) for b in full]
        assert done == sorted(done) and batches[: len(full)] == full  # partial batches only at the end


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=50), st.integers(1, 6), st.booleans())
def test_one_bucket_batches_like_torch(order, batch_size, drop_last):
    ours = ShapeBucketBatchSampler(order, np.zeros(31, np.int64), batch_size, drop_last)
    theirs = torch.utils.data.BatchSampler(order, batch_size, drop_last)
    assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_random_sampler_draws_once_per_pass_and_bad_buckets_are_refused():
    buckets = np.arange(20) % 3
    sampler = torch.utils.data.RandomSampler(range(20), generator=torch.Generator().manual_seed(0))
    batches = ShapeBucketBatchSampler(sampler, buckets, 4)
    first_len, first = len(batches), list(batches)  # len() draws the order that the pass then uses
    assert first_len == len(first) == 6 and sorted(i for b in first for i in b) == list(range(20))
    second = list(batches)
    assert second != first and sorted(i for b in second for i in b) == list(range(20))
    for bad in (np.zeros((4, 2), np.int64), np.zeros(20)):
        with pytest.raises(ConfigError, match="buckets"):
            ShapeBucketBatchSampler(range(4), bad, 2)
    with pytest.raises(ConfigError, match="batch_size"):
        ShapeBucketBatchSampler(range(4), np.zeros(4, np.int64), 0)

"""Samplers: partition invariants (hypothesis), epoch determinism, padding/truncation, foreground rate."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from medload.data.samplers import (
    DistributedPatientSampler,
    ForegroundSampler,
    SeriesGroupedSampler,
    UniformSampler,
    partition_by_patient,
)
from medload.errors import ConfigError

LOGGER = "medload.data.samplers"

patient_arrays = st.lists(st.integers(-3, 12), min_size=0, max_size=120).map(lambda v: np.array(v, np.int32))
world_sizes = st.integers(1, 8)
seeds = st.integers(0, 2**40)
epochs = st.integers(0, 10_000)


def _check_partition(patients: np.ndarray, parts: list[np.ndarray], world_size: int) -> None:
    assert len(parts) == world_size
    everything = np.concatenate(parts)
    assert everything.size == patients.size  # no duplicates ...
    assert np.array_equal(np.sort(everything), np.arange(patients.size))  # ... and complete
    owner = {}
    for rank, part in enumerate(parts):
        for pid in np.unique(patients[part]).tolist():
            assert owner.setdefault(pid, rank) == rank, f"patient {pid} on ranks {owner[pid]} and {rank}"


@settings(max_examples=150, deadline=None)
@given(patient_arrays, world_sizes, seeds, epochs)
def test_partition_invariants(patients, world_size, seed, epoch):
    parts = partition_by_patient(patients, world_size, seed=seed, epoch=epoch)
    _check_partition(patients, parts, world_size)
    # deterministic in (patients, world_size, seed, epoch)
    again = partition_by_patient(patients.copy(), world_size, seed=seed, epoch=epoch)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    # balanced on sample counts: spread <= the largest patient
    loads = [p.size for p in parts]
    largest = np.unique(patients, return_counts=True)[1].max() if patients.size else 0
    assert max(loads) - min(loads) <= largest


@settings(max_examples=60, deadline=None)
@given(patient_arrays.filter(lambda p: p.size > 1), world_sizes, seeds, epochs)
def test_partition_reshuffles_between_epochs(patients, world_size, seed, epoch):
    first = partition_by_patient(patients, world_size, seed=seed, epoch=epoch)
    later = [partition_by_patient(patients, world_size, seed=seed, epoch=epoch + k) for k in range(1, 11)]
    assert any(not all(np.array_equal(a, b) for a, b in zip(first, other)) for other in later)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.floats(0, 50)), min_size=1, max_size=80), world_sizes, seeds)
def test_partition_balances_weights(rows, world_size, seed):
    patients = np.array([r[0] for r in rows], np.int32)
    weights = np.array([r[1] for r in rows])
    parts = partition_by_patient(patients, world_size, seed=seed, epoch=3, weights=weights)
    _check_partition(patients, parts, world_size)
    loads = [weights[p].sum() for p in parts]
    largest = np.bincount(patients, weights=weights).max()
    assert max(loads) - min(loads) <= largest + 1e-9


def test_partition_more_ranks_than_patients_leaves_ranks_empty():
    patients = np.array([7, 7, 3, 3, 3], np.int32)
    parts = partition_by_patient(patients, 5, seed=1, epoch=0)
    _check_partition(patients, parts, 5)
    assert sorted(p.size for p in parts) == [0, 0, 0, 2, 3]
    assert [p.size for p in partition_by_patient(np.zeros(0, np.int32), 3, seed=0, epoch=0)] == [0, 0, 0]


def test_partition_large_sparse_ids_match_dense_ids():
    dense = np.random.default_rng(0).integers(0, 40, 500).astype(np.int32)
    sparse = (dense.astype(np.int64) * 10**12 - 5).astype(np.int64)  # same grouping, ids needing np.unique
    a = partition_by_patient(dense, 3, seed=9, epoch=2)
    b = partition_by_patient(sparse, 3, seed=9, epoch=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("bad", [
    dict(patients=np.zeros((2, 2), np.int32)), dict(patients=np.zeros(3)), dict(world_size=0),
    dict(weights=np.array([1.0, -1.0, 1.0])), dict(weights=np.ones(2)), dict(epoch=-1),
])
def test_partition_rejects_bad_input(bad):
    args = dict(patients=np.array([0, 1, 1], np.int32), world_size=2, seed=0, epoch=0) | bad
    with pytest.raises(ConfigError):
        partition_by_patient(args.pop("patients"), args.pop("world_size"), **args)


# ------------------------------------------------------------------------------ DistributedPatientSampler
def _samplers(patients, world_size, even, seed=0, epoch=0):
    out = [DistributedPatientSampler(patients, rank=r, world_size=world_size, seed=seed, even=even)
           for r in range(world_size)]
    for s in out:
        s.set_epoch(epoch)
    return out


@settings(max_examples=40, deadline=None)
@given(patient_arrays.filter(lambda p: p.size > 0), world_sizes, seeds, epochs)
def test_distributed_pad_equal_lengths_and_exact_mask(patients, world_size, seed, epoch):
    samplers = _samplers(patients, world_size, "pad", seed, epoch)
    parts = partition_by_patient(patients, world_size, seed=seed, epoch=epoch)
    longest = max(p.size for p in parts)
    for s, part in zip(samplers, parts):
        order = np.array(list(s), np.int64)
        assert len(s) == order.size == longest
        assert s.padding.shape == (longest,) and s.padding.sum() == s.padded == longest - part.size
        assert np.array_equal(order[~s.padding], part)  # real samples first, in partition order
        assert not s.padding[: part.size].any()
        if part.size:
            assert np.array_equal(order[s.padding], np.resize(part, s.padded))  # repeats of the first ones
        assert s.dropped == 0
    real = np.concatenate([np.array(list(s))[~s.padding] for s in samplers])
    assert np.array_equal(np.sort(real), np.arange(patients.size))


def test_distributed_truncate_equal_lengths_and_counts(caplog):
    patients = np.repeat(np.arange(5), [4, 3, 3, 2, 1]).astype(np.int32)  # 13 samples
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        samplers = _samplers(patients, 3, "truncate", seed=4)
    parts = partition_by_patient(patients, 3, seed=4, epoch=0)
    shortest = min(p.size for p in parts)
    assert {len(s) for s in samplers} == {shortest}
    for s, part in zip(samplers, parts):
        assert np.array_equal(np.array(list(s)), part[:shortest])
        assert s.dropped == part.size - shortest and s.padded == 0 and not s.padding.any()
    assert sum(s.dropped for s in samplers) + 3 * shortest == patients.size
    assert any(r.levelno == logging.WARNING and "dropped" in r.getMessage() for r in caplog.records)


def test_distributed_pad_warns_and_exact_split_is_silent(caplog):
    uneven = np.repeat(np.arange(3), [5, 2, 2]).astype(np.int32)  # ranks of 5 and 4
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        samplers = _samplers(uneven, 2, "pad")
    assert sorted(s.padded for s in samplers) == [0, 1]
    assert len([r for r in caplog.records if "padded 1 samples" in r.getMessage()]) == 2  # every rank says so
    caplog.clear()
    exact = np.repeat(np.arange(4), 3).astype(np.int32)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for even in ("pad", "truncate", "none"):
            for s in _samplers(exact, 2, even):
                assert len(s) == 6 and s.padded == s.dropped == 0 and not s.padding.any()
    assert not caplog.records


def test_distributed_none_and_empty_ranks():
    patients = np.array([0, 0, 0, 1], np.int32)
    assert sorted(len(s) for s in _samplers(patients, 2, "none")) == [1, 3]
    padded = _samplers(patients, 4, "pad")  # two ranks own no patient: they repeat the global order
    assert {len(s) for s in padded} == {3}
    assert sorted(s.padded for s in padded) == [0, 2, 3, 3]
    with pytest.raises(ConfigError, match="even='pad'"):
        DistributedPatientSampler(patients, rank=0, world_size=4, even="truncate")
    with pytest.raises(ConfigError, match="rank 2"):
        DistributedPatientSampler(patients, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="even must be"):
        DistributedPatientSampler(patients, rank=0, world_size=2, even="repeat")


def test_distributed_set_epoch_reshuffles():
    patients = np.repeat(np.arange(20), 5).astype(np.int32)
    s = DistributedPatientSampler(patients, rank=1, world_size=4, seed=3)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first


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

"""Patients to ranks (medload.data.distributed): invariants (hypothesis), cost balance on a skewed archive,
shard preference, padding."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medload.data.distributed import (
    DistributedPatientSampler,
    _cut,
    _patient_loads,
    _sequence,
    assign_ranks,
    locality_order,
    partition_by_patient,
    shards_for_rank,
)
from medload.errors import ConfigError
from medload.storage.records import SeriesRecord

LOGGER = "medload.data.distributed"

patient_arrays = st.lists(st.integers(-3, 12), min_size=0, max_size=120).map(lambda v: np.array(v, np.int32))
world_sizes = st.integers(1, 8)
seeds = st.integers(0, 2**40)
epochs = st.integers(0, 10_000)


@st.composite
def series_tables(draw):
    """Series as (patient, shard, slices) rows: a patient's series are mostly in one shard, as ingest writes."""
    n = draw(st.integers(1, 40))
    patients = np.array(draw(st.lists(st.integers(0, 15), min_size=n, max_size=n)), np.int64)
    home = np.array(draw(st.lists(st.integers(0, 6), min_size=16, max_size=16)))
    stray = np.array(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
    shards = np.where(np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))), stray, home[patients])
    slices = np.array(draw(st.lists(st.integers(1, 30), min_size=n, max_size=n)), np.int64)
    return patients, shards, slices


def _check_partition(patients: np.ndarray, parts: list[np.ndarray], world_size: int) -> None:
    assert len(parts) == world_size
    everything = np.concatenate(parts)
    assert everything.size == patients.size  # no duplicates ...
    assert np.array_equal(np.sort(everything), np.arange(patients.size))  # ... and complete
    owner = {}
    for rank, part in enumerate(parts):
        for pid in np.unique(patients[part]).tolist():
            assert owner.setdefault(pid, rank) == rank, f"patient {pid} on ranks {owner[pid]} and {rank}"


def _cut_only(patients, world_size, seed, shards=None, weights=None) -> np.ndarray:
    """The rank per entry of the rule's cut (steps 1-3), before the balancing exchanges of step 4."""
    _, patient, home, load = _patient_loads(patients, shards, weights)
    return _cut(load, _sequence(home, seed), world_size)[patient]


def _spread_ok(loads, largest, world_size, total) -> bool:
    """Every rank within one largest patient of the mean (so ranks differ by less than two)."""
    return all(abs(x - total / world_size) <= largest + 1e-9 for x in loads)


# ------------------------------------------------------------------------------------------ the rule
@settings(max_examples=150, deadline=None)
@given(patient_arrays, world_sizes, seeds, epochs)
def test_partition_invariants(patients, world_size, seed, epoch):
    parts = partition_by_patient(patients, world_size, seed=seed, epoch=epoch)
    _check_partition(patients, parts, world_size)
    again = partition_by_patient(patients.copy(), world_size, seed=seed, epoch=epoch)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # deterministic
    largest = np.unique(patients, return_counts=True)[1].max() if patients.size else 0
    assert _spread_ok([p.size for p in parts], largest, world_size, patients.size)


@settings(max_examples=80, deadline=None)
@given(series_tables(), world_sizes, seeds)
def test_shard_preference_and_balance_with_weights(table, world_size, seed):
    patients, shards, slices = table
    ranks = assign_ranks(patients, world_size, seed=seed, shards=shards, weights=slices)
    _check_partition(patients, [np.flatnonzero(ranks == r) for r in range(world_size)], world_size)
    loads = np.bincount(ranks, weights=slices, minlength=world_size)
    assert _spread_ok(loads, np.bincount(patients, weights=slices).max(), world_size, slices.sum())
    # the cut gives each rank a run of shards in the home-shard sequence: runs meet only at cuts, so the
    # reads beyond one per shard are at most one per cut, plus one per patient the balancing step moved
    # off its run, plus the series kept away from their patient's home
    home = {p: np.bincount(shards[patients == p], weights=slices[patients == p]).argmax() for p in set(patients.tolist())}
    strays = {(p, s) for p, s in zip(patients.tolist(), shards.tolist()) if s != home[p]}
    moved = np.unique(patients[ranks != _cut_only(patients, world_size, seed, shards, slices)]).size
    homes_read = sum(len({home[p] for p in patients[ranks == r].tolist()}) for r in range(world_size))
    assert homes_read <= len(set(home.values())) + world_size - 1 + moved
    reads = sum(np.unique(shards[ranks == r]).size for r in range(world_size))
    assert reads <= homes_read + len(strays)


def test_equal_shards_go_whole_to_ranks():
    patients = np.arange(32).repeat(10)  # 32 patients of 10 slices, 4 per shard
    shards = patients // 4
    ranks = assign_ranks(patients, 4, seed=3, shards=shards)
    assert [np.unique(shards[ranks == r]).tolist() for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    blind = assign_ranks(patients, 4, seed=3)  # without shard ids the same patients scatter over shards
    assert sum(np.unique(shards[blind == r]).size for r in range(4)) > 8


def _skewed_archive(seed: int = 11, n: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """(cost, shard) per patient: lognormal slice counts (median ~90) and four huge patients, 40 per shard."""
    rng = np.random.default_rng(seed)
    cost = np.maximum(1, np.round(rng.lognormal(4.5, 1.0, n))).astype(np.int64)
    cost[rng.choice(n, 4, replace=False)] = [3000, 4000, 5000, 6000]
    return cost, np.arange(n) // 40


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_skewed_archive_balances_cost_within_five_percent(world_size):
    cost, shards = _skewed_archive()
    patients = np.arange(cost.size).repeat(2)  # two series per patient, the cost split between them
    halves = np.stack([cost // 2, cost - cost // 2], axis=1).reshape(-1)
    ranks = assign_ranks(patients, world_size, seed=3, shards=shards.repeat(2), weights=halves)
    _check_partition(patients, [np.flatnonzero(ranks == r) for r in range(world_size)], world_size)
    loads = np.bincount(ranks, weights=halves, minlength=world_size)
    assert loads.max() / loads.min() < 1.05
    assert loads.max() - loads.min() <= 0.01 * cost.sum() / world_size  # the rule's tolerance, below the 5% asked
    cut = np.bincount(_cut_only(patients, world_size, 3, shards.repeat(2), halves), weights=halves, minlength=world_size)
    if world_size >= 8:  # the cut alone misses here: the balancing step is what meets the bound
        assert cut.max() / cut.min() > 1.05
    moved = np.unique(patients[ranks != _cut_only(patients, world_size, 3, shards.repeat(2), halves)]).size
    reads = sum(np.unique(shards.repeat(2)[ranks == r]).size for r in range(world_size))
    assert reads <= shards.max() + world_size + moved  # locality: the cut's runs, plus one per moved patient


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=60), world_sizes, seeds)
def test_balance_bound(costs, world_size, seed):
    """Two ranks differ by at most 1% of an equal share, or else every patient of the heavier one weighs at
    least their gap (none could move to narrow it); and the exchanges never widen the cut's spread."""
    cost = np.array(costs, np.int64)
    ranks = assign_ranks(np.arange(cost.size), world_size, seed=seed, weights=cost)
    assert np.array_equal(ranks, assign_ranks(np.arange(cost.size), world_size, seed=seed, weights=cost.copy()))
    loads = np.bincount(ranks, weights=cost, minlength=world_size)
    slack = 0.01 * cost.sum() / world_size
    for a in range(world_size):
        for b in range(world_size):
            gap = loads[a] - loads[b]
            if gap > slack:
                heavy = cost[ranks == a]
                assert np.all((heavy == 0) | (heavy >= gap)), (a, b, gap, heavy)
    if cost.max() <= slack:
        assert loads.max() - loads.min() <= slack
    cut = np.bincount(_cut_only(np.arange(cost.size), world_size, seed, weights=cost), weights=cost,
                      minlength=world_size)
    assert loads.max() <= cut.max() and loads.min() >= cut.min()


def test_patient_heavier_than_a_share_gets_a_rank_alone_and_a_warning(caplog):
    cost, shards = _skewed_archive(seed=5, n=300)
    cost[7] = cost.sum()  # half of everything: no partition into 4 ranks can balance
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ranks = assign_ranks(np.arange(cost.size), 4, seed=0, shards=shards, weights=cost)
    assert np.flatnonzero(ranks == ranks[7]).tolist() == [7]  # the others moved off its rank
    others = np.bincount(ranks, weights=cost, minlength=4)[np.arange(4) != ranks[7]]
    assert others.max() - others.min() <= 0.01 * cost.sum() / 4  # the rest balance among themselves
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "heaviest one alone costs 200% of a share" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):  # lumpy but no patient above a share: info, not a warning
        assign_ranks(np.arange(3), 2, seed=0, weights=np.array([5, 5, 5]))
    assert [r.levelno for r in caplog.records] == [logging.INFO]


@settings(max_examples=60, deadline=None)
@given(series_tables(), world_sizes, seeds)
def test_series_level_and_sample_level_agree(table, world_size, seed):
    """What `cache warm` computes per series equals what the sampler computes per sample (by construction)."""
    patients, shards, slices = table
    per_series = assign_ranks(patients, world_size, seed=seed, shards=shards, weights=slices)
    per_slice = assign_ranks(patients.repeat(slices), world_size, seed=seed, shards=shards.repeat(slices))
    assert np.array_equal(per_series.repeat(slices), per_slice)
    chunked = np.minimum(slices, 4)  # slabs: fewer samples per series, weights summing to its slices
    weights = np.concatenate([np.diff(np.r_[np.linspace(0, n, k, endpoint=False).astype(int), n])
                              for n, k in zip(slices.tolist(), chunked.tolist())])
    per_slab = assign_ranks(patients.repeat(chunked), world_size, seed=seed, shards=shards.repeat(chunked),
                            weights=weights)
    assert np.array_equal(per_series.repeat(chunked), per_slab)


@settings(max_examples=60, deadline=None)
@given(patient_arrays.filter(lambda p: p.size > 1), world_sizes, seeds, epochs)
def test_epochs_keep_the_assignment_and_reshuffle_the_order(patients, world_size, seed, epoch):
    first = partition_by_patient(patients, world_size, seed=seed, epoch=epoch)
    later = [partition_by_patient(patients, world_size, seed=seed, epoch=epoch + k) for k in range(1, 11)]
    for other in later:  # a rank keeps its samples (and shards) ...
        assert all(np.array_equal(np.sort(a), np.sort(b)) for a, b in zip(first, other))
    if max(p.size for p in first) > 1:  # ... in a new order: over 40 epochs, as two samples keep theirs
        # with chance 1/2 each epoch (over 10, hypothesis found such a case: 1 in 1024)
        orders = later + [partition_by_patient(patients, world_size, seed=seed, epoch=epoch + k) for k in range(11, 41)]
        assert any(not all(np.array_equal(a, b) for a, b in zip(first, other)) for other in orders)


def test_more_ranks_than_patients_leaves_ranks_empty():
    patients = np.array([7, 7, 3, 3, 3], np.int32)
    parts = partition_by_patient(patients, 5, seed=1, epoch=0)
    _check_partition(patients, parts, 5)
    assert sorted(p.size for p in parts) == [0, 0, 0, 2, 3]
    assert [p.size for p in partition_by_patient(np.zeros(0, np.int32), 3, seed=0, epoch=0)] == [0, 0, 0]


def test_large_sparse_ids_match_dense_ids():
    dense = np.random.default_rng(0).integers(0, 40, 500).astype(np.int32)
    sparse = (dense.astype(np.int64) * 10**12 - 5).astype(np.int64)
    a = partition_by_patient(dense, 3, seed=9, epoch=2, shards=dense % 7)
    b = partition_by_patient(sparse, 3, seed=9, epoch=2, shards=(dense % 7).astype(np.int64) * 10**9)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert np.array_equal(locality_order(sparse, seed=9), locality_order(dense, seed=9).astype(np.int64) * 10**12 - 5)


@pytest.mark.parametrize("bad", [
    dict(patients=np.zeros((2, 2), np.int32)), dict(patients=np.zeros(3)), dict(world_size=0),
    dict(weights=np.array([1.0, -1.0, 1.0])), dict(weights=np.ones(2)), dict(weights=np.array([1.0, np.nan, 1.0])),
    dict(epoch=-1), dict(shards=np.zeros(2, np.int64)), dict(shards=np.zeros(3)),
])
def test_partition_rejects_bad_input(bad):
    args = dict(patients=np.array([0, 1, 1], np.int32), world_size=2, seed=0, epoch=0) | bad
    with pytest.raises(ConfigError):
        partition_by_patient(args.pop("patients"), args.pop("world_size"), **args)


def test_shards_for_rank_reads_records():
    def record(patient: str, shard: str, slices: int) -> SeriesRecord:
        return SeriesRecord(key=patient + shard, shape=(slices, 4, 4), dtype="int16", spacing=(1, 1, 1), affine=(),
                            modality="CT", digest="", orientation=(), positions=(), patient=patient, study="",
                            series="", source_fingerprint="", sources=(), shard=shard)

    records = [record(f"p{i}", f"s{i // 2}", 10) for i in range(8)]  # 4 shards of 2 patients
    assert [shards_for_rank(records, r, 2) for r in range(2)] == [["s0", "s1"], ["s2", "s3"]]
    for cost in ("slices", {r.key: 0.25 for r in records}):  # equal costs however counted: the same cut
        assert [shards_for_rank(records, r, 2, cost=cost) for r in range(2)] == [["s0", "s1"], ["s2", "s3"]]
    slow = {r.key: (3.0 if r.shard == "s0" else 1.0) for r in records}  # measured: s0 reads three times slower
    assert [shards_for_rank(records, r, 2, cost=slow) for r in range(2)] == [["s0"], ["s1", "s2", "s3"]]
    for bad in ("voxels", {records[0].key: 1.0}, {r.key: -1.0 for r in records}):
        with pytest.raises(ConfigError, match="cost"):
            shards_for_rank(records, 0, 2, cost=bad)
    assert shards_for_rank(records, 0, 1) == ["s0", "s1", "s2", "s3"] and shards_for_rank([], 0, 2) == []
    with pytest.raises(ConfigError, match="rank 2"):
        shards_for_rank(records, 2, 2)


# ----------------------------------------------------------------------------------------- the sampler
def _samplers(patients, world_size, even, seed=0, epoch=0, **kwargs):
    out = [DistributedPatientSampler(patients, rank=r, world_size=world_size, seed=seed, even=even, **kwargs)
           for r in range(world_size)]
    for s in out:
        s.set_epoch(epoch)
    return out


@settings(max_examples=40, deadline=None)
@given(patient_arrays.filter(lambda p: p.size > 0), world_sizes, seeds, epochs)
def test_pad_equal_lengths_own_repeats_and_exact_mask(patients, world_size, seed, epoch):
    parts = partition_by_patient(patients, world_size, seed=seed, epoch=epoch)
    if min(p.size for p in parts) == 0:
        with pytest.raises(ConfigError, match="a rank would have none"):
            _samplers(patients, world_size, "pad", seed, epoch)
        return
    longest = max(p.size for p in parts)
    for s, part in zip(_samplers(patients, world_size, "pad", seed, epoch), parts):
        order = np.array(list(s), np.int64)
        assert len(s) == order.size == longest
        assert s.padding.sum() == s.padded == longest - part.size and not s.padding[: part.size].any()
        assert np.array_equal(order[~s.padding], part)  # real samples first, in partition order
        assert np.array_equal(order[s.padding], np.resize(part, s.padded))  # repeats of its own samples


def test_truncate_equal_lengths_and_counts(caplog):
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


def test_pad_warns_on_every_rank_and_exact_split_is_silent(caplog):
    uneven = np.repeat(np.arange(3), [5, 2, 2]).astype(np.int32)  # ranks of 5 and 4
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        samplers = _samplers(uneven, 2, "pad")
    assert sorted(s.padded for s in samplers) == [0, 1]
    assert len([r for r in caplog.records if "padded 1 samples" in r.getMessage()]) == 2
    caplog.clear()
    exact = np.repeat(np.arange(4), 3).astype(np.int32)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for even in ("pad", "truncate", "none"):
            for s in _samplers(exact, 2, even):
                assert len(s) == 6 and s.padded == s.dropped == 0 and not s.padding.any()
    assert not caplog.records


def test_validation_split_visits_each_sample_once_without_padding():
    rng = np.random.default_rng(5)
    patients = np.repeat(np.arange(12), rng.integers(1, 9, 12)).astype(np.int32)
    shards = patients // 3
    val = np.flatnonzero(np.isin(patients, [1, 6, 7]))
    train = np.setdiff1d(np.arange(patients.size), val)
    for world_size in (1, 2, 3, 5):
        evals = _samplers(patients, world_size, "none", shards=shards, indices=val, shuffle=False)
        seen = np.concatenate([np.array(list(s), np.int64) for s in evals])
        assert np.array_equal(np.sort(seen), val) and not any(s.padded for s in evals)
        trains = _samplers(patients, world_size, "none", shards=shards, indices=train)
        whole = partition_by_patient(patients, world_size, seed=0, epoch=0, shards=shards)
        for t, e, part in zip(trains, evals, whole):  # a split keeps the assignment of all samples
            assert set(t) | set(e) == set(part.tolist())


def test_sampler_rejects_bad_input_and_reshuffles():
    patients = np.array([0, 0, 0, 1], np.int32)
    assert sorted(len(s) for s in _samplers(patients, 2, "none")) == [1, 3]
    for even in ("pad", "truncate"):
        with pytest.raises(ConfigError, match="fewer ranks"):
            DistributedPatientSampler(patients, rank=0, world_size=4, even=even)
    with pytest.raises(ConfigError, match="rank 2"):
        DistributedPatientSampler(patients, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="even must be"):
        DistributedPatientSampler(patients, rank=0, world_size=2, even="repeat")
    with pytest.raises(ConfigError, match="indices"):
        DistributedPatientSampler(patients, rank=0, world_size=1, indices=[4])
    with pytest.raises(ConfigError, match="init_process_group"):
        DistributedPatientSampler(patients)
    s = DistributedPatientSampler(np.repeat(np.arange(20), 5).astype(np.int32), rank=1, world_size=4, seed=3)
    first = list(s)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == sorted(first)

"""Distributed training by patient, preferring local shards: which rank reads which patients.

One rule, :func:`assign_ranks`, decides both ``medload cache warm --rank R --world W`` (which shards a
rank copies to its local SSD) and :class:`DistributedPatientSampler` (which samples it trains on), so
the two agree by construction. The rule sees only each patient's *cost* (bytes, slices, samples or
measured seconds) per shard, so it gives the same answer whether it is fed one entry per series or one
per sample:

1. A patient's *home shard* is the shard holding most of its cost (ties: the first shard in order).
2. Patients are laid out in one sequence: by home shard (in shard order; shard names sort by creation
   time), and within a shard in an order drawn from ``seed``.
3. The sequence is cut into ``world_size`` runs of near-equal cost: a patient goes to rank
   ``floor(world_size * m / total)``, where ``m`` is the midpoint of its cost along the sequence. A rank
   then reads about ``shards / world_size + 1`` shards (a shard is shared only where a cut falls in it).
4. The cut is within one patient of equal, which on a skewed archive (a few huge patients) is far from
   it. While two ranks' costs differ by more than 1% of an equal share (``total / world_size``), the
   pair with the widest such gap that can narrow it exchanges one patient (a move, or a swap with one
   of the lighter rank's): the exchange that brings their costs closest to equal; among equally good exchanges, a patient whose home shard
   the lighter rank already reads goes first. Each exchange narrows a gap without widening the overall
   spread, and the cut's locality is given up only patient by patient, where balance needs it.

So a patient is never on two ranks, and two ranks' costs differ by at most 1% of an equal share, or
else by at most the lightest (non-zero) patient of the heavier rank, which no exchange could move
without widening the gap (step 4 is capped at four exchanges per patient, far more than it takes).
Exact balance is out of reach only when single patients are heavy compared with a share (one patient
costing more than ``total / world_size`` leaves its rank heavier whatever the partition); the rule then
logs a warning with the figures. The
assignment does not depend on the epoch: a rank keeps its shards for the whole run, which is what makes
copying them worthwhile; every epoch reshuffles the order *within* each rank instead.

Examples:
    >>> import numpy as np
    >>> assign_ranks(np.array([0, 0, 1, 2, 2, 3]), 2, seed=0, shards=np.array([0, 0, 0, 1, 1, 1])).tolist()
    [0, 0, 0, 1, 1, 1]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed as dist

from medload.data.elastic import ElasticEpoch
from medload.data.loader_types import LoaderDataset
from medload.data.samplers import _group, _ids, _index_of, _int, _rng, _stable_argsort
from medload.errors import ConfigError
from medload.storage.records import SeriesRecord

#: what balances the ranks: "bytes" stored, "slices", or measured read seconds per series key
Cost = str | Mapping[str, float]

__all__ = ["assign_ranks", "locality_order", "partition_by_patient", "shards_for_rank", "sample_layout",
           "DistributedPatientSampler"]

log = logging.getLogger(__name__)

_EVEN = ("pad", "truncate", "none")
_ORDER_STREAM = 6  # rng stream of the within-shard patient order (independent of the epoch)
_TOLERANCE = 0.01  # step 4 stops once ranks' costs differ by at most this fraction of an equal share
_STEPS_PER_PATIENT = 4  # cap on step 4's exchanges (it ends well before: each one lowers a sum of squares)


def _loads(weights: npt.ArrayLike | None, shape: tuple[int, ...]) -> np.ndarray:
    """Per-unit loads: ones, or ``weights`` checked (int64 when integer, so sums and cuts are exact)."""
    if weights is None:
        return np.ones(shape, np.int64)
    w = np.asarray(weights)
    if w.shape != shape or w.dtype.kind not in "biuf" or (w.dtype.kind == "f" and not np.all(np.isfinite(w))) \
            or np.any(w < 0):
        raise ConfigError(f"weights must be finite, non-negative, one per sample ({shape[0]}); got shape {w.shape}, "
                          f"dtype {w.dtype}")
    return w.astype(np.float64 if w.dtype.kind == "f" else np.int64)


def _patient_loads(patients: npt.ArrayLike, shards: npt.ArrayLike | None, weights: npt.ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(unique patient ids, dense patient per unit, home shard per patient, load per patient)."""
    ids = _ids("patients", patients, allow_empty=True)
    w = _loads(weights, ids.shape)
    patient, _ = _group(ids)
    if shards is None:
        shard = np.zeros(ids.size, np.int64)
    else:
        shard = _group(_ids("shards", shards, allow_empty=True))[0]
        if shard.size != ids.size:
            raise ConfigError(f"shards must have one entry per sample ({ids.size}), got {shard.size}")
    n_shards = int(shard.max()) + 1 if shard.size else 1
    pair = patient * n_shards + shard
    inverse, counts = _group(pair)
    pairs = np.zeros(counts.size, np.int64)
    pairs[inverse] = pair  # the (patient, shard) key of each dense pair number, ascending
    pair_load = np.bincount(inverse, weights=w, minlength=pairs.size).astype(w.dtype)
    pair_patient, pair_shard = pairs // n_shards, pairs % n_shards
    best = np.lexsort((pair_shard, -pair_load, pair_patient))  # per patient: heaviest shard, then lowest
    first = best[np.r_[True, pair_patient[best][1:] != pair_patient[best][:-1]]] if pairs.size else best
    load = np.bincount(pair_patient, weights=pair_load, minlength=first.size).astype(w.dtype)
    unique = np.empty(first.size, ids.dtype)
    unique[patient] = ids  # the id of each dense patient number
    return unique, patient, pair_shard[first], load


def _sequence(home: np.ndarray, seed: int) -> np.ndarray:
    """Dense patient numbers in rule order: home shard, then an order drawn from ``seed``."""
    return np.lexsort((_rng(seed, 0, _ORDER_STREAM).permutation(home.size), home))


def locality_order(patients: npt.ArrayLike, *, seed: int, shards: npt.ArrayLike | None = None,
                   weights: npt.ArrayLike | None = None) -> np.ndarray:
    """The patient ids (as given) in the order the rule lays them out: by home shard, then seeded.

    Taking every k-th patient of it gives a hold-out set spread evenly over shards and ranks.
    """
    seed = _int("seed", seed)
    unique, _, home, _ = _patient_loads(patients, shards, weights)
    return unique[_sequence(home, seed)]


def _cut(load: np.ndarray, order: np.ndarray, world_size: int) -> np.ndarray:
    """Rank per dense patient: ``order`` cut into ``world_size`` runs of near-equal load (step 3)."""
    total = load.sum()
    rank_of = np.zeros(load.size, np.int64)
    if total > 0:
        before = np.cumsum(load[order]) - load[order]
        midpoint2 = 2 * before + load[order]  # twice the midpoint: integer loads stay integers
        rank_of[order] = np.minimum(world_size * midpoint2 // (2 * total), world_size - 1).astype(np.int64)
    return rank_of


def _exchange(load: np.ndarray, home: np.ndarray, heavy: np.ndarray, light: np.ndarray, gap: float) -> tuple | None:
    """The best exchange between a heavier and a lighter rank (their patients ``heavy``/``light``, loads
    ``gap`` apart): (patient to move, patient to move back or -1, load moved), or None when none narrows
    the gap. It moves ``d`` with ``0 < d < gap`` closest to ``gap / 2``; ties: home shard read there, then
    lowest patient numbers."""
    back = light[np.argsort(load[light], kind="stable")]
    back_load = np.r_[load.dtype.type(0), load[back]]  # 0: a plain move, nothing comes back
    out = load[heavy]
    # the valid loads to take back, (out - gap, out), are centred on out - gap / 2: the nearest is valid if any is
    target = out - gap / 2
    above = np.minimum(np.searchsorted(back_load, target), back_load.size - 1)
    below = np.maximum(above - 1, 0)
    j = np.where(np.abs(target - back_load[below]) <= np.abs(back_load[above] - target), below, above)
    moved = out - back_load[j]
    if not ((moved > 0) & (moved < gap)).any():
        return None
    miss = np.where((moved > 0) & (moved < gap), np.abs(2 * moved - gap), np.inf)
    best = np.lexsort((~np.isin(home[heavy], home[light]), miss))[0]
    return int(heavy[best]), (int(back[j[best] - 1]) if j[best] else -1), moved[best]


def _refine(load: np.ndarray, home: np.ndarray, rank_of: np.ndarray, world_size: int) -> np.ndarray:
    """``rank_of`` after the exchanges of step 4 (in place). Each exchange strictly lowers the sum of
    squared rank loads, so the loop ends; the step cap only bounds its time."""
    rank_load = np.zeros(world_size, load.dtype)
    np.add.at(rank_load, rank_of, load)
    slack = _TOLERANCE * load.sum() / world_size
    for _ in range(_STEPS_PER_PATIENT * load.size):
        gaps = rank_load[:, None] - rank_load[None, :]
        heavier, lighter = np.nonzero(gaps > slack)
        by_rank = np.split(np.argsort(rank_of, kind="stable"), np.cumsum(np.bincount(rank_of, minlength=world_size))[:-1])
        for k in np.lexsort((lighter, heavier, -gaps[heavier, lighter])):  # widest gap first
            a, b = int(heavier[k]), int(lighter[k])
            step = _exchange(load, home, by_rank[a], by_rank[b], gaps[a, b])
            if step is not None:
                break
        else:
            break
        p, q, moved = step
        rank_of[p] = b
        if q >= 0:
            rank_of[q] = a
        rank_load[a] -= moved
        rank_load[b] += moved
    return rank_of


def _warn_if_unbalanced(load: np.ndarray, rank_of: np.ndarray, world_size: int) -> None:
    """Says why when the ranks' costs still differ by more than the tolerance: a warning where one patient
    costs more than an equal share (no partition can balance then), else an info line (a lumpy archive)."""
    total = load.sum()
    rank_load = np.bincount(rank_of, weights=load, minlength=world_size)
    share = total / world_size
    spread = rank_load.max() - rank_load.min()
    if total > 0 and spread > _TOLERANCE * share:
        log.log(logging.WARNING if load.max() > share else logging.INFO,
                "ranks' costs differ by %.1f%% of an equal share (min %.4g, max %.4g, share %.4g): a patient is "
                "never split over ranks and the heaviest one alone costs %.0f%% of a share, which bounds the "
                "balance; fewer ranks (or more patients) balance better", 100 * spread / share, rank_load.min(),
                rank_load.max(), share, 100 * load.max() / share)


def assign_ranks(patients: npt.ArrayLike, world_size: int, *, seed: int, shards: npt.ArrayLike | None = None,
                 weights: npt.ArrayLike | None = None) -> np.ndarray:
    """The rank of each entry (a sample or a series): the rule of this module's docstring; pure.

    Args:
        patients: integer patient id per entry.
        world_size: number of ranks.
        seed: shared by all ranks (and by ``medload cache warm --seed``).
        shards: integer shard id per entry (ids sort in shard order); None: one shard.
        weights: non-negative cost per entry (integers are summed and cut exactly, so give integer costs
            where series-level and sample-level calls must agree); None: one per entry.

    Returns:
        int64 rank per entry.

    Examples:
        >>> costs = np.array([100, 30, 30, 40])             # patient 0 alone is half the cost
        >>> assign_ranks(np.arange(4), 2, seed=0, weights=costs).tolist()
        [1, 0, 0, 0]
    """
    world_size = _int("world_size", world_size, low=1)
    seed = _int("seed", seed)
    _, patient, home, load = _patient_loads(patients, shards, weights)
    rank_of = _refine(load, home, _cut(load, _sequence(home, seed), world_size), world_size)
    _warn_if_unbalanced(load, rank_of, world_size)
    return rank_of[patient]


def _shuffled(indices: np.ndarray, seed: int, epoch: int, rank: int) -> np.ndarray:
    """``indices`` in this rank's order for ``epoch`` (in place)."""
    _rng(seed, epoch, 5, rank).shuffle(indices)
    return indices


def partition_by_patient(patients: npt.ArrayLike, world_size: int, *, seed: int, epoch: int,
                         shards: npt.ArrayLike | None = None,
                         weights: npt.ArrayLike | None = None) -> list[np.ndarray]:
    """The sample indices each rank owns (:func:`assign_ranks`), each in a seeded order of ``epoch``.

    A rank without patients (more ranks than patients) gets an empty array.

    Returns:
        ``world_size`` int64 arrays of sample indices, one per rank.
    """
    epoch = _int("epoch", epoch, low=0)
    sample_rank = assign_ranks(patients, world_size, seed=seed, shards=shards, weights=weights)
    world_size, seed = int(world_size), int(seed)
    grouped = _stable_argsort(sample_rank, world_size)  # by rank, then by index
    parts = np.split(grouped, np.cumsum(np.bincount(sample_rank, minlength=world_size))[:-1])
    return [_shuffled(part, seed, epoch, rank) for rank, part in enumerate(parts)]


def _record_layout(records: Sequence[SeriesRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(patient, shard, slices) per series, as integer arrays (ids in sorted pseudonym/shard-name order)."""
    patients = np.unique([r.patient for r in records], return_inverse=True)[1].reshape(-1)
    shards = np.unique([r.shard for r in records], return_inverse=True)[1].reshape(-1)
    return patients, shards, np.array([r.shape[0] for r in records], np.int64)


def _series_costs(records: Sequence[SeriesRecord], cost: Cost) -> np.ndarray:
    """Integer cost per series: ``"bytes"`` stored (slices x rows x columns x bytes per voxel), ``"slices"``,
    or a mapping of series key to measured read seconds (counted in whole nanoseconds). Integers keep
    every caller's sums exact, so series-level and sample-level calls cut alike."""
    if isinstance(cost, Mapping):
        missing = [r.key for r in records if r.key not in cost]
        if missing:
            raise ConfigError(f"cost has no value for {len(missing)} series (e.g. {missing[0]}): measure every series "
                              "of the dataset, or pass cost='bytes'")
        seconds = np.array([cost[r.key] for r in records], np.float64)
        if not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
            raise ConfigError("cost must map each series key to finite, non-negative seconds")
        return np.round(seconds * 1e9).astype(np.int64)
    if cost == "slices":
        return np.array([r.shape[0] for r in records], np.int64)
    if cost == "bytes":
        return np.array([int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in records], np.int64)
    raise ConfigError(f"cost must be 'bytes', 'slices' or a mapping of series key to seconds; got {cost!r}")


def shards_for_rank(records: Sequence[SeriesRecord], rank: int, world_size: int, *, seed: int = 0,
                    cost: Cost = "bytes") -> list[str]:
    """Names of the shards rank ``rank`` of ``world_size`` reads, for a dataset of these series (``cost`` as
    in :meth:`DistributedPatientSampler.from_dataset`, which must get the same one).

    Examples:
        >>> shards_for_rank(medload.open_store("stores/ct").series(), rank=0, world_size=8, seed=1)  # doctest: +SKIP
        ['20261130T190455-1a2b3c4d', '20261130T190502-9f8e7d6c']
    """
    rank, world_size = _check_rank(rank, world_size)
    if not records:
        return []
    patients, shards, _ = _record_layout(records)
    mine = assign_ranks(patients, world_size, seed=seed, shards=shards, weights=_series_costs(records, cost)) == rank
    return sorted({r.shard for r, m in zip(records, mine.tolist()) if m})


def sample_layout(dataset: LoaderDataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(patient, shard, slices) per sample of a :class:`SliceDataset`/:class:`SlabDataset`.

    ``slices`` counts the slices each sample is the first to cover, so a series' samples sum to its
    stored slices (one per sample for 2.5D) and the rule sees the same loads as :func:`shards_for_rank`.
    """
    series, z = dataset.index.series, dataset.index.z.astype(np.int64)
    _, shard_of_series, depth = _record_layout(dataset.records)
    same = np.r_[series[1:] == series[:-1], False]
    slices = np.where(same, np.r_[z[1:], 0] - z, depth[series] - z)
    return dataset.index.patients, shard_of_series[series], slices


def _check_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``; None takes the value of the initialised default process group."""
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("pass rank= and world_size=, or call torch.distributed.init_process_group first")
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    world_size = _int("world_size", world_size, low=1)
    rank = _int("rank", rank, low=0)
    if rank >= world_size:
        raise ConfigError(f"rank {rank} is outside world_size {world_size}: ranks are 0..{world_size - 1}")
    return rank, world_size


class DistributedPatientSampler(ElasticEpoch):
    """This rank's samples under :func:`assign_ranks`, as torch's ``DistributedSampler`` gives them.

    ``indices`` restricts the sampler to some samples (a training or validation split) while the
    assignment stays that of all samples, so every split of a rank reads the same shards. Lengths:
    ``even="pad"`` (training) appends repeats of this rank's own first samples up to the longest rank,
    so every rank runs the same number of steps; ``padding`` marks them and ``padded`` counts them.
    ``even="truncate"`` cuts every rank to the shortest (``dropped`` counts this rank's loss). Both log a
    warning once per epoch on every rank when they pad or drop, and raise ConfigError (on every rank
    alike) when a rank would have no sample. ``even="none"`` (validation) keeps unequal lengths: every
    sample is visited exactly once over the ranks, so sums and counts all-reduced give exact metrics.

    Args:
        patients: integer patient id per sample (e.g. ``dataset.index.patients``).
        rank, world_size: None takes them from the initialised default process group.
        seed: shared by all ranks; the assignment depends on it, the order also on the epoch.
        shards, weights: per sample, as in :func:`assign_ranks`.
        indices: the samples to visit (None: all).
        shuffle: a new order every epoch (False: ascending sample index).
        even: ``"pad"``, ``"truncate"`` or ``"none"``.

    Examples:
        >>> sampler = DistributedPatientSampler.from_dataset(dataset, rank=0, world_size=2, seed=7)  # doctest: +SKIP
        >>> loader = make_loader(dataset, batch_size=8, sampler=sampler); sampler.set_epoch(1)      # doctest: +SKIP
    """

    def __init__(self, patients: npt.ArrayLike, *, rank: int | None = None, world_size: int | None = None,
                 seed: int = 0, shards: npt.ArrayLike | None = None, weights: npt.ArrayLike | None = None,
                 indices: npt.ArrayLike | None = None, shuffle: bool = True, even: str = "pad") -> None:
        self.rank, self.world_size = _check_rank(rank, world_size)
        if even not in _EVEN:
            raise ConfigError(f"even must be one of {', '.join(_EVEN)}; got {even!r}")
        self.seed, self.shuffle, self.even = _int("seed", seed), bool(shuffle), even
        self._ids, self._shards, self._weights = _ids("patients", patients), shards, weights
        self._keep: np.ndarray | None = None
        if indices is not None:
            chosen = np.unique(np.asarray(indices, dtype=np.int64))
            if chosen.size and (chosen[0] < 0 or chosen[-1] >= self._ids.size):
                raise ConfigError(f"indices must be sample positions in 0..{self._ids.size - 1}")
            self._keep = np.zeros(self._ids.size, bool)
            self._keep[chosen] = True
        self._owners: dict[int, np.ndarray] = {}
        owner = self._owner(self.world_size)
        self.lengths = np.bincount(owner[owner >= 0], minlength=self.world_size)
        if even != "none" and self.lengths.min() == 0:
            raise ConfigError(f"samples per rank {self.lengths.tolist()}: a rank would have none to "
                              f"{'repeat' if even == 'pad' else 'keep'}; use fewer ranks (or more patients), "
                              "or even='none' where ranks may run different numbers of steps")
        self._seen: np.ndarray | None = None  # samples of this epoch consumed before the world size changed
        self._segments: list[list[int]] = []  # [world size, positions] of this epoch's earlier world sizes
        self._planned: tuple | None = None

    def _owner(self, world_size: int) -> np.ndarray:
        """The rank of every sample among ``world_size`` ranks (-1: outside ``indices``), computed once."""
        if world_size not in self._owners:
            owner = assign_ranks(self._ids, world_size, seed=self.seed, shards=self._shards, weights=self._weights)
            self._owners[world_size] = owner if self._keep is None else np.where(self._keep, owner, -1)
        return self._owners[world_size]

    @classmethod
    def from_dataset(cls, dataset: LoaderDataset, indices: npt.ArrayLike | None = None, *, cost: Cost = "bytes",
                     **kwargs: Any) -> DistributedPatientSampler:
        """The sampler for a :class:`SliceDataset`/:class:`SlabDataset`: by patient, ranks balanced by
        ``cost``, preferring the shards ``medload cache warm --rank R --world W --seed S`` copied (same
        ``seed``; the command balances stored bytes, the default here).

        ``cost``: ``"bytes"`` (stored bytes: what a rank reads), ``"slices"``, or a mapping of series key
        to measured read seconds (e.g. from a timed pass over the store). A series' cost is spread over
        its samples in proportion to the slices each one is first to cover.
        """
        _index_of(dataset, cls.__name__)
        patients, shards, slices = sample_layout(dataset)
        series, start = dataset.index.series, dataset.index.z.astype(np.int64)
        per_series = _series_costs(dataset.records, cost)[series]
        depth = np.array([r.shape[0] for r in dataset.records], np.int64)[series]
        weights = per_series * (start + slices) // depth - per_series * start // depth  # sums to each series' cost
        return cls(patients, shards=shards, weights=weights, indices=indices, **kwargs)

    @property
    def padding(self) -> np.ndarray:
        """Bool per position of this epoch's order: True where the sample is a padding repeat."""
        return self._plan()[1]

    @property
    def padded(self) -> int:
        """How many positions of this epoch's order are padding repeats (``even="pad"``)."""
        return int(self._plan()[1].sum())

    @property
    def dropped(self) -> int:
        """How many of this rank's samples this epoch cuts (``even="truncate"``)."""
        return self._plan()[2]

    def set_epoch(self, epoch: int) -> None:
        if _int("epoch", epoch, low=0) != self.epoch:
            self._seen, self._segments, self._planned = None, [], None
        super().set_epoch(epoch)

    def _plan(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(order, padding mask, dropped) for the current epoch, computed once per epoch."""
        if self._planned is None or self._planned[0] != self.epoch:
            self._planned = (self.epoch, *self.plan_for(self.rank, self.world_size, self._seen, warn=True))
        return self._planned[1:]

    def plan_for(self, rank: int, world_size: int, seen: np.ndarray | None = None, *,
                 warn: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
        """(order, padding mask, dropped) of rank ``rank`` of ``world_size`` this epoch; with ``seen`` (a bool
        per sample: consumed before the world size changed) the rest of the epoch: each sample not seen on
        the rank the assignment among ``world_size`` ranks gives its patient, so every sample comes once
        and the ranks read the shards ``medload cache warm --world`` copied for them."""
        owner = self._owner(world_size)
        live = owner >= 0 if seen is None else (owner >= 0) & ~seen
        lengths = np.bincount(owner[live], minlength=world_size)
        mine = np.flatnonzero(live & (owner == rank))
        if self.shuffle:
            _shuffled(mine, self.seed, self.epoch, rank)
        padded, dropped = 0, 0
        if self.even == "pad":
            padded = int(lengths.max()) - mine.size
            # repeats of this rank's own samples: of the rest of the epoch, or (none left) of its share
            source = mine if mine.size or not padded else _shuffled(np.flatnonzero(owner == rank), self.seed,
                                                                      self.epoch, rank)
            order = np.concatenate([mine, np.resize(source, padded)])
            if warn and lengths.min() < lengths.max():
                log.warning("epoch %d: padded %d samples over %d ranks to %d per rank (this rank %d: %d repeats); "
                            "skip them with sampler.padding in metrics, or use even='truncate'", self.epoch,
                            int((lengths.max() - lengths).sum()), world_size, int(lengths.max()), rank, padded)
        elif self.even == "truncate":
            dropped = mine.size - int(lengths.min())
            order = mine[: int(lengths.min())]
            if warn and lengths.max() > lengths.min():
                log.warning("epoch %d: dropped %d of %d samples to cut %d ranks to %d each (this rank %d: %d); "
                            "use even='pad' to keep them", self.epoch, int((lengths - lengths.min()).sum()),
                            int(lengths.sum()), world_size, int(lengths.min()), rank, dropped)
        else:
            order = mine
        padding = np.zeros(order.size, bool)
        padding[order.size - padded:] = True
        return order, padding, dropped

    def _indices(self) -> np.ndarray:
        return self._plan()[0]

    def __len__(self) -> int:
        return int(self._plan()[0].size)

"""Samplers: which dataset indices a training epoch visits, and in what order.

A dataset describes its samples with numpy arrays, one entry per sample: ``series`` (int32), ``patients``
(int32) and ``foreground`` (bool, from the per-slice foreground counts stored at ingest). Every sampler is a
``torch.utils.data.Sampler`` that yields ``int`` indices, is deterministic in ``(seed, epoch)`` and draws a
new order after ``set_epoch(epoch)`` (as with torch's ``DistributedSampler``, iterating twice without
``set_epoch`` repeats the order). Orders are built with vectorised numpy, so 10M samples take a fraction of
a second.

Every sampler has ``from_dataset(dataset, **kwargs)``, which takes those arrays from a
:class:`~medload.data.SliceDataset`/:class:`~medload.data.SlabDataset`; the constructors take the arrays
themselves (for any dataset). Distributed training splits samples by *patient*, preferring local shards:
:mod:`medload.data.distributed`; its sampler shares the helpers here. A sampler decides order, not batch
composition: where a dataset mixes matrix sizes, :mod:`medload.data.buckets` groups its order into batches of
one size.

Examples:
    >>> import numpy as np
    >>> sorted(SeriesGroupedSampler(np.array([0, 0, 1]), seed=0))
    [0, 1, 2]
    >>> sampler = ForegroundSampler.from_dataset(SliceDataset(store), p=0.5)  # half the draws from foreground
    >>> len(list(sampler)) == len(SliceDataset(store))
    True
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from torch.utils.data import Sampler

from medload.data.state_version import checked, stamp
from medload.errors import ConfigError

if TYPE_CHECKING:
    from medload.data.index import SampleIndex

__all__ = ["UniformSampler", "EpochShuffle", "ForegroundSampler", "SeriesGroupedSampler"]

_CHUNK = 1 << 16  # indices converted to Python ints per step while iterating


# ----------------------------------------------------------------------------------------------- helpers
def _int(name: str, value: Any, *, low: int | None = None) -> int:
    """``value`` as an int (at least ``low``), or a ConfigError naming the argument."""
    try:
        out = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if low is not None and out < low:
        raise ConfigError(f"{name} must be >= {low}, got {out}")
    return out


def _rng(seed: int, epoch: int, *stream: int) -> np.random.Generator:
    """The generator for one (seed, epoch); ``stream`` keeps independent draws apart."""
    return np.random.default_rng([seed % 2**64, epoch % 2**64, *stream])


def _ids(name: str, values: npt.ArrayLike, *, allow_empty: bool = False) -> np.ndarray:
    """A 1-D integer array of per-sample ids (series or patient), validated."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be a 1-D array with one entry per sample, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ConfigError(f"{name} must hold integer ids, got dtype {arr.dtype}: map other ids to integers "
                          f"with np.unique({name}, return_inverse=True)[1]")
    if not allow_empty and arr.size == 0:
        raise ConfigError(f"{name} is empty: the dataset has no samples (check the store holds series)")
    return arr


def _group(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense group number per sample (0..G-1 in sorted id order) and the number of samples per group."""
    if ids.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi <= 4 * ids.size + 65536:  # small non-negative ids: O(n) counting, no sort
        counts = np.bincount(ids.astype(np.intp, copy=False))
        present = counts > 0
        remap = np.cumsum(present) - 1
        return remap[ids], counts[present]
    _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    return inverse.reshape(-1), counts


def _stable_argsort(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Stable argsort of small non-negative integer keys (radix sort when they fit 16 bits)."""
    return np.argsort(keys.astype(np.uint16 if n_keys <= 65536 else np.int64), kind="stable")


def _index_of(dataset: object, sampler: str) -> SampleIndex:
    """The :class:`~medload.data.index.SampleIndex` of a SliceDataset/SlabDataset, or a ConfigError saying
    what ``from_dataset`` takes instead."""
    index = getattr(dataset, "index", None)
    if index is None or not hasattr(index, "series"):
        raise ConfigError(f"{sampler}.from_dataset takes a SliceDataset or SlabDataset, got {type(dataset).__name__}: "
                          f"for other datasets build {sampler}(...) from per-sample arrays")
    return index


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    offsets = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) + np.repeat(starts - offsets, lengths)


class _EpochSampler(Sampler[int]):
    """Shared ``set_epoch``/``__iter__``/``__len__`` and the state: subclasses build ``_indices()`` for
    ``self.epoch``.

    ``state_dict()`` is ``{"version", "sampler", "seed", "epoch", "position"}``: ``position`` counts the
    indices of this epoch's order already yielded (or, after ``load_state_dict``, to skip at the start of
    the next iteration). A DataLoader draws indices ahead of the batches its caller has taken, so behind
    one use the loader's state (:mod:`medload.data.loader_state`), which counts what was consumed."""

    seed: int
    epoch: int = 0
    position: int = 0  # indices of this epoch's order yielded
    _start: int = 0  # where the next iteration starts: 0, or a restored position

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (deterministic in ``(seed, epoch)``) from the next iteration on."""
        epoch = _int("epoch", epoch, low=0)
        if epoch != self.epoch:
            self.position = self._start = 0
        self.epoch = epoch

    def _resume_at(self, position: int) -> None:
        """Start the next iteration at ``position`` of this epoch's order (once; later ones from its start)."""
        self.position = self._start = _int("position", position, low=0)

    def _indices(self) -> np.ndarray:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        indices, start = self._indices(), self._start
        self.position, self._start = start, 0
        for chunk in range(start - start % _CHUNK, indices.size, _CHUNK):  # Python ints, a chunk at a time
            for i in indices[max(chunk, start):chunk + _CHUNK].tolist():
                self.position += 1
                yield i

    def state_dict(self) -> dict[str, Any]:
        """Seeds and counters that restore this sampler mid-epoch (see the class docstring)."""
        return stamp({"sampler": type(self).__name__, "seed": self.seed, "epoch": self.epoch,
                      "position": self.position})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` (from :meth:`state_dict`) left off: its epoch, from its position."""
        state = checked(state, "sampler", type(self).__name__)
        if state["seed"] != self.seed:
            raise ConfigError(f"the state is of a {state['sampler']} seeded {state['seed']}, this one is seeded "
                              f"{self.seed}: build the sampler with seed={state['seed']} to resume that run")
        self.epoch = _int("epoch", state["epoch"], low=0)
        self._resume_at(state["position"])


# ---------------------------------------------------------------------------------------------- samplers
class UniformSampler(_EpochSampler):
    """A seeded random order of ``range(n)``, new every epoch.

    Without replacement each index appears once per epoch; a ``num_samples`` above ``n`` chains further
    permutations (as torch's ``RandomSampler`` does). With replacement indices are drawn independently.
    """

    def __init__(self, n: int, *, seed: int = 0, num_samples: int | None = None, replacement: bool = False):
        self.n = _int("n", n, low=1)
        self.seed = _int("seed", seed)
        self.num_samples = self.n if num_samples is None else _int("num_samples", num_samples, low=1)
        self.replacement = bool(replacement)

    @classmethod
    def from_dataset(cls, dataset: Any, **kwargs: Any) -> UniformSampler:
        """The sampler over every sample of a SliceDataset/SlabDataset (``kwargs`` as the constructor's)."""
        return cls(len(_index_of(dataset, cls.__name__)), **kwargs)

    def _indices(self) -> np.ndarray:
        rng = _rng(self.seed, self.epoch, 1)
        if self.replacement:
            return rng.integers(0, self.n, self.num_samples)
        rounds = -(-self.num_samples // self.n)
        return np.concatenate([rng.permutation(self.n) for _ in range(rounds)])[: self.num_samples]

    def __len__(self) -> int:
        return self.num_samples


class EpochShuffle(UniformSampler):
    """The order of ``make_loader(shuffle=True, seed=...)``: a :class:`UniformSampler` whose epoch also
    advances by itself when it is iterated anew without ``set_epoch`` -- a new order every pass, as torch's
    ``RandomSampler`` gives -- so that a plain loop reshuffles and its state still names the epoch."""

    def __init__(self, n: int, *, seed: int = 0) -> None:
        super().__init__(n, seed=seed)
        self._given = True  # the epoch of the next pass is decided: set_epoch, a restored state, or the first

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._given = True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._given = True

    def __iter__(self) -> Iterator[int]:
        if not self._given and self._start == 0:
            self.epoch += 1
        self._given = False
        yield from super().__iter__()


class ForegroundSampler(_EpochSampler):
    """nnU-Net style oversampling: each draw is, with probability ``p``, a sample whose label has foreground,
    otherwise a uniform draw from all samples (so the foreground fraction is ``p + (1 - p) * base_rate``).

    ``foreground`` is a bool per sample (integer foreground counts are accepted: non-zero means foreground).
    Draws are with replacement; ``num_samples`` defaults to the number of samples.
    """

    def __init__(self, foreground: np.ndarray, *, p: float = 0.33, num_samples: int | None = None,
                 seed: int = 0):
        fg = np.asarray(foreground)
        if fg.ndim != 1 or fg.dtype.kind not in "biu":
            raise ConfigError(f"foreground must be a 1-D bool array, one entry per sample; got shape "
                              f"{fg.shape}, dtype {fg.dtype}")
        if fg.size == 0:
            raise ConfigError("foreground is empty: the dataset has no samples (check the store holds series)")
        if not isinstance(p, (int, float, np.number)) or not 0.0 <= float(p) <= 1.0:
            raise ConfigError(f"p is a probability: pass a value in [0, 1], got {p!r}")
        self.p = float(p)
        self.foreground_indices = np.flatnonzero(fg)
        if self.p > 0 and self.foreground_indices.size == 0:
            raise ConfigError(f"no sample has foreground (all {fg.size} labels are empty), so p={self.p} cannot "
                              "be met: check labels were ingested (medload ingest --labels ...) or pass p=0")
        self.n = int(fg.size)
        self.seed = _int("seed", seed)
        self.num_samples = self.n if num_samples is None else _int("num_samples", num_samples, low=1)

    @classmethod
    def from_dataset(cls, dataset: Any, **kwargs: Any) -> ForegroundSampler:
        """The sampler over a SliceDataset/SlabDataset with labels, drawing on its ``dataset.foreground``."""
        _index_of(dataset, cls.__name__)
        if dataset.foreground is None:
            raise ConfigError("ForegroundSampler needs labels and this dataset has none: ingest them "
                              "(medload ingest --labels ...) and pass labels=True, or use UniformSampler")
        return cls(dataset.foreground, **kwargs)

    @property
    def base_rate(self) -> float:
        """Fraction of samples that have foreground."""
        return self.foreground_indices.size / self.n

    def _indices(self) -> np.ndarray:
        rng = _rng(self.seed, self.epoch, 2)
        out = rng.integers(0, self.n, self.num_samples)
        forced = rng.random(self.num_samples) < self.p
        picks = rng.integers(0, max(self.foreground_indices.size, 1), int(forced.sum()))
        out[forced] = self.foreground_indices[picks]
        return out

    def __len__(self) -> int:
        return self.num_samples


class SeriesGroupedSampler(_EpochSampler):
    """Every index once per epoch, one series at a time, for cache locality.

    Series come in a shuffled order (``shuffle=False``: order of first appearance). Within a series, samples
    (in index order) are cut into blocks of ``block`` consecutive samples (``None``: the whole series is one
    block) and the blocks are shuffled; a block's samples stay consecutive and in order.
    """

    def __init__(self, series: np.ndarray, *, seed: int = 0, shuffle: bool = True, block: int | None = None):
        ids = _ids("series", series)
        self.seed = _int("seed", seed)
        self.shuffle = bool(shuffle)
        self.block = None if block is None else _int("block", block, low=1)
        self.n = int(ids.size)
        starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1])
        if starts.size <= max(65536, self.n // 8) and np.unique(ids[starts]).size == starts.size:
            # each series is one contiguous run (the usual layout): no sort needed
            self._members = None
            sizes = np.diff(np.append(starts, self.n))
        else:
            inverse, counts = _group(ids)
            order = _stable_argsort(inverse, counts.size)
            sorted_starts = np.cumsum(counts) - counts
            by_first = np.argsort(order[sorted_starts])  # series in order of first appearance
            self._members = order[_concat_ranges(sorted_starts[by_first], counts[by_first])]
            sizes = counts[by_first]
            starts = np.cumsum(sizes) - sizes
        self.n_series = int(sizes.size)
        per = np.ones_like(sizes) if self.block is None else -(-sizes // self.block)  # blocks per series
        self._first_block = np.cumsum(per) - per
        self._n_blocks = per
        block_series = np.repeat(np.arange(self.n_series), per)
        step = sizes[block_series] if self.block is None else self.block
        within = np.arange(block_series.size) - self._first_block[block_series]
        self._block_start = starts[block_series] + within * step
        self._block_len = np.minimum(self._block_start + step, (starts + sizes)[block_series]) - self._block_start

    @classmethod
    def from_dataset(cls, dataset: Any, **kwargs: Any) -> SeriesGroupedSampler:
        """The sampler over a SliceDataset/SlabDataset, grouped by its ``dataset.index.series``."""
        return cls(_index_of(dataset, cls.__name__).series, **kwargs)

    def _indices(self) -> np.ndarray:
        blocks = np.arange(self._block_start.size)
        if self.shuffle:
            rng = _rng(self.seed, self.epoch, 3)
            several = np.flatnonzero(self._n_blocks > 1)  # shuffle blocks within each series, in place
            lows = self._first_block[several]
            for lo, hi in zip(lows.tolist(), (lows + self._n_blocks[several]).tolist()):
                rng.shuffle(blocks[lo:hi])
            order = rng.permutation(self.n_series)
            blocks = blocks[_concat_ranges(self._first_block[order], self._n_blocks[order])]
        if self.block == 1:
            positions = self._block_start[blocks]
        else:
            positions = _concat_ranges(self._block_start[blocks], self._block_len[blocks])
        return positions if self._members is None else self._members[positions]

    def __len__(self) -> int:
        return self.n

"""Shape buckets: batches of one matrix size from a dataset that mixes several (512x512, 768x768...).

The sampler decides which samples an epoch visits and in what order; bucketing decides only how they
are grouped into batches. :class:`ShapeBucketBatchSampler` keeps one pending batch per shape, walks the
sampler's order, and emits a batch as soon as its bucket fills; at the end of the epoch each bucket's
partial batch is emitted (or dropped, with ``drop_last``).

What stays uniform over series: every sample the sampler yields lands in a batch (bar ``drop_last``,
which drops fewer than ``batch_size`` samples per bucket), each bucket keeps the sampler's order, and
a bucket's batches come out when its samples come up in that order. So a shuffled epoch visits every
series exactly as the sampler does, a bucket holding 30% of the samples gives about 30% of the batches,
spread over the epoch rather than bunched at its end, and no bucket is starved. A dataset of one
shape is batched exactly like torch's ``BatchSampler``.

Examples:
    >>> import numpy as np
    >>> list(ShapeBucketBatchSampler(range(6), np.array([0, 1, 0, 0, 1, 1]), batch_size=2))
    [[0, 2], [1, 4], [3], [5]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import cast

import numpy as np
import numpy.typing as npt
from torch.utils.data import Sampler

from medload.data.loader_types import LoaderDataset
from medload.data.samplers import _int
from medload.errors import ConfigError

__all__ = ["ShapeBucketBatchSampler", "shape_buckets"]


def shape_buckets(dataset: LoaderDataset) -> np.ndarray:
    """The bucket number of each sample of a :class:`SliceDataset`/:class:`SlabDataset`: samples share
    a bucket when their series share (rows, columns); buckets are numbered in ascending matrix size.

    Examples:
        >>> shape_buckets(SliceDataset(store, context=1))[:4]     # the sample: one size, one bucket
        array([0, 0, 0, 0])
    """
    sizes = np.array([r.shape[1:] for r in dataset.records], np.int64).reshape(-1, 2)
    per_series = np.unique(sizes, axis=0, return_inverse=True)[1].reshape(-1)
    return per_series[dataset.index.series]


class ShapeBucketBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` indices from ``sampler``, each from one bucket (see the module docstring).

    Args:
        sampler: any iterable of dataset indices with a length (a torch Sampler).
        buckets: the bucket of every dataset index (e.g. :func:`shape_buckets`).
        batch_size: samples per batch.
        drop_last: drop each bucket's last partial batch.

    With several buckets the batch count depends on which samples an epoch draws, so the sampler's order
    is drawn once per epoch and kept until it is iterated: ``len()`` is the number of batches of the next
    iteration, and ``set_epoch`` (forwarded to the sampler) starts a new draw.

    Examples:
        >>> import numpy as np
        >>> batches = ShapeBucketBatchSampler(range(5), np.array([0, 1, 0, 1, 0]), batch_size=2, drop_last=True)
        >>> len(batches), list(batches)
        (2, [[0, 2], [1, 3]])
    """

    def __init__(self, sampler: Iterable[int], buckets: npt.ArrayLike, batch_size: int, drop_last: bool = False) -> None:
        buckets = np.asarray(buckets)
        if buckets.ndim != 1 or buckets.dtype.kind not in "iu":
            raise ConfigError(f"buckets must be a 1-D integer array, one bucket per dataset index; got shape "
                              f"{buckets.shape}, dtype {buckets.dtype}")
        self.sampler, self.drop_last = sampler, bool(drop_last)
        self.batch_size = _int("batch_size", batch_size, low=1)
        self.buckets = np.unique(buckets, return_inverse=True)[1].reshape(-1)  # dense 0..K-1
        self.n_buckets = int(self.buckets.max()) + 1 if self.buckets.size else 0
        self._drawn: np.ndarray | None = None
        self._skip = self._before = 0  # a restored loader's place in the epoch (resume)

    def resume(self, skip: int, before: int = 0) -> None:
        """Leave out the first ``skip`` batches of the next iteration (a restored loader consumed them), and
        count ``before`` batches an earlier order of the same epoch gave (an elastic restore) in ``len()``
        until that iteration ends."""
        self._skip, self._before = _int("skip", skip, low=0), _int("before", before, low=0)

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the sampler (when it has ``set_epoch``) and draw its order anew."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._drawn = None

    def _draw(self) -> np.ndarray:
        """This epoch's sampler order, drawn once and kept until it is iterated."""
        if self._drawn is None:
            self._drawn = np.fromiter(iter(self.sampler), np.int64)
        return self._drawn

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0  # once: a pass left off early does not skip again
        if self.n_buckets <= 1:  # one shape: stream the sampler, no need to draw the epoch first
            batches = self._batches(iter(self.sampler), None)
        else:
            order, self._drawn = self._draw(), None
            batches = self._batches(iter(order.tolist()), self.buckets[order].tolist())
        yield from itertools.islice(batches, skip, None)
        self._before = 0

    def _batches(self, indices: Iterator[int], buckets: list[int] | None) -> Iterator[list[int]]:
        pending: dict[int, list[int]] = {}
        for n, i in enumerate(indices):
            chunk = pending.setdefault(0 if buckets is None else buckets[n], [])
            chunk.append(int(i))
            if len(chunk) == self.batch_size:
                yield chunk[:]
                chunk.clear()
        if not self.drop_last:
            yield from (chunk for _, chunk in sorted(pending.items()) if chunk)

    def __len__(self) -> int:
        if self.n_buckets <= 1:
            n = len(cast(Sized, self.sampler))  # samplers of a loader have a length (as torch's DataLoader needs)
            return self._before + (n // self.batch_size if self.drop_last else -(-n // self.batch_size))
        per_bucket = np.bincount(self.buckets[self._draw()], minlength=self.n_buckets)
        full = per_bucket // self.batch_size
        return self._before + int(full.sum() if self.drop_last else (full + (per_bucket % self.batch_size > 0)).sum())

"""medload's datasets with cache counters that reach the trainer from every DataLoader worker.

A worker's L1 is its own (a forked worker starts with an empty cache), so :meth:`medload.Store.stats`
in the trainer sees none of the workers' reads. After each batch a worker reads, :class:`CountedSlices`
and :class:`CountedSlabs` copy the worker's counters into its row of a shared int64 table
(``dataset.counters``, shape ``(num_workers + 1, len(COUNTERS))``; row 1 + i: worker i), which the
benchmark sums when the run ends. Row 0, the trainer's (``num_workers=0``), is filled then with
:func:`counted_now`, as the trainer is the benchmark's own process: copying after every read would
cost the trainer about 17 us a call, and with ``num_workers=0`` the loader reads a few samples a call.
"""

from __future__ import annotations

import torch

from medload.data import SlabDataset, SliceDataset
from medload.data.datasets import _StoreDataset

__all__ = ["COUNTERS", "CountedSlices", "CountedSlabs", "counted_now"]

COUNTERS = ("l1_hits", "l1_misses", "l1_evictions", "l1_bytes", "l2_reads", "l3_reads")
"""The columns of the counter table: L1 hits/misses/evictions/bytes held, slices read from L2 and L3."""


def counted_now(store) -> torch.Tensor:
    """This process's counters now, in :data:`COUNTERS` order (L1 and the tiers count per process)."""
    stats = store.stats()
    l1 = stats.get("l1") or {}
    l2 = stats.get("l2") or {}
    return torch.tensor((l1.get("hits", 0), l1.get("misses", 0), l1.get("evictions", 0), l1.get("bytes", 0),
                         l2.get("hits", 0), (stats.get("l3") or {}).get("hits", 0)), dtype=torch.int64)


class _CountedReads(_StoreDataset):  # a mixin: the MRO puts SliceDataset/SlabDataset after it
    counters: torch.Tensor

    def read_batch(self, indices, image, label) -> None:
        super().read_batch(indices, image, label)
        info = torch.utils.data.get_worker_info()
        if info is not None:
            self.counters[1 + info.id] = counted_now(self.store)


class CountedSlices(_CountedReads, SliceDataset):
    """:class:`~medload.data.SliceDataset` that publishes its process's cache counters per batch."""


class CountedSlabs(_CountedReads, SlabDataset):
    """:class:`~medload.data.SlabDataset` that publishes its process's cache counters per batch."""

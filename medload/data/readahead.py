"""Read-ahead for the loader: the disk fetches the next batch while this one decodes.

Each process that reads batches (the trainer with ``num_workers=0``, or each DataLoader worker) has one
background thread. Before reading batch n, the reader hands the thread the batches it will read next
(``batch.ahead``, see :class:`medload.data.slots._SlotBatchSampler`) that it has not announced yet; the
thread finds their slices in the store and asks the kernel to read them (:meth:`medload.Store.prefetch`),
while the reader decodes batch n. Asking is cheap to the reader but not free to the machine -- on a cold page cache the
kernel spends about half a millisecond per 2.5D sample allocating pages and queueing their reads -- so
it happens on the thread, on whatever core the reader leaves. A batch that was not announced (the first
of each reader) is announced by the reader itself before it reads, so that its reads run in parallel.

The read-ahead is a hint: if it fails (a damaged shard, say), the read that follows raises the error.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from medload.data.loader_types import LoaderBatch, LoaderDataset

__all__ = ["ReadAhead"]

log = logging.getLogger(__name__)


class ReadAhead:
    """Announces batches to a dataset's store from a background thread of the calling process."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._announced: set[int] = set()
        self._last = -1

    def __getstate__(self) -> dict:  # a DataLoader worker starts with no thread of its own yet
        return {}

    def __setstate__(self, state: dict) -> None:
        ReadAhead.__init__(self)

    def before(self, dataset: LoaderDataset, batch: LoaderBatch) -> None:
        """Call before reading ``batch`` (a loader batch: ``number``, indices, ``ahead``): announces it now
        unless it was announced earlier, and the batches ``ahead`` of it in the background."""
        pool = self._pool
        if self._pid != os.getpid() or pool is None:  # first call in this process (or a forked child): its own thread
            self._pid, self._announced, self._last = os.getpid(), set(), -1
            pool = self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="medload-readahead")
        if batch.number <= self._last:  # a new epoch numbers its batches from 0 again
            self._announced = set()
        self._last = batch.number
        if batch.number not in self._announced:
            _quietly(dataset, list(batch))
        self._announced = {m for m in self._announced if m > batch.number}
        for number, indices in batch.ahead:
            if number not in self._announced:
                self._announced.add(number)
                pool.submit(_quietly, dataset, indices)


def _quietly(dataset: LoaderDataset, indices: list[int]) -> None:
    try:
        dataset.prefetch(indices)
    except Exception as exc:  # noqa: BLE001 - a hint: the read that follows reports the problem
        log.debug("read-ahead of %d samples failed: %s", len(indices), exc)

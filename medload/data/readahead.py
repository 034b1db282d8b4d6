"""Read-ahead for the loader: the disk fetches the next batch while this one decodes.

Each process that reads batches (the trainer with ``num_workers=0``, or each DataLoader worker) has one
background thread. Before reading batch n, the reader hands the thread the indices of the batch it will
read next (``batch.ahead``, see :class:`medload.data.loader._SlotBatchSampler`); the thread finds their
slices in the store and asks the kernel to read them (:meth:`medload.Store.prefetch`), while the reader
decodes batch n. Asking is cheap to the reader but not free to the machine -- on a cold page cache the
kernel spends about half a millisecond per 2.5D sample allocating pages and queueing their reads -- so
it happens on the thread, on whatever core the reader leaves. A batch that was not announced (the first
of each reader) is announced by the reader itself before it reads, so that its reads run in parallel.

The read-ahead is a hint: if it fails (a damaged shard, say), the read that follows raises the error.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["ReadAhead"]

log = logging.getLogger(__name__)


class ReadAhead:
    """Announces batches to a dataset's store from a background thread of the calling process."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._announced: list[int] | None = None

    def __getstate__(self) -> dict:  # a DataLoader worker starts with no thread of its own yet
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def before(self, dataset, batch: list[int], ahead: list[int] | None) -> None:
        """Call before reading ``batch``: announces it now unless it was announced earlier, and ``ahead``
        (the batch this process reads next) in the background."""
        if self._pid != os.getpid():  # first call in this process (or a forked child): a thread of its own
            self._pid, self._announced = os.getpid(), None
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="medload-readahead")
        if self._announced != list(batch):
            _quietly(dataset, list(batch))
        self._announced = ahead
        if ahead:
            self._pool.submit(_quietly, dataset, ahead)


def _quietly(dataset, indices: list[int]) -> None:
    try:
        dataset.prefetch(indices)
    except Exception as exc:  # noqa: BLE001 - a hint: the read that follows reports the problem
        log.debug("read-ahead of %d samples failed: %s", len(indices), exc)

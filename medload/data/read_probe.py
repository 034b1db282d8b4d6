"""The profiler's instrumentation of the read path, below the loader: a read observer on the dataset's
store (:mod:`medload.storage.observe`) and :func:`timed_batch`, which reads one batch with it.

While a profile runs (``control[0]`` of the loader's slot dataset is set, :mod:`medload.data.profile`),
each process that reads batches -- a DataLoader worker, or the trainer with ``num_workers=0`` -- reads
them through :func:`timed_batch`: it registers this process's :class:`ReadTimes` on its store and sends
each batch's stage times back in the batch's meta dict. At its first batch after the profile ended the
process takes the observer off again, so a loader that is not being profiled pays one flag check per batch.
"""

from __future__ import annotations

from time import perf_counter, process_time

import torch

from medload.data.loader_types import BatchReader, LoaderBatch
from medload.storage.observe import ReadObserver

__all__ = ["ReadTimes", "timed_batch", "stop_timing"]


class ReadTimes(ReadObserver):
    """Read seconds and slices of one batch in this process, by tier (reset before each batch)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.read_s = 0.0                      # in read calls: every tier, L1 included
        self.scan_s = {"l2": 0.0, "l3": 0.0}   # in range reads, less their decoding
        self.decode_s = 0.0
        self.requested = 0
        self.scanned = {"l2": 0, "l3": 0}
        self._decode_seen = 0.0                # decode_s at the end of the last range read

    def read(self, slices: int, seconds: float) -> None:
        self.read_s += seconds
        self.requested += slices

    def range_read(self, tier: str, slices: int, nbytes: int, seconds: float) -> None:
        decoded, self._decode_seen = self.decode_s - self._decode_seen, self.decode_s  # its values' decoding
        self.scan_s[tier] += seconds - decoded
        self.scanned[tier] += slices

    def decoded(self, seconds: float) -> None:
        self.decode_s += seconds


_TIMES = ReadTimes()


def timed_batch(slots: BatchReader, batch: LoaderBatch) -> dict:
    """Read ``batch`` like ``slots.fill`` (a loader's slot dataset), adding its stage times to the
    meta dict under ``"profile"``; called in whichever process reads the batch (a worker, or the
    trainer with ``num_workers=0``). Once the profile has ended, takes the observer off again.

    Examples:
        >>> meta = timed_batch(loader.loader.dataset, batch)   # doctest: +SKIP
        >>> sorted(meta["profile"]["stages"])   # doctest: +SKIP
        ['collate', 'decode', 'read_l1', 'read_l2', 'read_l3']
    """
    if not slots.control[0]:
        stop_timing(slots)
        return slots.fill(batch)
    slots.dataset.store.observe(_TIMES)
    slots.probed = True
    _TIMES.reset()
    t0, c0 = perf_counter(), process_time()
    meta = slots.fill(batch)
    busy, cpu = perf_counter() - t0, process_time() - c0
    p = _TIMES
    in_scans = p.scan_s["l2"] + p.scan_s["l3"] + p.decode_s
    info = torch.utils.data.get_worker_info()
    meta["profile"] = {
        "worker": -1 if info is None else info.id, "busy": busy, "cpu": cpu,
        "stages": {"read_l1": max(p.read_s - in_scans, 0.0), "read_l2": p.scan_s["l2"], "read_l3": p.scan_s["l3"],
                   "decode": p.decode_s, "collate": max(busy - p.read_s, 0.0)},
        "slices": {"l1": p.requested - p.scanned["l2"] - p.scanned["l3"], **p.scanned},
    }
    return meta


def stop_timing(slots: BatchReader) -> None:
    """Take this process's observer off the store of ``slots`` (a loader's slot dataset)."""
    slots.dataset.store.unobserve(_TIMES)
    slots.probed = False

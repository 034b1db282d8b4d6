"""Buffers of the fast loader that outlive a batch: recycled float batches on the CPU (see
:mod:`medload.data.loader`; on CUDA batches go from their page-locked slots: :mod:`medload.data.side_stream`)."""

from __future__ import annotations

import torch

__all__ = ["Recycler"]


def _storage_users(t: torch.Tensor) -> int | None:
    """How many tensors use ``t``'s storage (torch's internal count), or None where torch hides it."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # minus the temporary storage handle
    except (AttributeError, RuntimeError):
        return None


class Recycler:
    """Float batch buffers on the CPU, reused once nothing outside the loader uses them.

    A fresh 25 MB float batch per step costs page faults and kernel zeroing, and glibc's adaptive
    mmap threshold then turns the churn into a heap that grows by gigabytes of free memory
    (``benchmarks/memory.py``; figures in docs/benchmarks.md, "Design measurements"). Each batch is handed out as a *view* of a pooled buffer; when the caller has dropped it
    (and every view of it), torch's storage use count falls back to the pool's own reference and the
    buffer is reused. A batch still held -- kept in a list, say -- is never overwritten: a new
    buffer is made instead.

    ``keep`` buffers of each shape are pooled: the batch the caller works on and the one being made (a
    loop ``for batch in loader`` still holds the previous batch while the next is made). Each more would
    only hold memory: 25 MB per 2.5D batch of 8 x 3 x 512 x 512.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._pools: dict[tuple, list[torch.Tensor]] = {}

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        pool = self._pools.setdefault((tuple(shape), dtype), [])
        for buf in pool:
            if _storage_users(buf) == 1:
                return buf.view(shape)
        buf = torch.empty(shape, dtype=dtype)
        if _storage_users(buf) is not None:
            pool.append(buf)
            del pool[: -self.keep]
        return buf.view(shape)

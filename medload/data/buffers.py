"""Buffers of the fast loader that outlive a batch: pinned host staging for CUDA copies, and recycled
float batches on the CPU (see :mod:`medload.data.loader`)."""

from __future__ import annotations

import torch

__all__ = ["PinnedStaging", "Recycler"]


class PinnedStaging:
    """Host-to-GPU copies through page-locked buffers, so they run asynchronously.

    A slot's bytes are copied (on the CPU) into the next of two pinned buffers, which is sent to the
    GPU with ``non_blocking=True``; a buffer is refilled only after the CUDA event recorded after its
    last copy has completed. The slot itself is free as soon as the CPU copy returns.
    """

    def __init__(self, count: int = 2) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._events: list = [None] * count
        self._next = 0

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        nbytes = host.numel() * host.element_size()
        if self._events[i] is not None:
            self._events[i].synchronize()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        staged = buffer[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(device, non_blocking=True)
        self._events[i] = torch.cuda.Event()
        self._events[i].record()
        return out


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

"""The CUDA side of the loader: page-locked slots, and each batch copied and prepared on a side stream.

The shared slots the workers write into (:mod:`medload.data.slots`) are page-locked in the training
process with ``cudaHostRegister``, so the host-to-device copy of a batch runs straight from its slot,
asynchronously, with no copy into a staging buffer on the training thread. The copy, the cast and
window, and the augmentation of batch n + 1 are queued on a side stream while the model runs batch n
on the caller's stream; the caller's stream waits for the batch's event (``wait_event``), never the
host, and every tensor handed out is marked as used by the caller's stream (``record_stream``) so the
caching allocator does not reuse its memory early. The slot is freed by its copy's event
(:class:`~medload.data.slot_ring.SlotRing`). This is the pattern of torch's pin-memory thread and of
DALI's prefetch queue, without the thread: the copy engine does the work.

:class:`Streams` is what :class:`SideStreamFeed` needs of CUDA, so that the ordering can be driven on
a machine without a GPU by a stand-in that records what was queued where.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from medload.data.slot_ring import CopyEvent, SlotRing

__all__ = ["Streams", "CudaStreams", "SideStreamFeed", "InFlight", "page_lock"]

log = logging.getLogger(__name__)


class Streams(Protocol):
    """The CUDA operations of the feed."""

    def side(self) -> AbstractContextManager:
        """A block whose device work is queued on the side stream."""
        ...

    def event(self) -> CopyEvent:
        """An event recorded now on the side stream."""
        ...

    def start(self) -> None:
        """The side stream waits for the caller's stream once, before an epoch's first batch (for what
        was set up on it: the model, the augmentation's state)."""
        ...

    def consume(self, ready: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        """The caller's stream waits for ``ready``; ``tensors`` are marked as used by it."""
        ...

    def pin(self, buffers: torch.Tensor) -> bool:
        """Page-lock ``buffers`` in place; False (after one log line) where it cannot be done."""
        ...

    def unpin(self, buffers: torch.Tensor) -> None: ...


class CudaStreams:
    """:class:`Streams` on a CUDA device: one side stream, ``cudaHostRegister`` for the slots."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def side(self) -> AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def event(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def start(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def consume(self, ready: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        caller = torch.cuda.current_stream(self.device)
        caller.wait_event(ready)  # type: ignore[arg-type]  # a torch.cuda.Event: see event()
        for t in tensors:
            t.record_stream(caller)

    def pin(self, buffers: torch.Tensor) -> bool:
        return page_lock(buffers, self.device)

    def unpin(self, buffers: torch.Tensor) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffers.data_ptr()))


def page_lock(buffers: torch.Tensor, device: torch.device) -> bool:
    """Page-lock ``buffers`` in place (``cudaHostRegister``), so that copies from them to ``device`` run
    asynchronously; False, with one log line, where CUDA refuses or torch has none."""
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(buffers.data_ptr(), buffers.numel() * buffers.element_size(), 0))
    except (RuntimeError, AssertionError, AttributeError) as exc:
        log.warning("could not page-lock the loader's batch slots (%s): copies to %s come from pageable memory, "
                    "synchronously", exc, device)
        return False
    return True


@dataclass
class InFlight:
    """A batch queued on the side stream: its tensors (ready once ``ready`` completes) and its meta."""

    out: dict
    ready: CopyEvent
    meta: dict


class SideStreamFeed:
    """Queues each batch's copy off its slot and its preparation on the side stream; hands it out on the
    caller's stream.

    ``pinned``: the slots are page-locked, so a copy from one runs asynchronously and the slot stays
    busy until its event; otherwise (pageable memory) the copy has consumed the slot when it returns.
    """

    def __init__(self, streams: Streams, ring: SlotRing, pinned: bool) -> None:
        self.streams, self.ring, self.pinned = streams, ring, pinned

    def issue(self, slot: int, host: Sequence[torch.Tensor | None], to_device: Callable[[torch.Tensor], torch.Tensor],
              prepare: Callable[..., dict], meta: dict) -> InFlight:
        """Queue the copies of ``host`` (views of ``slot``; None: absent) and ``prepare(*copies)`` on the
        side stream; returns at once, before any of it has run."""
        with self.streams.side():
            copies = [None if h is None else to_device(h) for h in host]
            if self.pinned:
                self.ring.copying(slot, self.streams.event())
            else:
                self.ring.released(slot)
            out = prepare(*copies)
            ready = self.streams.event()
        return InFlight(out, ready, meta)

    def hand_out(self, batch: InFlight) -> dict:
        """``batch``'s tensors for the caller's stream, which waits for them on the device."""
        self.streams.consume(batch.ready, [v for v in batch.out.values() if isinstance(v, torch.Tensor)])
        return batch.out

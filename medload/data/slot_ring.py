"""Which slot of the shared batch buffer each batch goes into, and when a slot may be refilled.

Slots are handed out round robin when a batch is dispatched to a reader (:mod:`medload.data.slots`).
On the CPU the trainer copies a batch off its slot before it asks for the next, so the slot count alone
(:func:`~medload.data.slots.slot_count`) keeps a slot from being refilled while it is read. On CUDA the
trainer only *issues* the host-to-device copy from the (page-locked) slot, on a side stream, and moves
on: the slot is busy until the copy's CUDA event has completed. As torch's caching host allocator does
for pinned blocks, the ring keeps that event with the slot and hands the slot out again only once the
event says the copy is done; the ring is sized for :data:`COPIES_IN_FLIGHT` such copies, so the host
never has to wait for one (when it must, :attr:`SlotRing.waits` counts it).

Each slot moves ``FREE -> READING`` (dispatched to a reader) ``-> COPYING`` (its device copy issued,
with an event) ``-> FREE`` (the event completed), or ``READING -> FREE`` where the trainer copied the
batch synchronously (the CPU, or pageable memory). The ring only ever runs in the training process: the
batch sampler that calls :meth:`SlotRing.acquire` is iterated there by torch's DataLoader.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Protocol

from medload.errors import MedloadError

__all__ = ["SlotRing", "SlotState", "CopyEvent", "COPIES_IN_FLIGHT", "SlotRingError"]

log = logging.getLogger(__name__)

#: Device copies that may be in flight from slots at once: the batch being prepared on the side stream
#: and the one before it (whose event normally completed a training step ago).
COPIES_IN_FLIGHT = 2


class CopyEvent(Protocol):
    """What the ring needs of a ``torch.cuda.Event`` recorded after a copy from a slot."""

    def query(self) -> bool:
        """Whether the work recorded before the event has completed."""
        ...

    def synchronize(self) -> None:
        """Block the host until it has."""
        ...


class SlotState(Enum):
    FREE = "free"
    READING = "reading"
    COPYING = "copying"


class SlotRingError(MedloadError):
    """A slot was used out of turn: a bug in the loader, not in the caller's settings."""


class SlotRing:
    """The states of ``slots`` slots, and the copy event of each slot whose device copy is in flight.

    Examples:
        >>> ring = SlotRing(3)
        >>> [ring.acquire(n) for n in range(3)], ring.state(1)
        ([0, 1, 2], <SlotState.READING: 'reading'>)
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise SlotRingError(f"a slot ring needs at least one slot, got {slots}")
        self.slots = slots
        self._states = [SlotState.FREE] * slots
        self._events: list[CopyEvent | None] = [None] * slots
        self.waits = 0  # times the host had to wait for a copy before refilling its slot

    def state(self, slot: int) -> SlotState:
        """The slot's state, after taking in a completed copy."""
        self._settle(slot)
        return self._states[slot]

    def acquire(self, number: int) -> int:
        """The slot of the ``number``-th batch of an epoch (round robin), free to be filled.

        A slot whose copy may still be in flight is never handed out: the host waits for its event
        first (counted in :attr:`waits`; with the ring's size it does not happen in a steady loop). A
        slot still ``READING`` belongs to a batch the DataLoader dispatched and nobody consumed (an
        epoch left early, whose workers have been drained or stopped): it is refilled."""
        slot = number % self.slots
        self._settle(slot)
        event = self._events[slot]
        if event is not None:
            self.waits += 1
            log.debug("slot %d: waiting for its device copy before refilling it", slot)
            event.synchronize()
            self._events[slot] = None
        self._states[slot] = SlotState.READING
        return slot

    def copying(self, slot: int, event: CopyEvent) -> None:
        """The device copy from ``slot`` has been issued; ``event`` completes when it is done."""
        if self._states[slot] is not SlotState.READING:
            raise SlotRingError(f"slot {slot} is {self._states[slot].value}: only a slot holding a batch is copied")
        self._states[slot], self._events[slot] = SlotState.COPYING, event

    def released(self, slot: int) -> None:
        """The batch in ``slot`` has been copied off it synchronously: the slot is free now."""
        if self._states[slot] is SlotState.COPYING:
            raise SlotRingError(f"slot {slot} has a device copy in flight: it is freed by its event")
        self._states[slot] = SlotState.FREE

    def drain(self) -> None:
        """Wait for every copy in flight (before the slots' memory is unregistered or freed)."""
        for slot, event in enumerate(self._events):
            if event is not None:
                event.synchronize()
                self._events[slot], self._states[slot] = None, SlotState.FREE

    def _settle(self, slot: int) -> None:
        event = self._events[slot]
        if event is not None and event.query():
            self._events[slot], self._states[slot] = None, SlotState.FREE

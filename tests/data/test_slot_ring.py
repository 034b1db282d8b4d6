"""The CUDA path's bookkeeping on any machine: the slot ring driven with stand-in copy events, and the loader's
side-stream ordering driven through a stand-in for CUDA's streams (:mod:`medload.data.side_stream`)."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from medload.config import IngestConfig
from medload.data import SliceDataset
from medload.data.build import build_loader
from medload.data.side_stream import page_lock
from medload.data.slot_ring import COPIES_IN_FLIGHT, SlotRing, SlotRingError, SlotState
from medload.data.slots import slot_count
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


class Gpu:
    """A stand-in device: events complete ``lag`` hand-outs after they were recorded (or when the host
    waits for them); everything queued is logged in order."""

    def __init__(self, lag: int) -> None:
        self.lag, self.handed_out, self.log, self.events = lag, 0, [], []

    def tick(self) -> None:
        self.handed_out += 1
        for e in self.events:
            if not e.done and self.handed_out - e.recorded_at >= self.lag:
                e.done = True


class Event:
    def __init__(self, gpu: Gpu, name: str) -> None:
        self.gpu, self.name, self.recorded_at, self.done = gpu, name, gpu.handed_out, False
        gpu.events.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.gpu.log.append(("host waits", self.name))
        self.done = True


class Streams:
    """:class:`medload.data.side_stream.Streams` on the stand-in device."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu, self.on_side, self.recorded = gpu, False, 0

    @contextmanager
    def side(self):
        self.on_side = True
        try:
            yield
        finally:
            self.on_side = False

    def event(self) -> Event:
        assert self.on_side, "events of the feed are recorded on the side stream"
        self.recorded += 1
        self.gpu.log.append(("record", self.recorded))
        return Event(self.gpu, str(self.recorded))

    def start(self) -> None:
        self.gpu.log.append(("side waits for caller",))

    def consume(self, ready: Event, tensors) -> None:
        self.gpu.log.append(("caller waits", ready.name, len(tensors)))
        self.gpu.tick()

    def pin(self, buffers) -> bool:
        self.gpu.log.append(("pin",))
        return True

    def unpin(self, buffers) -> None:
        self.gpu.log.append(("unpin",))


# ---- the ring alone -----------------------------------------------------------------------------------
def _drive(ring: SlotRing, gpu: Gpu, batches: int, dispatched_ahead: int) -> list[tuple[int, list[Event]]]:
    """The loader's schedule on CUDA: ``dispatched_ahead`` batches out to readers; each call hands out
    batch k after issuing batch k + 1's copy. Returns each acquire's slot and the events its slot had."""
    slot_of, events_of, acquired = {}, {s: [] for s in range(ring.slots)}, []

    def dispatch(n: int) -> None:
        slot = ring.acquire(n)
        acquired.append((slot, list(events_of[slot])))
        slot_of[n] = slot

    for n in range(min(dispatched_ahead, batches)):
        dispatch(n)
    for n in range(batches):  # batch n arrives from its reader: the next is dispatched, n's copy issued
        if n + dispatched_ahead < batches:
            dispatch(n + dispatched_ahead)
        event = Event(gpu, f"copy {n}")
        ring.copying(slot_of[n], event)
        events_of[slot_of[n]].append(event)
        if n:
            gpu.tick()  # batch n - 1 handed out
    return acquired


@pytest.mark.parametrize(("workers", "prefetch"), [(0, 2), (2, 2), (4, 2), (3, 4)])
def test_a_ring_of_the_loaders_size_never_waits_for_copies_that_finish_within_two_batches(workers, prefetch):
    ring, gpu = SlotRing(slot_count(workers, prefetch, COPIES_IN_FLIGHT)), Gpu(lag=2)
    acquired = _drive(ring, gpu, batches=40, dispatched_ahead=workers * prefetch)
    assert ring.waits == 0 and not [e for e in gpu.log if e[0] == "host waits"]
    assert all(e.done for _, events in acquired for e in events)  # never refilled under a copy


def test_a_slot_is_never_refilled_while_its_copy_may_be_in_flight():
    """Copies that never finish by themselves: every refill waits for its slot's copy first."""
    ring, gpu = SlotRing(slot_count(2, 2, COPIES_IN_FLIGHT)), Gpu(lag=10**6)
    acquired = _drive(ring, gpu, batches=30, dispatched_ahead=4)
    assert all(e.done for _, events in acquired for e in events)
    assert ring.waits == len([e for e in gpu.log if e[0] == "host waits"]) > 0


def test_the_ring_refuses_steps_out_of_turn():
    ring = SlotRing(2)
    with pytest.raises(SlotRingError, match="only a slot holding a batch"):
        ring.copying(0, Event(Gpu(1), "x"))
    slot = ring.acquire(0)
    ring.copying(slot, Event(Gpu(1), "x"))
    with pytest.raises(SlotRingError, match="freed by its event"):
        ring.released(slot)
    assert ring.state(slot) is SlotState.COPYING
    ring.drain()
    assert ring.state(slot) is SlotState.FREE
    with pytest.raises(SlotRingError, match="at least one slot"):
        SlotRing(0)


# ---- the loader's CUDA path on the stand-in -------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring")
    for i in range(2):
        make_series(root / "src", SeriesSpec(n_slices=9, rows=20, cols=24), seed=i, series_number=i + 1)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


@pytest.mark.parametrize("workers", [0, 2])
def test_each_batch_is_handed_out_after_the_next_is_queued_and_the_host_never_waits(store, workers):
    ds = SliceDataset(open_store(store, "4MB"), context=1)
    gpu = Gpu(lag=1)
    loader = build_loader(ds, 4, workers, "cpu", window="soft_tissue", streams=Streams(gpu))
    plain = build_loader(ds, 4, 0, "cpu", window="soft_tissue")
    batches = [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in loader]
    assert loader.ring.slots == slot_count(workers, 2, COPIES_IN_FLIGHT)
    expected = list(plain)
    assert len(batches) == len(expected) == len(loader) == 5
    for got, want in zip(batches, expected):
        assert torch.equal(got["image"], want["image"]) and torch.equal(got["index"], want["index"])
    log = gpu.log
    assert log[:2] == [("pin",), ("side waits for caller",)] and not [e for e in log if e[0] == "host waits"]
    waits = [i for i, e in enumerate(log) if e[0] == "caller waits"]
    records = [i for i, e in enumerate(log) if e[0] == "record"]
    assert len(waits) == 5 and len(records) == 10  # per batch: its copy event, its ready event
    for k, at in enumerate(waits[:-1]):  # batch k+1's copy and preparation were queued before k was handed out
        assert records[2 * (k + 1) + 1] < at
        assert log[at][1] == str(2 * k + 2)  # the caller waits for batch k's ready event, on the device
    assert loader.cost.batches == 5 and loader.cost.wall_s > 0 and loader.cost.cpu_s > 0


def test_without_page_locking_the_slot_is_freed_when_the_copy_returns(store):
    ds = SliceDataset(open_store(store, "4MB"), context=1)
    gpu = Gpu(lag=10**6)
    loader = build_loader(ds, 4, 0, "cpu", window="soft_tissue", streams=Streams(gpu), pin_memory=False)
    assert loader.ring.slots == slot_count(0, 2) and len(list(loader)) == 5
    assert ("pin",) not in gpu.log and loader.ring.waits == 0
    assert [e[0] for e in gpu.log].count("record") == 5  # only the ready events


def test_the_cpu_loader_frees_each_slot_as_it_copies_it_off(store):
    ds = SliceDataset(open_store(store, "4MB"), context=1)
    loader = build_loader(ds, 4, 2, "cpu", window="soft_tissue")
    assert len(list(loader)) == 5 and loader.ring.waits == 0
    assert {loader.ring.state(s) for s in range(loader.ring.slots)} == {SlotState.FREE}
    assert loader.cost.batches == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU page-locks the buffer")
def test_page_locking_falls_back_with_one_log_line_where_cuda_is_missing(caplog):
    with caplog.at_level(logging.WARNING, logger="medload.data.side_stream"):
        assert page_lock(torch.zeros(16, dtype=torch.uint8), torch.device("cuda")) is False
    assert len(caplog.records) == 1 and "pageable memory" in caplog.records[0].getMessage()


def test_slot_count_adds_the_copies_in_flight():
    assert slot_count(4, 2) == 9 and slot_count(4, 2, COPIES_IN_FLIGHT) == 11 and slot_count(0, 2, 2) == 3
    assert np.all([slot_count(w, 2, 2) - slot_count(w, 2) == 2 for w in range(5)])


def test_slots_are_unlocked_while_workers_that_do_not_persist_are_forked_again(store):
    """Workers forked each epoch never start from a process holding the slots page-locked."""
    ds = SliceDataset(open_store(store, "4MB"), context=1)
    gpu = Gpu(lag=10**6)  # copies never finish by themselves: unlocking must wait for them
    loader = build_loader(ds, 4, 2, "cpu", window="soft_tissue", streams=Streams(gpu), persistent_workers=False)
    for _ in range(2):
        assert len(list(loader)) == 5
    steps = [e[0] for e in gpu.log if e[0] in ("pin", "unpin", "host waits")]
    assert steps[0] == "pin" and steps.count("pin") == steps.count("unpin") == 2
    first_unpin = steps.index("unpin")
    assert "host waits" in steps[:first_unpin]  # the copies in flight were waited for before unlocking
    assert all(loader.ring.state(s).value == "free" for s in range(loader.ring.slots))

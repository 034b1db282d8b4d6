"""The shared-memory ring between decoding workers and the writer, its fallback to a file in the temporary
directory, and its last resort, the pipe."""

from __future__ import annotations

import errno
import glob
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import store_dump

from medload.ingest import ring as ring_mod
from medload.ingest.ring import SliceRing, SlotWriter
from medload.synthetic import SeriesSpec, make_series


def test_slots_are_handed_out_once_and_reused_after_release():
    ring = SliceRing(3, 1024)
    try:
        slots = [ring.acquire() for _ in range(3)]
        assert sorted(s.start for s in slots) == [0, 1024, 2048]
        with pytest.raises(IndexError):
            ring.acquire()
        ring.release(slots[1])
        assert ring.acquire() == slots[1]
    finally:
        ring.close()
    assert not os.path.exists(ring.path)


def test_values_written_by_a_worker_are_read_back_by_the_writer():
    ring = SliceRing(2, 100)
    try:
        slot = ring.acquire()
        sink = SlotWriter(slot)
        spans = [sink.put(b"a" * 40), sink.put(b"b" * 50)]
        assert all(isinstance(s, tuple) for s in spans)
        assert bytes(ring.view(spans[0])) == b"a" * 40 and bytes(ring.view(spans[1])) == b"b" * 50
        assert sink.put(b"c" * 20) == b"c" * 20  # does not fit the slot: travels as bytes
        assert SlotWriter(None).put(b"d") == b"d"
    finally:
        ring.close()


def test_no_room_in_shared_memory_or_the_temporary_directory_means_no_ring(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ring_mod.os, "posix_fallocate", full)
    assert SliceRing.create(4, 1 << 20) is None
    # this process's rings only: other medload processes on the machine may hold rings of their own
    for directory in ("/dev/shm", tempfile.gettempdir()):
        assert not glob.glob(f"{directory}/medload-ring-{os.getpid()}-*")


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A real 16 MB tmpfs standing in for /dev/shm (a container's is 64 MB), and a temporary directory on
    disk; unmounted after the test."""
    shm, spill = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    spill.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(shm)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(reason=f"cannot mount a small tmpfs filesystem here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    monkeypatch.setattr(ring_mod, "_directory", lambda: str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    yield shm, spill
    if subprocess.run(["umount", str(shm)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(shm)], check=True)


def test_a_ring_too_large_for_shared_memory_is_a_file_in_the_temporary_directory(small_shm):
    shm, spill = small_shm
    small = SliceRing.create(2, 4 << 20)  # 8 MB: fits the 16 MB of shared memory
    large = SliceRing.create(3, 8 << 20)  # 24 MB: does not
    try:
        assert os.path.dirname(small.path) == str(shm) and os.path.dirname(large.path) == str(spill)
        sink = SlotWriter(large.acquire())
        span = sink.put(b"v" * 1000)
        assert isinstance(span, tuple) and bytes(large.view(span)) == b"v" * 1000
        assert len(os.listdir(shm)) == 1  # the small one: the large one's failed try left nothing there
    finally:
        small.close()
        large.close()
        SlotWriter._maps.clear()
    assert os.listdir(shm) == [] and os.listdir(spill) == []


def test_a_dead_ingests_ring_in_the_temporary_directory_is_removed_too(small_shm):
    shm, spill = small_shm
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = spill / f"medload-ring-{dead.stdout.strip()}-abcd"
    stale.write_bytes(b"x")
    ring_mod.remove_dead_rings()
    assert not stale.exists()


def test_two_workers_with_rings_on_disk_equal_one_worker(run_ingest, tmp_path, monkeypatch):
    """Rings in a file on disk (the fallback) carry the same values: the stores are equal."""
    src = tmp_path / "src"
    make_series(src, SeriesSpec(n_slices=40, rows=64, cols=64), seed=3)
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(ring_mod, "_directories", lambda: [str(spill)])
    _, one = run_ingest(src, workers=1, windows=("lung",))
    _, two = run_ingest(src, workers=2, windows=("lung",))
    assert len(one.series()) == 1 and store_dump(one) == store_dump(two)
    assert os.listdir(spill) == []  # every ring closed and removed


@pytest.mark.parametrize("ring_available", [True, False])
def test_two_workers_with_or_without_ring_equal_one_worker(run_ingest, tmp_path, monkeypatch, ring_available):
    src = tmp_path / "src"
    make_series(src, SeriesSpec(n_slices=40, rows=64, cols=64), seed=3)
    make_series(src, SeriesSpec(n_slices=9, orientation="oblique"), seed=4, series_number=2)
    if not ring_available:
        monkeypatch.setattr(SliceRing, "create", classmethod(lambda cls, slots, size: None))
    _, one = run_ingest(src, workers=1, windows=("lung",))
    _, two = run_ingest(src, workers=2, windows=("lung",))
    assert len(one.series()) == 2
    assert store_dump(one) == store_dump(two)


def test_a_ring_left_by_a_dead_process_is_removed_by_the_next_one(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    import tempfile

    directory = directory or tempfile.gettempdir()
    stale = os.path.join(directory, f"medload-ring-{dead.stdout.strip()}-abcd")
    mine = os.path.join(directory, f"medload-ring-{os.getpid()}-live")
    for path in (stale, mine):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        ring = SliceRing(1, 1024)
        ring.close()
        assert not os.path.exists(stale) and os.path.exists(mine)
    finally:
        for path in (stale, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_a_kept_ring_serves_every_call_until_one_needs_a_larger_ring():
    from medload.ingest.ring import RingSupply

    kept = RingSupply(keep=True)
    first = kept.take(2, 1024)
    first.acquire()
    kept.give_back(first)
    assert os.path.exists(first.path)  # kept for the next call
    again = kept.take(2, 512)
    assert again is first and {again.acquire().start, again.acquire().start} == {0, 1024}  # every slot free again
    larger = kept.take(3, 1024)
    assert larger is not first and not os.path.exists(first.path) and larger.slots == 3
    kept.close()
    assert not os.path.exists(larger.path)
    fresh = RingSupply()  # not kept: each call's ring is closed when it is given back
    ring = fresh.take(1, 1024)
    fresh.give_back(ring)
    assert not os.path.exists(ring.path)


def test_a_worker_maps_one_ring_at_a_time():
    """A decoding process kept across tasks unmaps the ring of an earlier task when it is handed a slot of a
    new one: the old ring's pages (unlinked by its writer) are freed, not held until the process exits."""
    old, new = SliceRing(1, 1024), SliceRing(1, 1024)
    try:
        SlotWriter(old.acquire()).put(b"x")
        sink = SlotWriter(new.acquire())
        assert list(SlotWriter._maps) == [new.path]
        span = sink.put(b"y" * 10)
        assert bytes(new.view(span)) == b"y" * 10
    finally:
        old.close()
        new.close()
        SlotWriter._maps.clear()


def test_too_little_shared_memory_for_the_workers_rings_is_said_once_with_the_fix(monkeypatch, caplog):
    """A container's /dev/shm (64 MB by default) holds no ring of 100 MB: the ingest says so up front, with
    what to do, instead of running slower without a word."""
    import logging

    from medload.config import IngestConfig
    from medload.deid import Pseudonymizer
    from medload.ingest.local_engine import LocalEngine

    free = {"bytes": 64 << 20}
    monkeypatch.setattr(ring_mod.os, "statvfs", lambda path: os.statvfs_result(
        (4096, 4096, free["bytes"] // 4096, free["bytes"] // 4096, free["bytes"] // 4096, 0, 0, 0, 0, 255)))
    note = ring_mod.short_of_shared_memory(2)
    assert note is not None and "64 MB free" in note and "--shm-size" in note
    with caplog.at_level(logging.WARNING, logger="medload.ingest.local_engine"), \
            LocalEngine(IngestConfig(workers=2), Pseudonymizer(b"k" * 32)):
        pass
    assert [r.getMessage() for r in caplog.records if "--shm-size" in r.getMessage()] == [note]
    free["bytes"] = 1 << 30
    assert ring_mod.short_of_shared_memory(2) is None


def test_the_note_says_where_rings_without_room_in_shared_memory_go(monkeypatch, tmp_path):
    free = {"/dev/shm": 150 << 20, str(tmp_path): 1 << 30}
    monkeypatch.setattr(ring_mod, "_directory", lambda: "/dev/shm")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ring_mod.os, "statvfs", lambda path: os.statvfs_result(
        (4096, 4096, free[path] // 4096, free[path] // 4096, free[path] // 4096, 0, 0, 0, 0, 255)))
    assert ring_mod.short_of_shared_memory(1) is None
    note = ring_mod.short_of_shared_memory(4)  # one ring fits in shared memory, three go to the disk
    assert note is not None and f"map a file in {tmp_path}" in note and "--shm-size" in note
    free[str(tmp_path)] = 250 << 20  # room for two of the three
    assert "through pipes" in ring_mod.short_of_shared_memory(4)

"""A shared-memory ring through which decoding workers hand encoded slices to the process writing their
series (a task, see :mod:`medload.ingest.shard_tasks`).

Returning encoded slices through the process pool's result pipe copies every byte four times (pickle,
pipe write, pipe read, unpickle) into freshly allocated buffers: about as much CPU as decoding half the
files (docs/benchmarks.md, "Design measurements"). With
the ring, a worker writes each encoded value once into a slot of a file mapped by every process
(``MAP_SHARED``, on tmpfs), and the writer hands LMDB a view of it: one copy, no pickling, no page
faults after the first pass over the ring.

A slot belongs to one chunk in flight: the writer acquires it when it submits the chunk and releases
it once LMDB has copied the chunk's values into its transaction. Space is reserved with
``posix_fallocate`` so a full file system fails at creation instead of killing a worker with SIGBUS later.
A ``/dev/shm`` too small for the ring (a container's is 64 MB unless told otherwise) puts it in a file of
the temporary directory (``$TMPDIR``, usually a disk) instead: the same mapping, its pages in the page cache,
written back now and then. Measured on 2,048 files at 2 workers (docs/benchmarks.md): 0-4% more CPU than
in shared memory once the file's pages are cached, where sending the values through the pipe -- the last
resort, when neither place has room -- costs 16-20%. A ring's name carries its writer's pid: a ring left
behind by a killed ingest is removed by the next one, in either place.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import tempfile
from dataclasses import dataclass

__all__ = ["SliceRing", "RingSlot", "RingSupply", "SlotWriter", "Span", "remove_dead_rings", "short_of_shared_memory"]

log = logging.getLogger(__name__)

#: (offset, length) of one value inside the ring file
Span = tuple[int, int]
_PREFIX = "medload-ring-"
#: about what one writer's ring takes with the default settings: 12 chunks in flight of 8 MB of pixels at
#: their worst-case encoded size (stored window planes add to it)
RING_BYTES = 100 << 20


@dataclass(frozen=True)
class RingSlot:
    """Where a chunk may write: ring file, and its slot's byte range."""

    path: str
    start: int
    size: int


class SliceRing:
    """The writer's side: owns the ring file, hands out slots, and reads values back."""

    def __init__(self, slots: int, slot_bytes: int, directory: str | None = None) -> None:
        directory = directory or _directory()
        remove_dead_rings(directory)
        fd, self.path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory)
        try:
            os.posix_fallocate(fd, 0, slots * slot_bytes)
            self._map = mmap.mmap(fd, slots * slot_bytes)
        except OSError:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.slots, self.slot_bytes = slots, slot_bytes
        self.free_all()

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> SliceRing | None:
        """A ring in shared memory, else in the temporary directory; None (values then travel through the
        pipe) when neither has room for it."""
        for directory in _directories():
            try:
                return cls(slots, slot_bytes, directory)
            except OSError as exc:
                log.info("no %d MB ring in %s (%s)", slots * slot_bytes >> 20, directory, exc)
        log.info("encoded slices go through the pipe")
        return None

    def free_all(self) -> None:
        self._free = list(range(self.slots - 1, -1, -1))

    def acquire(self) -> RingSlot:
        index = self._free.pop()
        return RingSlot(self.path, index * self.slot_bytes, self.slot_bytes)

    def release(self, slot: RingSlot) -> None:
        self._free.append(slot.start // self.slot_bytes)

    def view(self, span: Span) -> memoryview:
        offset, length = span
        return memoryview(self._map)[offset : offset + length]

    def close(self) -> None:
        self._map.close()
        os.unlink(self.path)


class RingSupply:
    """Where a writer gets its ring for one call of :func:`~medload.ingest.stages.decode_and_write`: a new
    one each time, or (``keep``) one ring kept across the calls of a process, replaced only by a larger
    one. A task process keeps its ring for the whole ingest: creating one reserves and zeroes about 100 MB
    of shared memory, and every process mapping it faults its pages in again (docs/benchmarks.md)."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._ring: SliceRing | None = None

    def take(self, slots: int, slot_bytes: int) -> SliceRing | None:
        """A ring of at least ``slots`` slots of ``slot_bytes``, every slot free (None: none fits in shared memory)."""
        ring = self._ring
        if ring is not None and ring.slots >= slots and ring.slot_bytes >= slot_bytes:
            ring.free_all()
            return ring
        self.close()
        ring = SliceRing.create(slots, slot_bytes)
        if self.keep:
            self._ring = ring
        return ring

    def give_back(self, ring: SliceRing | None) -> None:
        """The call is done with ``ring``: closed, unless kept."""
        if ring is not None and ring is not self._ring:
            ring.close()

    def close(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring = None


def short_of_shared_memory(writers: int) -> str | None:
    """A note for an ingest whose ``writers`` rings will not all fit in the free shared memory (a
    container's ``/dev/shm`` is 64 MB by default), or None: where the others go, and how to give it more."""
    shm, *spill = _directories()
    free = _free_bytes(shm)
    if free is None or free >= writers * RING_BYTES:
        return None
    left = writers - free // RING_BYTES
    where = "send decoded slices through pipes, which costs about a sixth more CPU"
    if spill and (room := _free_bytes(spill[0])) is not None and room >= left * RING_BYTES:
        where = f"map a file in {spill[0]} instead, which costs a few percent more CPU"
    return (f"{shm} has {free >> 20} MB free and {writers} writing process(es) may each want up to "
            f"{RING_BYTES >> 20} MB of it: those without room there {where}; in a container, give it more "
            "(docker run --shm-size=2g, or a larger /dev/shm)")


def _free_bytes(directory: str) -> int | None:
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _directory() -> str:
    """Where rings go first: shared memory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _directories() -> list[str]:
    """Where a ring may go, in order: shared memory, then the temporary directory (``$TMPDIR``)."""
    first, spill = _directory(), tempfile.gettempdir()
    return [first] if os.path.realpath(spill) == os.path.realpath(first) else [first, spill]


def remove_dead_rings(directory: str | None = None) -> None:
    """Delete rings whose writer process is gone (killed before it could unlink its ring): each holds up to
    about 100 MB of shared memory or disk until then. Run when a ring is created (in ``directory``), and by
    an ingest that stopped its task processes (Ctrl-C, an error; in every place a ring may be)."""
    for place in [directory] if directory else _directories():
        try:
            names = os.listdir(place)
        except OSError:
            continue
        for name in names:
            if not name.startswith(_PREFIX):
                continue
            pid = name[len(_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(place, name))
                    log.info("removed the ring of a dead ingest (pid %s)", pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlotWriter:
    """A worker's side: appends values into its chunk's slot; falls back to bytes when the slot is full."""

    _maps: dict[str, mmap.mmap] = {}

    def __init__(self, slot: RingSlot | None) -> None:
        self._slot = slot
        self._used = 0
        if slot is not None and slot.path not in self._maps:
            for old in self._maps.values():  # a decoding process serves one ring at a time: free a replaced one's pages
                old.close()
            self._maps.clear()
            with open(slot.path, "r+b") as f:
                self._maps[slot.path] = mmap.mmap(f.fileno(), 0)

    def put(self, value: bytes) -> bytes | Span:
        slot = self._slot
        if slot is None or self._used + len(value) > slot.size:
            return value
        offset = slot.start + self._used
        self._maps[slot.path][offset : offset + len(value)] = value
        self._used += len(value)
        return (offset, len(value))

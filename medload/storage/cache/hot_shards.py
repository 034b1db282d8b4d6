"""The L2 tier: verified single-file copies of published shards on local SSD, within a byte budget.

Stores often live on NFS or HDD, where LMDB should not be read during training. A hot
directory holds copies of shards' ``data.mdb`` files::

    <hot_dir>/<name>.mdb          published copy (open with lmdb.open(path, subdir=False, readonly=True, lock=False))
    <hot_dir>/<name>.mdb.partial  copy in progress (preallocated to its full size, so the budget counts it)
    <hot_dir>/locks/<name>.lock   flock held by the one thread/process copying <name>
    <hot_dir>/.evict.lock         flock held while deciding what to evict and reserving room

A copy is as readable as the shard it copies: the ``data.mdb`` of a store shared with a group (see
:mod:`medload.storage.sharing`) gives its copy mode 0640 and its group, else the copy is owner-only (0600).
The hot directory itself is created owner-only (0700) and its mode is never changed: give it ``g+rX``
to let the group read the copies too.

A copy is written to ``.partial`` while its xxh3-128 is computed, checked against ``store.json``, fsynced
and renamed into place, so a reader never sees a partial. Recency is the copy's mtime (``path_of`` bumps it
at most once a minute per process); the least recently used copies are evicted first. Deleting a copy that
another process has mapped is safe on POSIX. Lock files are never deleted (deleting a flock file races).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import xxhash

from medload.errors import ChecksumError, ConfigError, DiskFullError, MedloadError, StoreError
from medload.storage.manifest import ShardEntry, fsync_dir
from medload.storage.sharing import sharing_like
from medload.storage.space import disk_full_is_error

__all__ = ["HotEntry", "HotStatus", "HotShards"]

log = logging.getLogger(__name__)

_COPY = ".mdb"
_PARTIAL = ".mdb.partial"
_EVICT_LOCK = ".evict.lock"
_TOUCH_EVERY_S = 60.0
_CHUNK = 8 << 20
_HOT_ADVICE = ("free space on that disk, or lower the hot-shard budget (--hot-budget, or hot_budget in [cache]) to "
               "what it can hold; meanwhile the shard is read from the store")


@dataclass(frozen=True)
class HotEntry:
    """One published copy: shard name, size, and when it was last used (mtime, epoch seconds)."""

    name: str
    bytes: int
    last_used: float


@dataclass(frozen=True)
class HotStatus:
    """What a hot directory holds: published copies (most recent first) and copies in progress."""

    hot_dir: Path
    budget: int
    used: int
    entries: list[HotEntry]
    partial: list[str]


# ---- lock file descriptors, fork-safe ------------------------------------------------------------
# flock locks belong to open file descriptions, which a forked child shares: a child that kept the fd of
# a lock held by one of its parent's threads would hold that lock for its whole life. So every lock fd is
# tracked, and the child closes them (closing, unlike LOCK_UN, leaves the parent's lock in place).
_fd_guard = threading.Lock()
_held_fds: set[int] = set()


def _after_fork_child() -> None:
    global _fd_guard
    _fd_guard = threading.Lock()
    for fd in list(_held_fds):
        with suppress(OSError):
            os.close(fd)
    _held_fds.clear()
    _background.reset()


@overload
def _open_lock(path: Path, *, block: Literal[True]) -> int: ...
@overload
def _open_lock(path: Path, *, block: bool) -> int | None: ...
def _open_lock(path: Path, *, block: bool) -> int | None:
    """Open ``path`` and flock it exclusively; None if ``block`` is False and another holder has it."""
    with _fd_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _held_fds.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
    except BlockingIOError:
        _close_lock(fd)
        return None
    except BaseException:
        _close_lock(fd)
        raise
    return fd


def _close_lock(fd: int) -> None:
    with _fd_guard:
        _held_fds.discard(fd)
        os.close(fd)


class HotShards:
    """A hot-shard directory on local SSD holding at most ``budget`` bytes of shard copies.

    Args:
        hot_dir: the directory (created with mode 0700 if missing).
        budget: bytes that published copies plus copies in progress may take together.
        max_rate: copy throttle in bytes per second (None: as fast as the disks allow).
    """

    def __init__(self, hot_dir: str | Path, budget: int, *, max_rate: int | None = None) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ConfigError(f"hot-shard budget must be a whole number of bytes >= 0, got {budget!r}")
        if max_rate is not None and (isinstance(max_rate, bool) or not isinstance(max_rate, int) or max_rate <= 0):
            raise ConfigError(f"hot-shard max_rate must be a positive number of bytes per second, got {max_rate!r}")
        self.hot_dir = Path(hot_dir).absolute()
        self.budget = budget
        self.max_rate = max_rate
        self._touched: dict[str, float] = {}
        with self._full_disk("preparing the hot-shard directory"):
            self._ensure_dirs()
            with self._evict_lock():
                for path in self.hot_dir.glob("*" + _PARTIAL):
                    self._remove_if_stale(path)

    # ---- paths and locks ---------------------------------------------------------------------
    def _copy_path(self, name: str) -> Path:
        if not name or "/" in name or "\0" in name or name.startswith("."):
            raise StoreError(f"shard name {name!r} is not a plain file name: store.json is damaged; run `medload verify`")
        return self.hot_dir / (name + _COPY)

    def _partial_path(self, name: str) -> Path:
        return self.hot_dir / (name + _PARTIAL)

    def _lock_path(self, name: str) -> Path:
        return self.hot_dir / "locks" / (name + ".lock")

    def _full_disk(self, doing: str) -> AbstractContextManager[None]:
        """A full disk under the hot dir is one DiskFullError; the shards are read from the store meanwhile."""
        return disk_full_is_error(self.hot_dir, "hot-shard copy", doing, _HOT_ADVICE)

    def _ensure_dirs(self) -> None:
        self.hot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.hot_dir / "locks").mkdir(mode=0o700, exist_ok=True)

    @overload
    def _lock(self, path: Path, *, block: Literal[True]) -> int: ...
    @overload
    def _lock(self, path: Path, *, block: bool) -> int | None: ...
    def _lock(self, path: Path, *, block: bool) -> int | None:
        """The fd of ``path``, flocked (see :func:`_open_lock`): a blocking lock always gets one."""
        try:
            return _open_lock(path, block=block)
        except FileNotFoundError:  # the hot dir was deleted under us: recreate it once
            self._ensure_dirs()
            return _open_lock(path, block=block)

    @contextmanager
    def _evict_lock(self) -> Iterator[None]:
        fd = self._lock(self.hot_dir / _EVICT_LOCK, block=True)
        try:
            yield
        finally:
            _close_lock(fd)

    def _remove_if_stale(self, partial: Path) -> int:
        """Delete a ``.partial`` whose copier is gone (its lock is free); returns bytes freed."""
        name = partial.name[: -len(_PARTIAL)]
        fd = self._lock(self._lock_path(name), block=False)
        if fd is None:
            return 0
        try:
            size = partial.stat().st_size
            partial.unlink()
            log.info("removed %s left by an interrupted copy", partial)
            return size
        except FileNotFoundError:
            return 0
        finally:
            _close_lock(fd)

    def _remove_if_same(self, name: str, ino: int) -> None:
        """Delete the published copy of ``name`` under its lock, if it is still the file ``ino``."""
        fd = self._lock(self._lock_path(name), block=True)
        try:
            path = self._copy_path(name)
            if path.stat().st_ino == ino:
                path.unlink()
        except FileNotFoundError:
            pass
        finally:
            _close_lock(fd)

    # ---- reading -----------------------------------------------------------------------------
    def path_of(self, shard: ShardEntry) -> Path | None:
        """The published local copy of ``shard``, or None; records the use for eviction."""
        path = self._copy_path(shard.name)
        try:
            st = os.stat(path)
        except OSError:
            return None
        if st.st_size != shard.bytes:
            return None
        now = time.monotonic()
        if now - self._touched.get(shard.name, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S:
            try:
                os.utime(path)
            except OSError:
                return None
            self._touched[shard.name] = now
        return path

    # ---- copying -----------------------------------------------------------------------------
    def fetch(self, source: Path, shard: ShardEntry) -> Path | None:
        """Copy ``source`` (the shard's ``data.mdb``) into the hot dir, verified; evict to stay in budget.

        Returns the published copy, or None when another thread/process is copying this shard, or the
        shard cannot fit in the budget. Raises ChecksumError when the source does not match ``shard.digest``.
        """
        if (path := self.path_of(shard)) is not None:
            return path
        if shard.bytes > self.budget:
            log.info("shard %s (%d bytes) is larger than the hot-shard budget (%d bytes) of %s: it is read from the "
                     "store; raise the budget to cache it", shard.name, shard.bytes, self.budget, self.hot_dir)
            return None
        with self._full_disk(f"copying shard {shard.name}"):
            self._ensure_dirs()
            fd = self._lock(self._lock_path(shard.name), block=False)
        if fd is None:
            log.debug("shard %s is being copied by another thread or process", shard.name)
            return None
        try:
            if (path := self.path_of(shard)) is not None:
                return path
            with self._full_disk(f"copying shard {shard.name} ({shard.bytes / 1e6:.1f} MB)"):
                if not self._copy(Path(source), shard):
                    return None
        finally:
            _close_lock(fd)
        with self._evict_lock():
            self._make_room(0, keep=shard.name)
        self._touched[shard.name] = time.monotonic()
        path = self._copy_path(shard.name)
        return path if path.exists() else None  # the hot dir may have been deleted meanwhile

    def _copy(self, source: Path, shard: ShardEntry) -> bool:
        """Reserve room, copy to ``.partial`` hashing on the fly, check, publish. Caller holds the shard lock."""
        partial, out = self._partial_path(shard.name), -1
        try:
            with self._evict_lock():
                partial.unlink(missing_ok=True)  # left by a dead copier: we hold its lock now
                if not self._make_room(shard.bytes, keep=None):
                    log.info("no room for shard %s (%d bytes) in %s: copies in progress fill the budget",
                             shard.name, shard.bytes, self.hot_dir)
                    return False
                out = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                _reserve(out, shard.bytes)  # under the lock: others count it from now on
            log.debug("copying shard %s from %s", shard.name, source)
            digest, copied = self._copy_data(source, out, shard.bytes)
            if copied != shard.bytes or digest != shard.digest:
                raise ChecksumError(
                    f"shard {shard.name}: {source} has {copied} bytes with xxh3-128 {digest}, store.json says "
                    f"{shard.bytes} bytes with {shard.digest}: the source store is damaged; run `medload verify`")
            os.fsync(out)
            os.replace(partial, self._copy_path(shard.name))
        except FileNotFoundError as exc:
            partial.unlink(missing_ok=True)
            if exc.filename is not None and Path(exc.filename) == source:
                raise StoreError(f"shard {shard.name}: {source} is missing: the store is damaged or unreachable; "
                                 f"run `medload verify`") from None
            log.warning("hot dir %s vanished while copying shard %s; it is read from the store", self.hot_dir,
                        shard.name)
            return False
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        finally:
            if out >= 0:
                os.close(out)
        fsync_dir(self.hot_dir)
        log.info("copied shard %s (%d bytes) to %s", shard.name, shard.bytes, self.hot_dir)
        return True

    def _copy_data(self, source: Path, out: int, limit: int) -> tuple[str, int]:
        h = xxhash.xxh3_128()
        chunk = _CHUNK if self.max_rate is None else max(64 << 10, min(_CHUNK, self.max_rate // 8))
        buf = bytearray(chunk)
        view = memoryview(buf)
        copied, start = 0, time.monotonic()
        with open(source, "rb", buffering=0) as src:
            sharing_like(os.fstat(src.fileno())).fix_fd(out)
            while n := src.readinto(buf):
                block = view[:n]
                h.update(block)
                written = 0
                while written < n:
                    written += os.write(out, block[written:])
                copied += n
                if copied > limit:  # a source that grew would overrun the reservation
                    break
                if self.max_rate is not None:
                    ahead = copied / self.max_rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
        return h.hexdigest(), copied

    def fetch_in_background(self, source: Path, shard: ShardEntry) -> None:
        """Queue a fetch on this process's background thread; errors are logged, never raised."""
        try:
            if self.path_of(shard) is None and shard.bytes <= self.budget:
                _background.submit(self, Path(source), shard)
        except MedloadError as exc:
            log.warning("not copying shard %s to %s: %s", shard.name, self.hot_dir, exc)

    # ---- eviction ----------------------------------------------------------------------------
    def _listing(self) -> tuple[list[tuple[float, int, str]], list[tuple[str, int]]]:
        """Published copies as (mtime, bytes, name) and partials as (name, bytes); empty if the dir is gone."""
        copies, partials = [], []
        try:
            entries = list(os.scandir(self.hot_dir))
        except FileNotFoundError:
            entries = []
        for e in entries:
            try:
                if e.name.endswith(_PARTIAL):
                    partials.append((e.name[: -len(_PARTIAL)], e.stat().st_size))
                elif e.name.endswith(_COPY) and not e.name.startswith("."):
                    st = e.stat()
                    copies.append((st.st_mtime, st.st_size, e.name[: -len(_COPY)]))
            except FileNotFoundError:
                continue
        return copies, partials

    def _make_room(self, need: int, *, keep: str | None) -> bool:
        """Evict least recently used copies (never ``keep``) until used + need <= budget. Caller holds
        the evict lock. Returns whether that was reached."""
        copies, partials = self._listing()
        used = sum(size for _, size, _ in copies)
        used += sum(size for name, size in partials if self._remove_if_stale(self._partial_path(name)) == 0)
        for _mtime, size, name in sorted(copies):
            if used + need <= self.budget:
                break
            if name == keep:
                continue
            try:
                self._copy_path(name).unlink()
                log.info("evicted shard %s (%d bytes) from %s", name, size, self.hot_dir)
            except FileNotFoundError:
                pass  # dropped meanwhile: its bytes are free all the same
            self._touched.pop(name, None)
            used -= size
        return used + need <= self.budget

    # ---- maintenance -------------------------------------------------------------------------
    def drop(self, name: str) -> None:
        """Remove the published copy of shard ``name`` (e.g. a reader found a damaged value in it)."""
        try:
            ino = self._copy_path(name).stat().st_ino
        except OSError:
            return
        self._remove_if_same(name, ino)
        self._touched.pop(name, None)
        log.info("dropped hot copy of shard %s from %s", name, self.hot_dir)

    def verify(self, shard: ShardEntry) -> bool:
        """Recompute the local copy's xxh3-128; a mismatch (or a missing copy) drops it and returns False."""
        h = xxhash.xxh3_128()
        try:
            with open(self._copy_path(shard.name), "rb", buffering=0) as f:
                ino, size = os.fstat(f.fileno()).st_ino, 0
                buf = bytearray(_CHUNK)
                while n := f.readinto(buf):
                    h.update(memoryview(buf)[:n])
                    size += n
        except FileNotFoundError:
            return False
        if size == shard.bytes and h.hexdigest() == shard.digest:
            return True
        log.warning("hot copy of shard %s in %s is damaged (local disk?): dropping it; it is copied again on "
                    "next use", shard.name, self.hot_dir)
        self._remove_if_same(shard.name, ino)
        self._touched.pop(shard.name, None)
        return False

    def status(self) -> HotStatus:
        """Published copies (most recently used first), partial copies, bytes used."""
        copies, partials = self._listing()
        entries = [HotEntry(name, size, mtime) for mtime, size, name in sorted(copies, reverse=True)]
        used = sum(e.bytes for e in entries) + sum(size for _, size in partials)
        return HotStatus(self.hot_dir, self.budget, used, entries, sorted(name for name, _ in partials))

    def clear(self) -> int:
        """Remove every published copy and stale partial; returns the bytes freed."""
        self._ensure_dirs()
        with self._evict_lock():
            copies, partials = self._listing()
            freed = sum(self._remove_if_stale(self._partial_path(name)) for name, _ in partials)
            for _, size, name in copies:
                self._copy_path(name).unlink(missing_ok=True)
                freed += size
        self._touched.clear()
        log.info("cleared %d bytes from %s", freed, self.hot_dir)
        return freed


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes for a copy up front, so the budget and a full disk show before copying."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


class _Background:
    """One daemon thread per process copying queued shards; a forked child starts its own lazily."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the (parent's) thread and queue without touching them."""
        self.pid, self.lock = os.getpid(), threading.Lock()
        self.pending: set[tuple[Path, str]] = set()  # (hot dir, shard name) queued or being copied
        self.full: set[Path] = set()  # hot dirs whose full disk was reported
        self.queue: queue.SimpleQueue | None = None

    def submit(self, hot: HotShards, source: Path, shard: ShardEntry) -> None:
        if self.pid != os.getpid():  # forked without os.register_at_fork (e.g. by C code)
            self.reset()
        key = (hot.hot_dir, shard.name)
        with self.lock:
            if key in self.pending:
                return
            self.pending.add(key)
            if self.queue is None:
                self.queue = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self.queue, self.pending, self.full, self.lock), daemon=True,
                                 name="medload-hot-shards").start()
            self.queue.put((hot, source, shard, key))

    @staticmethod
    def _run(jobs: queue.SimpleQueue, pending: set, full: set, lock: threading.Lock) -> None:
        while True:
            hot, source, shard, key = jobs.get()
            try:
                hot.fetch(source, shard)
            except DiskFullError as exc:  # said once per hot dir: the loader retries every few seconds
                with lock:
                    first = hot.hot_dir not in full
                    full.add(hot.hot_dir)
                log.log(logging.WARNING if first else logging.DEBUG, "background copy of shard %s failed: %s",
                        shard.name, exc)
            except MedloadError as exc:
                log.warning("background copy of shard %s failed: %s", shard.name, exc)
            except Exception:
                log.exception("background copy of shard %s to %s failed", shard.name, hot.hot_dir)
            finally:
                with lock:
                    pending.discard(key)


_background = _Background()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _fd_guard.acquire(), after_in_parent=lambda: _fd_guard.release(),
                        after_in_child=_after_fork_child)

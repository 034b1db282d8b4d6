"""A full disk, told apart from other write failures and turned into one :class:`~medload.errors.DiskFullError`.

A store's writes are crash-safe (see :mod:`medload.storage.writer`), so a disk that fills up mid-write
loses nothing committed: the write that failed is rolled back, and the same command run again once
there is space writes only what is missing. What is left to do is to say so in one line, naming the
stage and the disk. Two traps of a full disk are closed here too: LMDB reports a write cut short by it
as ``EIO``, and it maps its lock file, which on a full disk kills the process with SIGBUS unless the
file's blocks are allocated first (:func:`allocate_lock_file`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from medload.errors import DiskFullError

__all__ = ["RERUN", "out_of_space", "free_bytes", "disk_full_is_error", "allocate_lock_file"]

#: What to do after a full disk stopped a write to a store.
RERUN = ("free space there, then run the same command again: what was committed before is kept, and the rerun "
         "writes only what is missing")

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A short write (LMDB's EIO) on a disk with less than this free is the disk filling up.
_NEARLY_FULL = 16 << 20
# LMDB's lock file: its header and 126 reader slots (py-lmdb's default max_readers) of 64 bytes, 8 KiB.
# A larger file would only give more reader slots.
_LOCK_FILE_BYTES = 8 << 10


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged process may still write on the filesystem of ``path`` (or of its nearest
    existing parent); None if that cannot be told."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def out_of_space(exc: BaseException, path: str | os.PathLike) -> bool:
    """Whether ``exc``, raised writing under ``path``, means that the disk (or a quota) is full."""
    if isinstance(exc, OSError):
        return exc.errno in _FULL_ERRNOS
    if isinstance(exc, lmdb.DiskError):
        return True
    if isinstance(exc, lmdb.Error) and "Input/output error" in str(exc):  # LMDB: a write cut short
        free = free_bytes(path)
        return free is not None and free < _NEARLY_FULL
    return False


@contextmanager
def disk_full_is_error(path: str | os.PathLike, stage: str, doing: str, advice: str = RERUN) -> Iterator[None]:
    """Turn a full disk met in the block into one DiskFullError: no space on the disk of ``path`` while
    ``doing`` (``stage``, see :class:`~medload.errors.DiskFullError`), then ``advice``."""
    try:
        yield
    except DiskFullError:
        raise
    except (OSError, lmdb.Error) as exc:
        if not out_of_space(exc, path):
            raise
        free = free_bytes(path)
        left = "" if free is None else f" ({free / 1e6:.1f} MB free)"
        raise DiskFullError(f"no space left on the disk of {path}{left} while {doing}: {advice}", stage,
                            str(path)) from exc


def allocate_lock_file(env_dir: Path) -> None:
    """Allocate the blocks of the LMDB lock file of the environment in ``env_dir`` before LMDB maps it,
    so that a full disk fails here with ENOSPC instead of killing the process with SIGBUS later."""
    fd = os.open(env_dir / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < _LOCK_FILE_BYTES:
            try:
                os.posix_fallocate(fd, 0, _LOCK_FILE_BYTES)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                zeros, done = bytes(_LOCK_FILE_BYTES), 0  # no fallocate here: writing zeros allocates the blocks
                while done < len(zeros):  # a short write is followed by one that raises ENOSPC
                    done += os.pwrite(fd, zeros[done:], done)
    finally:
        os.close(fd)

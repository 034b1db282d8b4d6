"""LMDB environments of one shard: how they are opened, and the named sub-databases they hold.

Follows py-lmdb's "Forking & multiprocessing" rules: a writer environment is opened by the one writer
process only; readers open published shards read-only with ``lock=False`` (they are immutable, so no
reader table is needed) and ``readahead=False`` (random slab reads should not pull neighbours from
disk), and never use an environment across ``fork`` (see :mod:`medload.storage.store`).

LMDB maps the file, and reading a page past its end kills the process (SIGBUS) instead of raising. So
a reader that knows the size ``store.json`` records opens a shard only when its ``data.mdb`` has that
size, and keeps it only when the file holds every page its meta page counts.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path

import lmdb

from medload.errors import ShardUnavailableError, StorePermissionError
from medload.storage.sharing import share_command
from medload.storage.space import allocate_lock_file
from medload.storage.value_reads import forget

__all__ = ["SLICES", "LABELS", "LABEL_SERIES", "SERIES", "REJECTS", "REPLACED", "INDEXES", "window_db", "open_write_env",
           "open_read_env", "reader_env", "close_reader_envs", "env_bytes", "open_dbs", "written_db_names", "reserve"]

SLICES = b"slices"
LABELS = b"labels"
LABEL_SERIES = b"label_series"
SERIES = b"series"
REJECTS = b"rejects"
#: series keys whose copies in earlier shards this shard's copy replaces (see :mod:`medload.storage.live`)
REPLACED = b"replaced"
#: index sub-databases: an attribute value -> series keys (sorted duplicates)
INDEXES = {"modality": b"idx_modality", "study": b"idx_study", "patient": b"idx_patient", "body_part": b"idx_body_part"}
_MAX_DBS = 64
#: the handle of a named sub-database, as ``Environment.open_db`` returns it (py-lmdb names its class privately)
DbHandle = lmdb._Database
_MAP_HEADROOM = 1 << 30


def window_db(name: str) -> bytes:
    """Sub-database of the pre-windowed uint8 planes of window ``name``."""
    return b"win_" + name.encode()


def open_write_env(path: Path, map_size: int) -> lmdb.Environment:
    """Open (creating if needed) the environment of a shard being written; owner-only permissions;
    every commit synced to disk. A new environment that cannot be created (a full disk) leaves nothing."""
    created = not path.exists()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        allocate_lock_file(path)  # a full disk: ENOSPC now, not SIGBUS when LMDB touches its mapped lock file
        return lmdb.open(
            str(path), map_size=map_size, max_dbs=_MAX_DBS, subdir=True, sync=True, metasync=True,
            readahead=False, mode=0o600,
        )
    except BaseException:
        if created:
            shutil.rmtree(path, ignore_errors=True)
        raise


def open_read_env(path: Path, expected_bytes: int | None = None) -> lmdb.Environment:
    """Open a published (immutable) shard for reading: a shard directory, or a single-file copy of
    its ``data.mdb`` (as the hot-shard tier keeps them). With ``expected_bytes`` (what ``store.json``
    records), a file of another size is not opened at all. :class:`ShardUnavailableError` says why a
    shard cannot be opened: missing, another size, not an LMDB file, fewer pages than LMDB counts;
    :class:`StorePermissionError` that this user may not read it (the shard is fine: its owner shares it)."""
    single_file = path.suffix == ".mdb"
    data = path if single_file else path / "data.mdb"
    try:
        info = os.stat(data)
    except FileNotFoundError:
        raise ShardUnavailableError(f"{data.name} is missing") from None
    except PermissionError:
        info = None
    if info is None or not os.access(data, os.R_OK):
        whose = "its owner to give it g+r" if single_file else (
            f"the store's owner to run {share_command(path.parent.parent)} with a group you are in")
        raise StorePermissionError(f"cannot read {data}: permission denied: ask {whose}")
    if not stat.S_ISREG(info.st_mode):
        raise ShardUnavailableError(f"{data.name} is missing (not a file)")
    size = info.st_size
    if expected_bytes is not None and size != expected_bytes:
        raise ShardUnavailableError(f"{data.name} has {size} bytes, store.json records {expected_bytes} (truncated or "
                                    "replaced); it is not opened, as reading past its end would kill the reader")
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_dbs=_MAX_DBS,
                        subdir=not single_file, create=False)
    except lmdb.Error as exc:
        raise ShardUnavailableError(f"LMDB cannot open it ({exc})") from None
    needed = env_bytes(env)
    if size < needed:
        env.close()
        raise ShardUnavailableError(f"{data.name} is truncated: {size} bytes, LMDB needs {needed}")
    return env


_readers: dict[Path, lmdb.Environment] = {}
_readers_pid = os.getpid()
_readers_lock = threading.Lock()  # a loader worker opens shards from its read-ahead thread and its main one


def _new_lock_in_child() -> None:
    global _readers_lock
    _readers_lock = threading.Lock()  # a lock some parent thread held at the fork would stay held


os.register_at_fork(after_in_child=_new_lock_in_child)


def reader_env(path: Path, expected_bytes: int | None = None) -> lmdb.Environment:
    """The read-only environment of a published shard, opened once per process (the first open checks
    the file, see :func:`open_read_env`).

    LMDB allows one handle per environment and process, so every :class:`~medload.storage.Store` of a
    process shares these. After a ``fork`` the child closes the handles it inherited and opens its own:
    py-lmdb refuses a second open of files a handle still holds, and an inherited handle stays alive
    wherever the parent's objects referenced it (a thread's frame, a cursor), so merely dropping them
    let a DataLoader worker fail now and then with "already open in this process". Closing is safe
    for the parent: these handles are read-only without a lock file (``lock=False``), so closing one
    only unmaps the child's copy.
    """
    global _readers_pid
    path = path.absolute()
    with _readers_lock:  # two threads opening one shard: LMDB refuses the second ("already open")
        if _readers_pid != os.getpid():
            for inherited in _readers.values():
                inherited.close()
            _readers.clear()
            _readers_pid = os.getpid()
        env = _readers.get(path)
        if env is None:
            env = _readers[path] = open_read_env(path, expected_bytes)
        return env


def close_reader_envs(paths: list[Path]) -> None:
    """Close this process's handles on these shards (they reopen on next use)."""
    if _readers_pid != os.getpid():
        return
    for path in paths:
        with _readers_lock:
            env = _readers.pop(path.absolute(), None)
        if env is not None:
            forget(path)
            env.close()


def open_dbs(env: lmdb.Environment, names: list[bytes], *, create: bool, txn: lmdb.Transaction | None = None) -> dict[bytes, DbHandle]:
    """Handles of named sub-databases; index databases are opened with sorted duplicates."""
    index_names = set(INDEXES.values())
    out: dict[bytes, DbHandle] = {}
    for name in names:
        if not create:
            try:
                out[name] = env.open_db(name, txn=txn, create=False, dupsort=name in index_names)
            except lmdb.NotFoundError:
                continue
        else:
            out[name] = env.open_db(name, txn=txn, create=True, dupsort=name in index_names)
    return out


def env_bytes(env: lmdb.Environment) -> int:
    """Bytes in use in an environment's data file."""
    info, stat = env.info(), env.stat()
    return (info["last_pgno"] + 1) * stat["psize"]


def written_db_names(windows: tuple[str, ...] | list[str]) -> list[bytes]:
    """Every sub-database a shard being written holds, for a store with these ``windows``."""
    return [SLICES, LABELS, LABEL_SERIES, SERIES, REJECTS, REPLACED, *INDEXES.values(), *(window_db(w) for w in windows)]


def reserve(env: lmdb.Environment, estimated_bytes: int) -> None:
    """Grow the map of a shard being written so that ``estimated_bytes`` more fit, with room to spare
    (call it between transactions: LMDB refuses to resize under an open one)."""
    needed = env_bytes(env) + 2 * estimated_bytes + _MAP_HEADROOM
    if env.info()["map_size"] < needed:
        env.set_mapsize(needed)

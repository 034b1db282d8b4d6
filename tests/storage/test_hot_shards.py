"""The hot-shard directory on real LMDB shards: verified copies, LRU budget, crashes, concurrency, fork."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medload.errors import ChecksumError
from medload.storage import shard as sh
from medload.storage.cache.hot_shards import HotShards
from medload.storage.codec import decode_value, encode_value, get_codec
from medload.storage.keys import series_key, slice_key
from medload.storage.manifest import ShardEntry, file_digest, read_manifest, shard_path
from medload.storage.records import SeriesRecord
from medload.storage.writer import StoreWriter

REPO = Path(__file__).resolve().parents[2]
# (slices, rows, cols) of each series; with shard_bytes=1 each is its own shard; the last is ~3 MB
SHAPES = [(2, 32, 32), (3, 48, 48), (4, 64, 64), (2, 96, 96), (5, 40, 40), (6, 512, 512)]
BIG = len(SHAPES) - 1


def _record(key: bytes, depth: int, rows: int, cols: int) -> SeriesRecord:
    return SeriesRecord(key=key.hex(), shape=(depth, rows, cols), dtype="int16", spacing=(1.0, 1.0, 2.0),
                        affine=tuple(tuple(r) for r in np.eye(4).tolist()), modality="CT", digest="d",
                        orientation=(1, 0, 0, 0, 1, 0), positions=tuple((0.0, 0.0, 2.0 * z) for z in range(depth)),
                        patient="p", study="s", series="x", source_fingerprint="f" + key.hex(),
                        sources=tuple("0" * 16 for _ in range(depth)))


class Fixture:
    def __init__(self, root: Path) -> None:
        rng = np.random.default_rng(7)
        codec = get_codec("blosc2-lz4")
        self.root = root
        self.volumes: list[tuple[bytes, np.ndarray]] = []
        with StoreWriter(root, codec="blosc2-lz4", windows=(), key_fingerprint="k", shard_bytes=1) as writer:
            for i, shape in enumerate(SHAPES):
                key, vol = series_key(f"p{i}", "d"), rng.integers(-1024, 3000, shape).astype(np.int16)
                txn = writer.begin_series(key, vol.nbytes)
                for z, plane in enumerate(vol):
                    txn.put_slice(z, encode_value(plane, codec))
                txn.commit(_record(key, *shape), {"modality": "CT"})
                self.volumes.append((key, vol))
        self.shards: list[ShardEntry] = read_manifest(root).shards  # in series order: one shard each

    def source(self, i: int) -> Path:
        return shard_path(self.root, self.shards[i].name) / "data.mdb"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Fixture:
    return Fixture(tmp_path_factory.mktemp("store") / "s")


def _on_disk(hot: Path) -> tuple[set[str], int]:
    names = {p.name[:-4] for p in hot.glob("*.mdb")}
    return names, sum(p.stat().st_size for p in [*hot.glob("*.mdb"), *hot.glob("*.mdb.partial")])


def _read_slice(env: lmdb.Environment, key: bytes, z: int) -> np.ndarray:
    with env.begin(buffers=True) as txn:
        db = sh.open_dbs(env, [sh.SLICES], create=False, txn=txn)[sh.SLICES]
        return decode_value(txn.get(slice_key(key, z), db=db))


def _open_copy(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False, max_dbs=64)


def _wait_for(predicate, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_fetch_publishes_a_verified_copy_that_lmdb_reads(store, tmp_path):
    hs = HotShards(tmp_path / "hot", 1 << 30)
    assert (tmp_path / "hot").stat().st_mode & 0o777 == 0o700
    entry = store.shards[2]
    assert hs.path_of(entry) is None
    path = hs.fetch(store.source(2), entry)
    assert path == tmp_path / "hot" / f"{entry.name}.mdb" and hs.path_of(entry) == path
    assert path.read_bytes() == store.source(2).read_bytes() and file_digest(path) == entry.digest
    assert path.stat().st_mode & 0o777 == 0o600
    assert hs.fetch(store.source(2), entry) == path  # already published: no copy
    key, vol = store.volumes[2]
    env = _open_copy(path)
    try:
        src_env = sh.reader_env(shard_path(store.root, entry.name))
        for z in range(len(vol)):
            assert np.array_equal(_read_slice(env, key, z), _read_slice(src_env, key, z))
            assert np.array_equal(_read_slice(env, key, z), vol[z])
    finally:
        env.close()
    assert hs.verify(entry)
    assert not list((tmp_path / "hot").glob("*.partial"))


def test_a_copy_is_as_readable_as_the_shard_it_copies(store, tmp_path):
    """A shard of a store shared with a group (0640, the group's) gives its copy the same; a private one 0600."""
    entry = store.shards[1]
    shared = tmp_path / "shared.mdb"
    shutil.copyfile(store.source(1), shared)
    shared.chmod(0o640)
    group = os.getegid() if os.geteuid() else 4242  # root may give any group
    os.chown(shared, -1, group)
    copy = HotShards(tmp_path / "hot", 1 << 30).fetch(shared, entry)
    assert copy is not None and (copy.stat().st_mode & 0o777, copy.stat().st_gid) == (0o640, group)
    private = HotShards(tmp_path / "hot2", 1 << 30).fetch(store.source(1), entry)
    assert private is not None and private.stat().st_mode & 0o777 == 0o600


def test_shard_over_budget_and_wrong_size_copy_are_refused(store, tmp_path):
    hs = HotShards(tmp_path / "hot", store.shards[0].bytes - 1)
    assert hs.fetch(store.source(0), store.shards[0]) is None
    assert _on_disk(tmp_path / "hot") == (set(), 0)
    (tmp_path / "hot" / f"{store.shards[0].name}.mdb").write_bytes(b"not a shard")
    assert hs.path_of(store.shards[0]) is None


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(0, BIG - 1), min_size=1, max_size=14), st.integers(0, 3))
def test_budget_holds_and_lru_survive(store, accesses, slack):
    sizes = {s.name: s.bytes for s in store.shards[:BIG]}
    budget = sorted(sizes.values())[-1] + sorted(sizes.values())[0] + slack * 4096  # ~2 copies fit
    base = time.time() - 100_000
    with tempfile.TemporaryDirectory() as tmp:
        hot = Path(tmp) / "hot"
        hs = HotShards(hot, budget)
        model: list[str] = []  # least recently used first
        for t, i in enumerate(accesses):
            entry = store.shards[i]
            path = hs.fetch(store.source(i), entry)
            assert path is not None
            os.utime(path, (base + t, base + t))
            if entry.name in model:
                model.remove(entry.name)
            else:
                used = sum(sizes[n] for n in model)
                while used + entry.bytes > budget:
                    used -= sizes[model.pop(0)]
            model.append(entry.name)
            names, total = _on_disk(hot)
            assert total <= budget
            assert names == set(model)
            assert hs.path_of(entry) == path
        status = hs.status()
        assert [e.name for e in status.entries] == model[::-1] and status.used == sum(sizes[n] for n in model)


_FETCH = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    from medload.storage.cache.hot_shards import HotShards
    from medload.storage.manifest import ShardEntry, file_digest
    hot, src, entry, rate, go = sys.argv[1], sys.argv[2], ShardEntry(**json.loads(sys.argv[3])), int(sys.argv[4]), sys.argv[5]
    copies = []
    handler = logging.Handler()
    handler.emit = lambda record: copies.append(record.msg)
    logging.getLogger("medload").addHandler(handler)
    logging.getLogger("medload").setLevel(logging.DEBUG)
    hs = HotShards(hot, 1 << 30, max_rate=rate)
    print("ready", flush=True)
    while go and not Path(go).exists():
        time.sleep(0.002)
    got = hs.fetch(Path(src), entry)
    bad = seen = 0
    end = time.monotonic() + 20
    while time.monotonic() < end:
        p = hs.path_of(entry)
        if p is not None:
            seen += 1
            bad += p.suffix != ".mdb" or file_digest(p) != entry.digest
            break
        time.sleep(0.005)
    copied = sum(m.startswith("copying shard") for m in copies)
    print(json.dumps({"fetched": got is not None, "copied": copied, "seen": seen, "bad": bad}), flush=True)
""")


def _spawn(hot: Path, src: Path, entry: ShardEntry, rate: int, go: str = "") -> subprocess.Popen:
    doc = json.dumps({"name": entry.name, "series": entry.series, "bytes": entry.bytes, "digest": entry.digest})
    proc = subprocess.Popen([sys.executable, "-c", _FETCH, str(hot), str(src), doc, str(rate), go], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_kill_9_during_copy_leaves_only_a_partial_that_is_cleaned(store, tmp_path):
    hot, entry = tmp_path / "hot", store.shards[BIG]
    assert entry.bytes > 2 << 20
    proc = _spawn(hot, store.source(BIG), entry, 1 << 20)
    partial = hot / f"{entry.name}.mdb.partial"
    try:
        assert _wait_for(partial.exists)
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert {p.name for p in hot.iterdir() if p.is_file()} == {partial.name, ".evict.lock"}
    hs = HotShards(hot, 1 << 30)
    assert not partial.exists()  # the dead copier's lock is free: stale
    assert hs.path_of(entry) is None
    path = hs.fetch(store.source(BIG), entry)
    assert path is not None and file_digest(path) == entry.digest and not partial.exists()


def test_two_processes_fetching_one_shard_copy_once(store, tmp_path):
    hot, entry, go = tmp_path / "hot", store.shards[BIG], tmp_path / "go"
    procs = [_spawn(hot, store.source(BIG), entry, 2 << 20, str(go)) for _ in range(2)]
    go.touch()
    results = [json.loads(p.communicate(timeout=30)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted((r["fetched"], r["copied"]) for r in results) == [(False, 0), (True, 1)]
    assert all(r["seen"] == 1 and r["bad"] == 0 for r in results)
    assert file_digest(HotShards(hot, 1 << 30).path_of(entry)) == entry.digest and not list(hot.glob("*.partial"))


def test_two_threads_fetching_one_shard_copy_once(store, tmp_path):
    hs, entry = HotShards(tmp_path / "hot", 1 << 30, max_rate=8 << 20), store.shards[BIG]
    barrier, results = threading.Barrier(2), []

    def fetch() -> None:
        barrier.wait()
        results.append(hs.fetch(store.source(BIG), entry))

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=lambda r: r is not None) == [None, tmp_path / "hot" / f"{entry.name}.mdb"]


def test_corrupt_source_raises_and_leaves_nothing(store, tmp_path):
    entry = store.shards[3]
    bad = tmp_path / "data.mdb"
    shutil.copyfile(store.source(3), bad)
    with open(bad, "r+b") as f:
        f.seek(entry.bytes // 2)
        byte = f.read(1)[0]
        f.seek(entry.bytes // 2)
        f.write(bytes([byte ^ 0x10]))
    hs = HotShards(tmp_path / "hot", 1 << 30)
    with pytest.raises(ChecksumError, match=rf"{entry.name}.*damaged.*medload verify"):
        hs.fetch(bad, entry)
    assert _on_disk(tmp_path / "hot") == (set(), 0) and hs.status().used == 0


def test_damaged_hot_copy_is_dropped_by_verify_and_fetched_again(store, tmp_path):
    entry = store.shards[1]
    hs = HotShards(tmp_path / "hot", 1 << 30)
    path = hs.fetch(store.source(1), entry)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    assert not hs.verify(entry) and not path.exists() and hs.path_of(entry) is None
    assert hs.fetch(store.source(1), entry) == path and hs.verify(entry)
    hs.drop(entry.name)
    assert not path.exists()
    hs.drop(entry.name)  # missing is fine


def test_hot_dir_deleted_under_an_open_env(store, tmp_path):
    hot, entry = tmp_path / "hot", store.shards[4]
    hs = HotShards(hot, 1 << 30)
    env = _open_copy(hs.fetch(store.source(4), entry))
    try:
        shutil.rmtree(hot)
        key, vol = store.volumes[4]
        assert all(np.array_equal(_read_slice(env, key, z), vol[z]) for z in range(len(vol)))
        assert hs.path_of(entry) is None
        assert hs.status().entries == [] and hs.clear() == 0
        path = hs.fetch(store.source(4), entry)
        assert path is not None and file_digest(path) == entry.digest and (hot / "locks").is_dir()
    finally:
        env.close()


def test_fetch_in_background_and_in_a_forked_child(store, tmp_path):
    hs = HotShards(tmp_path / "hot", 1 << 30)
    hs.fetch_in_background(store.source(0), store.shards[0])
    hs.fetch_in_background(store.source(0), store.shards[0])  # deduplicated
    assert _wait_for(lambda: hs.path_of(store.shards[0]) is not None)
    pid = os.fork()
    if pid == 0:  # child: the parent's thread does not exist here; a new one must start
        code = 1
        try:
            hs.fetch_in_background(store.source(1), store.shards[1])
            code = 0 if _wait_for(lambda: hs.path_of(store.shards[1]) is not None, 10) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert file_digest(hs.path_of(store.shards[1])) == store.shards[1].digest
    missing = ShardEntry("nope", 1, 10, "0" * 32)
    hs.fetch_in_background(tmp_path / "missing.mdb", missing)  # logged, never raised
    time.sleep(0.05)
    assert hs.path_of(missing) is None and not list((tmp_path / "hot").glob("*.partial"))


def test_a_forked_child_does_not_keep_the_parents_copy_lock(store, tmp_path):
    hs, entry = HotShards(tmp_path / "hot", 1 << 30, max_rate=8 << 20), store.shards[BIG]
    hs.fetch_in_background(store.source(BIG), entry)
    assert _wait_for((tmp_path / "hot" / f"{entry.name}.mdb.partial").exists)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # holds copies of the parent's fds while it lives, unless they were closed at fork
        os.read(r, 1)
        os._exit(0)
    try:
        assert _wait_for(lambda: hs.path_of(entry) is not None)
        hs.drop(entry.name)
        assert hs.fetch(store.source(BIG), entry) is not None  # the lock is free although the child lives
    finally:
        os.write(w, b"x")
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def test_status_and_clear(store, tmp_path):
    hot = tmp_path / "hot"
    hs = HotShards(hot, 1 << 30)
    for i in (0, 2):
        hs.fetch(store.source(i), store.shards[i])
    os.utime(hot / f"{store.shards[0].name}.mdb", (1, 1))
    (hot / "stale.mdb.partial").write_bytes(b"x" * 1000)  # its copier is gone: nobody holds its lock
    status = hs.status()
    assert status.hot_dir == hot and status.budget == 1 << 30 and status.partial == ["stale"]
    assert [(e.name, e.bytes) for e in status.entries] == [(store.shards[i].name, store.shards[i].bytes) for i in (2, 0)]
    assert status.used == store.shards[0].bytes + store.shards[2].bytes + 1000
    assert hs.clear() == status.used
    assert hs.status().used == 0 and hs.status().entries == [] and hs.status().partial == []

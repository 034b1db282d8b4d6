"""Read observers on a real store: what each hook hears, per tier, and that a Store without one, or a
copy of it in another process, hears nothing. The public reads the datasets use (``planes(transient=)``,
``prefetch``, ``prefetch_labels``) instead of the Store's private methods."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers.labelled_store import make_labelled_store

from medload.config import CacheConfig, IngestConfig
from medload.ingest import ingest
from medload.storage.cache.lru import shared_lru
from medload.storage.manifest import shard_path
from medload.storage.observe import ReadObserver
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


class Recorder(ReadObserver):
    """Every hook call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def read(self, slices, seconds):
        self.calls.append(("read", slices, seconds))

    def l1(self, hits, fills):
        self.calls.append(("l1", hits, fills))

    def range_read(self, tier, slices, nbytes, seconds):
        self.calls.append(("range_read", tier, slices, nbytes, seconds))

    def decoded(self, seconds):
        self.calls.append(("decoded", seconds))

    def of(self, hook: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == hook]


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("observe")
    make_series(root / "src", SeriesSpec(n_slices=10, rows=24, cols=20), seed=1, series_number=1)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


def test_hooks_hear_l1_misses_range_reads_and_decoding_then_hits(store_path):
    shared_lru(0).clear()
    store = open_store(store_path, cache="10MB")
    key = store.series()[0].key
    rec = store.observe(Recorder())
    assert store.observe(rec) is rec  # registering it again does nothing
    cold = store.read(key, 2, 7)
    assert [c[0] for c in rec.calls] == ["decoded"] * 5 + ["range_read", "l1", "read"]  # one range scan of 5
    (_, tier, slices, nbytes, scan_s), = rec.of("range_read")
    assert (tier, slices) == ("l3", 5) and nbytes > 0 and scan_s >= sum(c[1] for c in rec.of("decoded")) > 0
    assert rec.of("l1") == [("l1", 0, 5)] and rec.of("read")[0][1] == 5 and rec.of("read")[0][2] >= scan_s
    rec.calls.clear()
    assert np.array_equal(store.planes(key, 0, 3)[2], cold[0])  # slices 0, 1 from disk, 2 from the L1
    assert rec.of("l1") == [("l1", 1, 2)] and [c[2] for c in rec.of("range_read")] == [2]
    store.unobserve(rec)
    rec.calls.clear()
    store.read(key, 0, 10)
    assert rec.calls == [] and store._observers is None
    store.unobserve(rec)  # not registered: nothing to do


def test_an_observer_hears_its_own_store_object_only_and_is_not_pickled(store_path):
    shared_lru(0).clear()
    a, b = open_store(store_path, cache=0), open_store(store_path, cache=0)
    rec, other = a.observe(Recorder()), a.observe(Recorder())
    b.read(b.series()[0].key, 0, 2)
    assert rec.calls == []
    a.read(a.series()[0].key, 0, 2)
    assert rec.of("read") == other.of("read") != [] and rec.of("l1") == []  # no L1 here: nothing to hear of it
    copy = pickle.loads(pickle.dumps(a))  # as a DataLoader worker gets it
    assert copy._observers is None
    copy.read(copy.series()[0].key, 0, 2)
    assert len(rec.of("read")) == 1


def test_a_hot_copy_is_heard_as_l2(store_path, tmp_path):
    store = open_store(store_path, CacheConfig(l1_bytes=0, hot_dir=tmp_path / "hot", hot_budget=1 << 30, fetch="never"))
    for entry in store.manifest.shards:
        assert store._tiers.hot.fetch(shard_path(store.path, entry.name) / "data.mdb", entry) is not None
    rec = store.observe(Recorder())
    store.read(store.series()[0].key, 0, 4)
    assert [c[1:3] for c in rec.of("range_read")] == [("l2", 4)]


def test_transient_planes_and_label_read_ahead_through_public_methods(tmp_path):
    """What the datasets call: ``planes(..., transient=True)`` (slices the L1 does not keep go to this
    thread's scratch buffer, reused by its next transient read) and ``prefetch_labels``."""
    store = open_store(make_labelled_store(tmp_path, patients=1), cache=0)
    rec = store.series()[0]
    first = store.planes(rec.key_bytes, 0, 3, transient=True)
    assert np.array_equal(np.stack(first), store.read(rec.key, 0, 3))
    again = store.planes(rec.key, 3, 6, transient=True)
    assert np.shares_memory(first[0], again[0]) and np.array_equal(first[0], store.read(rec.key, 3, 4)[0])
    assert not np.shares_memory(store.planes(rec.key, 0, 1)[0], store.planes(rec.key, 0, 1)[0])  # new arrays
    rec_observer = store.observe(Recorder())
    store.prefetch_labels([(rec.key_bytes, 0, 4)])  # a hint to the kernel: nothing is read or decoded here
    store.prefetch([(rec.key, 0, 4)], labels=True)
    assert rec_observer.calls == []
    assert store.read_label(rec.key, 0, 4).shape == (4, *rec.shape[1:])

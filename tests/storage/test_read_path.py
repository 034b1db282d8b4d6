"""The read path: L1 LRU of decoded slices, tier statistics, range reads, DataLoader workers."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from medload.config import CacheConfig
from medload.errors import ConfigError
from medload.storage.cache.lru import SliceLRU, shared_lru
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """A store with two small CT series, and the ground truth of each (keyed by series key)."""
    from medload.config import IngestConfig
    from medload.ingest import ingest

    root = tmp_path_factory.mktemp("read")
    gens = [make_series(root / "src", SeriesSpec(n_slices=n, rows=24, cols=20), seed=s, series_number=s)
            for n, s in ((12, 1), (7, 2))]
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, windows=("lung",)))
    return root / "store", gens


def _truth(store, gens) -> dict[str, np.ndarray]:
    return {r.key: next(g.hu for g in gens if g.hu.shape == r.shape) for r in store.series()}


class _ModelLRU:
    """A reference LRU by bytes: what SliceLRU must do, written the obvious way."""

    def __init__(self, budget: int) -> None:
        self.budget, self.items, self.hits, self.misses, self.evictions = budget, OrderedDict(), 0, 0, 0

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def put(self, key, size: int) -> None:
        if size > self.budget:
            return
        self.items[key] = size
        while sum(self.items.values()) > self.budget:
            self.items.popitem(last=False)
            self.evictions += 1


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 4000), accesses=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 12)), max_size=80))
def test_lru_never_exceeds_its_budget_and_counts_exactly(budget, accesses):
    lru, model = SliceLRU(budget), _ModelLRU(budget)
    sizes: dict[int, int] = {}
    for key, rows in accesses:
        rows = sizes.setdefault(key, rows)  # a key always names the same slice
        array = np.full((rows, 50), key, dtype=np.int16)  # 100 bytes per row
        hit = lru.get(("shard", b"slices", bytes([key])))
        assert (hit is not None) == model.get(key)
        if hit is None:
            lru.put(("shard", b"slices", bytes([key])), array)
            model.put(key, array.nbytes)
        else:
            assert np.array_equal(hit, array) and not hit.flags.writeable
        stats = lru.stats()
        assert stats.bytes <= budget
        assert (stats.hits, stats.misses, stats.evictions) == (model.hits, model.misses, model.evictions)


def test_reads_through_l1_equal_store_reads_and_are_counted(store_path):
    path, gens = store_path
    plain = open_store(path, CacheConfig(l1_bytes=0))
    cached = open_store(path, CacheConfig(l1_bytes=10 << 20))
    shared_lru(10 << 20).clear()  # slices of identical content read by other tests would be hits here
    before = cached.stats()["l1"]
    for key, hu in _truth(plain, gens).items():
        assert np.array_equal(plain.read(key), hu)
        for z0 in range(len(hu)):
            for z1 in range(z0 + 1, min(len(hu), z0 + 4) + 1):
                expected = hu[z0:z1]
                assert np.array_equal(cached.read(key, z0, z1), expected)  # partly hits, partly runs
                got = cached.read(key, z0, z1)
                got[...] = 0  # a caller may scribble on what it gets; the cache must not change
                assert np.array_equal(cached.read(key, z0, z1), expected)
    after = cached.stats()
    assert after["l1"]["hits"] > before["hits"] and after["l1"]["bytes"] <= 10 << 20
    assert after["l3"]["hits"] == 12 + 7  # every slice came from the store exactly once
    assert after["l2"] is None  # no hot directory configured


def test_planes_hand_out_the_cached_arrays_without_copying_them(store_path):
    path, gens = store_path
    plain = open_store(path, CacheConfig(l1_bytes=0))
    cached = open_store(path, CacheConfig(l1_bytes=10 << 20))
    shared_lru(10 << 20).clear()
    for key, hu in _truth(plain, gens).items():
        fresh = plain.planes(key, 2, 6)  # no L1: decoded into new arrays, the caller's to keep
        assert len(fresh) == 4 and all(p.flags.writeable for p in fresh)
        assert np.array_equal(np.stack(fresh), hu[2:6])
        cached.read(key, 3, 5)  # slices 3 and 4 now in L1; 2 and 5 not
        first = cached.planes(key, 2, 6)
        assert np.array_equal(np.stack(first), hu[2:6])
        # hits are the cached arrays; slices 2 and 5 were decoded into arrays the L1 then kept as they are
        assert not any(p.flags.writeable for p in first)
        again = cached.planes(key, 2, 6)
        assert all(a is b for a, b in zip(first, again))  # the cached arrays themselves: no copy, ever
        with pytest.raises(ValueError, match="read-only"):
            again[0][0, 0] = 1
        with pytest.raises(ConfigError, match="outside series"):
            cached.planes(key, 0, len(hu) + 1)


def test_l1_budget_smaller_than_a_slab_still_reads_correctly(store_path):
    """Run in a fresh process: the process-wide L1 takes the largest budget any Store asked for."""
    path, gens = store_path
    key, hu = next(iter(_truth(open_store(path), gens).items()))
    np.save(path.parent / "expected.npy", hu[0:6])
    script = textwrap.dedent(f"""
        import numpy as np
        from medload.config import CacheConfig
        from medload.storage.store import open_store
        store = open_store({str(path)!r}, CacheConfig(l1_bytes=2 * 24 * 20 * 2))  # room for two slices
        expected = np.load({str(path.parent / 'expected.npy')!r})
        for _ in range(3):
            assert np.array_equal(store.read({key!r}, 0, 6), expected)
        l1 = store.stats()["l1"]
        assert l1["budget"] == 1920 and 0 < l1["bytes"] <= 1920 and l1["evictions"] > 0, l1
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0


def test_window_planes_and_hu_are_cached_apart(store_path):
    path, gens = store_path
    store = open_store(path, "1MB")
    key = store.series()[0].key
    hu, lung = store.read(key, 0, 3), store.read(key, 0, 3, plane="lung")
    assert hu.dtype == np.int16 and lung.dtype == np.uint8
    assert np.array_equal(store.read(key, 0, 3, plane="lung"), lung) and np.array_equal(store.read(key, 0, 3), hu)


def test_window_is_the_deprecated_spelling_of_plane(store_path):
    """``window=`` still reads the stored plane, with a DeprecationWarning that points at the caller."""
    path, _ = store_path
    store = open_store(path, "1MB")
    key = store.series()[0].key
    old_spellings = {
        "read": (lambda **kw: store.read(key, 1, 4, **kw), np.array_equal),
        "planes": (lambda **kw: store.planes(key, 1, 4, **kw), lambda a, b: all(map(np.array_equal, a, b))),
        "plane_dtype": (lambda **kw: store.plane_dtype(key, **kw), lambda a, b: a == b == np.uint8),
        "prefetch": (lambda **kw: store.prefetch([(key, 1, 4)], **kw), lambda a, b: a is b is None),
    }
    for method, (call, same) in old_spellings.items():
        with pytest.warns(DeprecationWarning, match=rf"Store\.{method}\(window=.*plane='lung'") as caught:
            old = call(window="lung")
        assert caught[0].filename == __file__, f"{method}: the warning should name the caller's line"
        assert same(old, call(plane="lung")), method
        with pytest.raises(ConfigError, match="alone"):
            call(plane="lung", window="lung")
    assert not np.array_equal(store.read(key, 1, 4, plane="lung"), store.read(key, 1, 4))


def test_read_label_without_labels_says_how_to_get_them(store_path):
    path, _ = store_path
    store = open_store(path)
    with pytest.raises(Exception, match="--labels"):
        store.read_label(store.series()[0].key)


class _SlabDataset(torch.utils.data.Dataset):
    """(series, z) → the 3-slice stack around z, clipped to the series: what a 2.5D loader asks."""

    def __init__(self, store) -> None:
        self.store = store
        self.items = [(r.key, z) for r in store.series() for z in range(r.shape[0] - 2)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        key, z = self.items[i]
        return torch.from_numpy(self.store.read(key, z, z + 3))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_return_exactly_the_direct_reads(store_path, method):
    path, _ = store_path
    store = open_store(path, "4MB")
    dataset = _SlabDataset(store)
    direct = [store.read(key, z, z + 3) for key, z in dataset.items]
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2,
                                         multiprocessing_context=mp.get_context(method))
    got = torch.cat(list(loader)).numpy()
    assert np.array_equal(got, np.stack(direct))


def test_readers_never_see_a_half_written_series(tmp_path):
    """One process ingests series after series (each publishing its own shard) while another keeps
    re-reading the manifest: every series it can see is complete and matches its digest."""
    src = tmp_path / "src"
    for s in range(6):
        make_series(src / f"s{s}", SeriesSpec(n_slices=30, rows=64, cols=64), seed=40 + s, series_number=s + 1)
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from medload.config import IngestConfig
        from medload.ingest import ingest
        for s in range(6):
            ingest({str(src)!r} + f"/s{{s}}", {str(tmp_path / 'store')!r}, config=IngestConfig(workers=1, shard_bytes=1))
    """)])
    from medload.storage.digest import series_digest, slice_digest

    seen: set[str] = set()
    visible_counts = set()
    while True:
        done = writer.poll() is not None
        if (tmp_path / "store" / "store.json").exists():
            store = open_store(tmp_path / "store", CacheConfig(l1_bytes=0))
            visible_counts.add(len(store.series()))
            for rec in store.series():
                volume = store.read(rec.key)
                assert series_digest([slice_digest(p) for p in volume], rec.shape, rec.dtype) == rec.digest
                seen.add(rec.key)
        if done:
            break
    assert writer.returncode == 0 and len(seen) == 6
    assert len(visible_counts) >= 3  # the reader really ran while series were being published


def _read_in_child(path, key, queue) -> None:
    queue.put(open_store(path, cache="0").read(key, 0, 2).sum().item())


def test_a_forked_child_reads_shards_whose_parent_handles_it_still_references(store_path):
    """A parent's handle kept alive in the child (here by a cursor, as a thread's frame can) must not make
    the child's own open fail with py-lmdb's "already open in this process"."""
    from medload.storage import shard as sh

    path, _ = store_path
    store = open_store(path, cache="0")
    rec = store.series()[0]
    expected = store.read(rec.key, 0, 2).sum().item()
    held = [env.begin().cursor() for env in list(sh._readers.values())]  # the parent's handles, referenced
    assert held
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(path, rec.key, queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and queue.get(timeout=5) == expected
    assert store.read(rec.key, 0, 2).sum().item() == expected  # the parent's handles still work

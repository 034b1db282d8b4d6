"""Positioned reads of stored values, read-ahead and L1 admission: the read path at archive scale.

The store here holds one series of large slices (96 x 96: each value lives on LMDB overflow pages and is
read with pread) and one of small slices (24 x 20: each value lives inside its leaf page and is read
through the map), so both ways of reading are checked against LMDB's own ``txn.get``."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import page_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from medload.config import IngestConfig
from medload.data import SlabDataset, SliceDataset, make_loader
from medload.data.loader import _SlotBatchSampler
from medload.data.readahead import ReadAhead
from medload.errors import StoreError, StoreFormatError
from medload.ingest import ingest
from medload.storage import shard as sh
from medload.storage import value_reads as vr
from medload.storage.cache.lru import SliceLRU
from medload.storage.manifest import shard_path
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory):
    """A store with a 96 x 96 series (values on overflow pages) and a 24 x 20 one (values in leaves)."""
    root = tmp_path_factory.mktemp("values")
    gens = [make_series(root / "src", SeriesSpec(n_slices=n, rows=r, cols=c), seed=s, series_number=s)
            for n, r, c, s in ((10, 96, 96, 1), (6, 24, 20, 2))]
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    store = open_store(root / "store", cache=0)
    truth = {r.key: next(g.hu for g in gens if g.hu.shape == r.shape) for r in store.series()}
    return root / "store", truth


def _env(store, key):
    rec = store.record(key)
    return sh.reader_env(shard_path(store.path, rec.shard)), rec


def test_located_values_are_the_bytes_lmdb_returns(two_sizes):
    path, truth = two_sizes
    store = open_store(path, cache=0)
    kinds = set()
    for key in truth:
        env, rec = _env(store, key)
        with env.begin() as txn:
            db = env.open_db(sh.SLICES, txn=txn, create=False)
            expected = [txn.get(rec.key_bytes + z.to_bytes(4, "big"), db=db) for z in range(rec.shape[0])]
        vf = vr.value_file(shard_path(store.path, rec.shard), env)
        found = vr.locate(vf.tree(env, sh.SLICES), rec.key_bytes, 0, rec.shape[0])
        assert [v.z for v in found] == list(range(rec.shape[0]))
        assert [v.length for v in found] == [len(e) for e in expected]
        for i, view in vf.read(found):
            assert bytes(view) == expected[i]
        # a large value sits on its own pages, after their 16-byte header; a small one inside its leaf page
        kinds |= {"overflow" if v.offset % vf.page_size == 16 else "leaf" for v in found}
        with pytest.raises(StoreError, match="missing slice"):
            vr.locate(vf.tree(env, sh.SLICES), rec.key_bytes, 0, rec.shape[0] + 1)
    assert kinds == {"overflow", "leaf"}  # both ways values are stored were read


def test_reads_equal_the_truth_for_every_span(two_sizes):
    path, truth = two_sizes
    store = open_store(path, cache=0)
    for key, hu in truth.items():
        for z0 in range(len(hu)):
            for z1 in range(z0 + 1, len(hu) + 1):
                assert np.array_equal(store.read(key, z0, z1), hu[z0:z1])


def _mapped_rss_kb(data: Path) -> int:
    """Resident pages of this process's mappings of ``data`` (kB, /proc/self/smaps)."""
    text = Path("/proc/self/smaps").read_text()
    total, inside = 0, False
    for line in text.splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(data))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def _run_fresh(script: str) -> str:
    """``script``'s output, run in a fresh Python process."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()


def test_value_bytes_are_never_mapped_into_the_reader(tmp_path):
    """From a cold page cache, in a fresh process: every slice of a 512 x 512 series read, yet the shard's
    mapped resident pages stay a small part of the values' bytes (the pages the store's records and the
    once-per-file check read through LMDB); py-lmdb's txn.get maps them all."""
    make_series(tmp_path / "src", SeriesSpec(n_slices=12, rows=512, cols=512), seed=4)
    ingest(tmp_path / "src", tmp_path / "store", config=IngestConfig(workers=1))
    open_store(tmp_path / "store").close()  # the writer read the store: unmap it, so its pages can be dropped
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from test_value_reads import _mapped_rss_kb
        from medload.storage.store import open_store
        from helpers import page_cache
        from pathlib import Path
        data = next(Path({str(tmp_path / "store")!r}).glob("shards/*/data.mdb"))
        if not page_cache.drop(data):
            print("skip")
            raise SystemExit
        store = open_store({str(tmp_path / "store")!r}, cache=0)
        rec = store.series()[0]
        store.read(rec.key)
        values = store.stats()["l3"]["bytes"]
        ours = _mapped_rss_kb(data) * 1024
        from medload.storage import shard as sh
        env = sh.reader_env(data.parent)
        with env.begin(buffers=True) as txn:  # the same values as py-lmdb returns them
            db = env.open_db(sh.SLICES, txn=txn, create=False)
            for z in range(rec.shape[0]):
                txn.get(rec.key_bytes + z.to_bytes(4, "big"), db=db)
        print(values, ours, _mapped_rss_kb(data) * 1024)
    """)
    out = _run_fresh(script)
    if out == "skip":
        pytest.skip(reason="this filesystem keeps file pages in memory (tmpfs?): no cold reads to check")
    values, mapped, through_lmdb = map(int, out.split())
    assert values > 12 * 100_000 and mapped < values / 4 and through_lmdb > values, (values, mapped, through_lmdb)


def test_a_misread_page_layout_is_refused(two_sizes, monkeypatch):
    """The once-per-file check compares a located value with LMDB's own: a wrong layout cannot pass."""
    path, truth = two_sizes
    store = open_store(path, cache=0)
    key = next(k for k, hu in truth.items() if hu.shape[1] == 96)
    vr.forget(shard_path(store.path, store.record(key).shard))  # a fresh descriptor, not yet checked
    monkeypatch.setattr(vr, "_PAGE_HEADER", 0)
    with pytest.raises(StoreFormatError, match="differs from the one LMDB returns"):
        store.read(key, 0, 2)
    monkeypatch.undo()
    vr.forget(shard_path(store.path, store.record(key).shard))
    assert np.array_equal(store.read(key, 0, 2), truth[key][:2])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30_000)), min_size=1, max_size=30),
       st.integers(4096, 100_000))
def test_coalesced_runs_cover_every_value_once(raw, max_bytes):
    spans, offset = [], 0
    for gap, length in raw:  # values in file order, apart by small or large gaps, then shuffled
        offset += gap * 997
        spans.append((offset, length))
        offset += length
    order = np.random.default_rng(len(raw)).permutation(len(spans))
    spans = [spans[i] for i in order]
    runs = vr.coalesce(spans, max_bytes)
    assert sorted(i for _, _, members in runs for i in members) == list(range(len(spans)))
    for start, end, members in runs:
        assert start == min(spans[i][0] for i in members) and end == max(sum(spans[i]) for i in members)
        assert len(members) == 1 or end - start <= max_bytes
        ordered = sorted(members, key=lambda i: spans[i][0])
        for a, b in zip(ordered, ordered[1:]):
            assert 0 <= spans[b][0] - sum(spans[a]) < vr._GAP


# ---- read-ahead --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    make_series(root / "src", SeriesSpec(n_slices=12, rows=256, cols=256), seed=9)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    open_store(root / "store").close()  # the writer read the store: unmap it, so its pages can be dropped
    return root / "store"


def _value_spans(store, key, z0, z1):
    env, rec = _env(store, key)
    path = shard_path(store.path, rec.shard)
    found = vr.locate(vr.value_file(path, env).tree(env, sh.SLICES), rec.key_bytes, z0, z1)
    return path / "data.mdb", [(v.offset, v.length) for v in found]


def _wait_resident(data: Path, spans, timeout: float = 60.0) -> bool:
    """Whether every span is (almost) all in the page cache within ``timeout`` seconds (read-ahead is
    asynchronous: the kernel reads while the caller goes on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(page_cache.resident(data, o, n) > 0.95 for o, n in spans):
            return True
        time.sleep(0.05)
    return False


def test_prefetch_has_the_kernel_read_the_slices_but_not_those_the_l1_holds(big_store):
    """In a fresh process, from a cold page cache (no process maps the shard, so its pages can go)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        import numpy as np
        from helpers import page_cache
        from test_value_reads import _value_spans, _wait_resident
        from pathlib import Path
        from medload.storage.store import open_store
        page_cache.drop(next(Path({str(big_store)!r}).glob("shards/*/data.mdb")))  # before anything maps it
        store = open_store({str(big_store)!r}, cache="64MB")
        key = store.series()[0].key
        data, spans = _value_spans(store, key, 0, 12)
        store.read(key, 11, 12)  # the first read of a file checks one value the ordinary way (mapping it)
        store.read(key, 4, 6)    # slices 4 and 5 are now in this process's L1
        page_cache.drop(data)
        if any(page_cache.resident(data, o, n) > 0.05 for o, n in spans[2:11]):
            print("skip")
            raise SystemExit
        store.prefetch([(key, 2, 8)], labels=True)  # returns at once; the series has no labels to fetch
        fetched = _wait_resident(data, spans[2:4] + spans[6:8])
        held = max(page_cache.resident(data, o, n) for o, n in spans[4:6])    # in the L1: not fetched
        others = max(page_cache.resident(data, o, n) for o, n in spans[8:11])  # not asked for
        same = np.array_equal(store.read(key, 2, 8), open_store({str(big_store)!r}, cache=0).read(key, 2, 8))
        print(fetched, held, others, same)
    """)
    out = _run_fresh(script)
    if out == "skip":
        pytest.skip(reason="this filesystem keeps file pages in memory (tmpfs?): nothing to read ahead")
    fetched, held, others, same = out.split()
    assert fetched == "True" and same == "True"
    assert float(held) < 0.5 and float(others) < 0.5


def test_each_batch_carries_the_batches_its_reader_reads_next():
    sampler = _SlotBatchSampler(range(20), 3, False, slots=4, buckets=np.zeros(20, np.int64), lookahead=2, depth=2)
    batches = list(sampler)
    assert [list(b) for b in batches] == [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]
    assert [b.slot for b in batches] == [n % 4 for n in range(len(batches))]
    assert [b.number for b in batches] == list(range(len(batches)))
    for n, b in enumerate(batches):  # this reader's next two: n + 2 and n + 4
        assert b.ahead == [(m, list(batches[m])) for m in (n + 2, n + 4) if m < len(batches)]


class _WhoReads(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitems__(self, batch):
        info = torch.utils.data.get_worker_info()
        return {"worker": info.id if info else None, "batch": list(batch),
                "ahead": batch.ahead[0][1] if batch.ahead else None}


def test_with_workers_ahead_is_the_next_batch_of_the_same_worker():
    """torch's DataLoader hands batch n to worker n % num_workers: what the read-ahead relies on."""
    sampler = _SlotBatchSampler(range(40), 4, False, slots=6, buckets=np.zeros(40, np.int64), lookahead=2, depth=1)
    loader = torch.utils.data.DataLoader(_WhoReads(), batch_sampler=sampler, num_workers=2, collate_fn=lambda b: b)
    seen = list(loader)
    for worker in (0, 1):
        mine = [b for b in seen if b["worker"] == worker]
        assert len(mine) == 5
        assert all(a["ahead"] == b["batch"] for a, b in zip(mine, mine[1:]))


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls, self.fail = [], fail

    def prefetch(self, indices):
        self.calls.append(list(indices))
        if self.fail:
            raise RuntimeError("damaged shard")


def _batch(number: int, indices, ahead=()):
    from medload.data.loader import _Batch

    return _Batch(list(indices), 0, number, list(ahead))


def test_read_ahead_announces_each_batch_once_and_never_raises():
    ds, reader = _Recorder(), ReadAhead()
    reader.before(ds, _batch(0, [1, 2], [(1, [3, 4]), (2, [5, 6])]))
    reader._pool.shutdown(wait=True)
    assert ds.calls == [[1, 2], [3, 4], [5, 6]]  # the first batch now, the next two in the background
    reader._pool = type(reader._pool)(max_workers=1)
    reader.before(ds, _batch(1, [3, 4], [(2, [5, 6]), (3, [7, 8])]))  # 1 and 2 announced already
    reader._pool.shutdown(wait=True)
    assert ds.calls == [[1, 2], [3, 4], [5, 6], [7, 8]]
    reader._pool = type(reader._pool)(max_workers=1)
    reader.before(ds, _batch(0, [1, 2]))  # a new epoch: batch 0 again, announced again
    assert ds.calls[-1] == [1, 2]
    ReadAhead().before(_Recorder(fail=True), _batch(0, [5], [(1, [6])]))  # a failing hint is only logged


def test_loader_reads_ahead_and_gives_the_same_batches(big_store):
    store = open_store(big_store, cache=0)
    ds = SliceDataset(store, context=1)
    order = list(np.random.default_rng(2).permutation(len(ds)))
    want = torch.stack([ds[i]["image"].as_tensor() for i in order]).float()
    for workers in (0, 2):
        loader = make_loader(ds, batch_size=4, num_workers=workers, sampler=order)
        got = torch.cat([b["image"] for b in loader])
        assert torch.equal(got, want)
    slabs = SlabDataset(store, depth=4, stride=2)
    loader = make_loader(slabs, batch_size=2, num_workers=2, shuffle=False)
    got = torch.cat([b["image"] for b in loader])
    assert torch.equal(got, torch.stack([slabs[i]["image"].as_tensor() for i in range(len(slabs))]).float())


# ---- L1 admission ---------------------------------------------------------------------------------------------
def _key(i: int) -> tuple:
    return ("digest", b"slices", i.to_bytes(4, "big"))


def test_l1_keeps_everything_while_it_has_room_then_only_recent_misses():
    lru, slice_ = SliceLRU(10 * 100), np.zeros(100, np.uint8)
    for i in range(10):
        assert lru.admits(_key(i), 100)
        lru.put(_key(i), slice_)
    assert not lru.admits(_key(50), 100)  # full: a first miss is turned away...
    assert lru.admits(_key(50), 100)      # ...and kept when it misses again soon
    for i in range(100, 200):             # 100 other misses: more than the ghost list remembers (64)
        assert not lru.admits(_key(i), 100)
    assert not lru.admits(_key(100), 100)  # forgotten by now: turned away again
    assert lru.stats().declined == 102
    assert not SliceLRU(50).admits(_key(1), 100)  # larger than the whole budget


def _replay(lru: SliceLRU, stream, admission: bool) -> tuple[int, int]:
    value = np.zeros(100, np.uint8)
    for i in stream:
        if lru.get(_key(int(i))) is None and (not admission or lru.admits(_key(int(i)), 100)):
            lru.put(_key(int(i)), value)
    stats = lru.stats()
    return stats.hits, stats.evictions


def test_a_random_epoch_over_a_large_store_leaves_the_l1_be():
    """Uniform random reads over 20x the L1: plain LRU copies in and throws out a slice per miss; with
    admission the L1 keeps its contents, and hits about as often (what it holds is as likely as any)."""
    stream = np.random.default_rng(0).integers(0, 2000, size=20_000)
    lru_hits, lru_evictions = _replay(SliceLRU(100 * 100), stream, admission=False)
    hits, evictions = _replay(SliceLRU(100 * 100), stream, admission=True)
    assert lru_evictions > 15_000 and evictions < lru_evictions / 10
    assert hits >= 0.8 * lru_hits
    small = np.tile(np.arange(80), 5)  # data that fit: every read from the second pass on is a hit
    hits, _ = _replay(SliceLRU(100 * 100), small, admission=True)
    assert hits == 80 * 4


class _BudgetOf(SliceDataset):
    """Records, in a shared tensor, the L1 budget each DataLoader worker reads with."""

    def read_batch(self, indices, image, label) -> None:
        from medload.storage.cache import lru

        super().read_batch(indices, image, label)
        info = torch.utils.data.get_worker_info()
        self.budgets[info.id] = lru._shared.budget


@pytest.mark.parametrize(("l1", "shared"), [("100kB", True), ("64MB", False)])
def test_workers_share_the_l1_budget_only_when_the_data_dwarf_it(big_store, l1, shared):
    """1.5 MB of 256 x 256 slices: more than 8 times a 100 kB L1 (each of 2 workers keeps half), well
    within a 64 MB one (each keeps it all)."""
    store = open_store(big_store, cache=l1)
    ds = _BudgetOf(store, context=1)
    ds.budgets = torch.zeros(2, dtype=torch.int64).share_memory_()
    for _ in make_loader(ds, batch_size=2, num_workers=2):
        pass
    whole = store.cache.l1_bytes
    if shared:
        assert ds.budgets.tolist() == [whole // 2] * 2
    else:  # a whole L1 each (or a larger one: a process's L1 has the largest budget any of its Stores asked for)
        assert min(ds.budgets.tolist()) >= whole

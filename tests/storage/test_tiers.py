"""Reads through the hot-shard tier (L2): hits, on-demand copies, damaged and vanished copies, CLI."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from test_read_path import _SlabDataset

from medload.config import CacheConfig, IngestConfig
from medload.ingest import ingest
from medload.storage.cache import tiered
from medload.storage.keys import slice_key
from medload.storage.manifest import shard_path
from medload.storage.shard import reader_env
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


@pytest.fixture
def store(tmp_path):
    """Three series, one shard each; returns (store path, {key: ground truth})."""
    gens = [make_series(tmp_path / "src", SeriesSpec(n_slices=10, rows=32, cols=40), seed=s, series_number=s)
            for s in (1, 2, 3)]
    ingest(tmp_path / "src", tmp_path / "store", config=IngestConfig(workers=1, shard_bytes=1))
    st = open_store(tmp_path / "store")
    truth = {r.key: next(g.hu for g in gens if np.array_equal(st.read(r.key, 0, 1)[0], g.hu[0])) for r in st.series()}
    st.close()
    return tmp_path / "store", truth


def _hot(tmp_path, **kw) -> CacheConfig:
    return CacheConfig(l1_bytes=0, hot_dir=tmp_path / "hot", hot_budget=1 << 30, **kw)


def _warm(st) -> None:
    for entry in st.manifest.shards:
        assert st._tiers.hot.fetch(shard_path(st.path, entry.name) / "data.mdb", entry) is not None


def test_warm_shards_are_read_from_the_hot_copies(store, tmp_path):
    path, truth = store
    st = open_store(path, _hot(tmp_path, fetch="never"))
    _warm(st)
    for key, hu in truth.items():
        assert np.array_equal(st.read(key), hu)
    stats = st.stats()
    assert stats["l2"]["hits"] == 30 and stats["l3"]["hits"] == 0 and stats["l2"]["misses"] == 0


def test_a_shard_read_from_the_store_is_copied_in_the_background(store, tmp_path, monkeypatch):
    monkeypatch.setattr(tiered, "_RECHECK_SECONDS", 0.0)
    path, truth = store
    st = open_store(path, _hot(tmp_path))
    key, hu = next(iter(truth.items()))
    assert np.array_equal(st.read(key), hu)
    assert st.stats()["l3"]["hits"] == 10 and st.stats()["l2"]["misses"] == 1
    deadline = time.monotonic() + 20
    while not list((tmp_path / "hot").glob("*.mdb")):
        assert time.monotonic() < deadline, "the background copy never appeared"
        time.sleep(0.05)
    assert np.array_equal(st.read(key), hu)
    assert st.stats()["l2"]["hits"] == 10


def test_a_damaged_hot_copy_is_dropped_the_store_answers_and_it_is_fetched_again(store, tmp_path, monkeypatch):
    monkeypatch.setattr(tiered, "_RECHECK_SECONDS", 0.0)
    path, truth = store
    st = open_store(path, _hot(tmp_path))
    _warm(st)
    rec = st.series()[0]
    env = reader_env(shard_path(path, rec.shard))
    with env.begin() as txn:
        value = bytes(txn.get(slice_key(rec.key_bytes, 4), db=env.open_db(b"slices", txn=txn, create=False)))
    copy = tmp_path / "hot" / f"{rec.shard}.mdb"
    data = bytearray(copy.read_bytes())
    starts, at = [], data.find(value)
    while at != -1:  # the live value, and stale copies of it in freed pages
        starts.append(at)
        at = data.find(value, at + 1)
    assert starts
    for at in starts:
        data[at + len(value) // 2] ^= 0x40
    copy.write_bytes(bytes(data))  # a flipped bit on the local disk
    assert np.array_equal(st.read(rec.key), truth[rec.key])
    stats = st.stats()
    assert stats["l2"]["drops"] == 1 and stats["l3"]["hits"] == 10, stats
    deadline = time.monotonic() + 20
    while not (copy.exists() and copy.read_bytes() != bytes(data)):  # fetched again, from the store
        assert time.monotonic() < deadline, "the damaged copy was not fetched again"
        time.sleep(0.05)
    assert np.array_equal(st.read(rec.key), truth[rec.key])
    assert st.stats()["l2"]["hits"] == 10


def test_deleting_the_hot_dir_under_a_reader_does_not_break_it(store, tmp_path):
    path, truth = store
    st = open_store(path, _hot(tmp_path, fetch="never"))
    _warm(st)
    key, hu = next(iter(truth.items()))
    assert np.array_equal(st.read(key), hu)
    shutil.rmtree(tmp_path / "hot")
    for _ in range(2):
        assert np.array_equal(st.read(key), hu)
    other = open_store(path, _hot(tmp_path, fetch="never"))  # a new reader finds no copies: reads the store
    assert np.array_equal(other.read(key), hu)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_with_a_hot_dir_return_the_direct_reads(store, tmp_path, method):
    path, _ = store
    st = open_store(path, CacheConfig(l1_bytes=1 << 20, hot_dir=tmp_path / "hot", hot_budget=1 << 30))
    dataset = _SlabDataset(st)
    direct = np.stack([st.read(key, z, z + 3) for key, z in dataset.items])
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, num_workers=2,
                                         multiprocessing_context=mp.get_context(method))
    for _ in range(2):  # second epoch: workers find the copies the first one made
        assert np.array_equal(torch.cat(list(loader)).numpy(), direct)


def _medload(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True,
                          env=os.environ.copy())
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def test_cache_cli_warm_status_clear_with_a_config_file(store, tmp_path):
    path, _ = store
    config = tmp_path / "medload.toml"
    config.write_text(f'[cache]\nhot_dir = "{tmp_path / "hot"}"\nhot_budget = "1GB"\n')
    out = _medload("--config", config, "cache", "warm", path).stdout
    assert "3 copied" in out
    assert "3 of 3 shard(s)" in _medload("--config", config, "cache", "status", path).stdout
    assert "already hot" in _medload("--config", config, "cache", "warm", path).stdout
    small = _medload("cache", "warm", path, "--hot-dir", tmp_path / "hot2", "--hot-budget", "1KB", check=False)
    assert small.returncode == 2 and "raise --hot-budget" in small.stderr
    assert "freed" in _medload("--config", config, "cache", "clear").stdout
    assert not list((tmp_path / "hot").glob("*.mdb"))
    bad = tmp_path / "bad.toml"
    bad.write_text('[cache]\nhot_size = "1GB"\n')
    proc = _medload("--config", bad, "cache", "status", check=False)
    assert proc.returncode == 2 and "unknown setting(s) hot_size" in proc.stderr


def test_ingest_reads_its_settings_from_the_config_file(tmp_path):
    make_series(tmp_path / "src", SeriesSpec(n_slices=4, rows=32, cols=40), seed=9)
    config = tmp_path / "medload.toml"
    config.write_text('[ingest]\nworkers = 1\nwindows = ["lung"]\n')
    _medload("--config", config, "ingest", tmp_path / "src", tmp_path / "s", "--no-progress")
    (rec,) = json.loads(_medload("ls", tmp_path / "s", "--json").stdout)
    assert rec["windows"] == ["lung"]

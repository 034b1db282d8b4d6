"""Crash safety: SIGKILL the ingester at random moments, again and again, then check the store.

After every kill the store must open, every published series must read back with its digest, no
slice may exist without its series record (a half-written series), and a final run must complete
with every series exactly once.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from medload.storage import shard as sh
from medload.storage.digest import series_digest, slice_digest
from medload.storage.keys import SERIES_KEY_BYTES
from medload.storage.manifest import shard_path
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

SERIES = 60


def _check(store_path) -> set[str]:
    """The store opens, every series verifies, no orphan slices; returns the series keys."""
    if not (store_path / "store.json").exists():
        return set()
    store = open_store(store_path, cache=0)
    keys = set()
    for rec in store.series():
        assert rec.key not in keys, f"series {rec.key} stored twice"
        keys.add(rec.key)
        volume = store.read(rec.key)
        assert series_digest([slice_digest(p) for p in volume], rec.shape, rec.dtype) == rec.digest
    for entry in store.manifest.shards:
        env = sh.reader_env(shard_path(store_path, entry.name))
        with env.begin() as txn:
            dbs = sh.open_dbs(env, [sh.SLICES, sh.SERIES], create=False, txn=txn)
            series = {bytes(k) for k in txn.cursor(db=dbs[sh.SERIES]).iternext(values=False)}
            for k in txn.cursor(db=dbs[sh.SLICES]).iternext(values=False):
                assert bytes(k)[:SERIES_KEY_BYTES] in series, f"orphan slice {bytes(k).hex()} in {entry.name}"
    store.close()
    return keys


def _staging(store) -> set[str]:
    return {p.name for p in (store / "staging").glob("*.lmdb")}


def _wait_for_writing(store, proc, before: set[str], timeout: float = 30.0) -> None:
    """Until this ingester has started writing series (a staging shard of its own), or has finished."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if _staging(store) - before:
            return
        time.sleep(0.005)


@pytest.mark.parametrize(("workers", "kills"), [(2, 20), (1, 10)])
def test_killing_the_ingester_at_random_moments_never_damages_the_store(tmp_path, workers, kills):
    src = tmp_path / "src"
    for s in range(SERIES):
        make_series(src, SeriesSpec(n_slices=6 + s % 4, rows=64, cols=64), seed=70 + s, series_number=s + 1)
    store = tmp_path / "store"
    script = textwrap.dedent(f"""
        from medload.config import IngestConfig
        from medload.ingest import ingest
        ingest({str(src)!r}, {str(store)!r}, config=IngestConfig(workers={workers}, shard_bytes=200_000))
    """)
    rng = random.Random(workers)
    mid_ingest = attempts = 0
    while mid_ingest < kills:  # kills that land while series are being written (a round that finishes restarts)
        attempts += 1
        assert attempts <= 4 * kills, f"only {mid_ingest} of {attempts} kills landed mid-ingest"
        before = _staging(store) if (store / "staging").exists() else set()
        proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, env=os.environ.copy())
        _wait_for_writing(store, proc, before)
        time.sleep(rng.uniform(0.0, 0.03))  # a random moment while series are being written
        finished = proc.poll() is not None
        if not finished:
            os.killpg(proc.pid, signal.SIGKILL)  # the ingester and its workers, as a machine crash would
        proc.wait()
        if len(_check(store)) < SERIES and not finished:
            mid_ingest += 1
        else:
            _finish_and_check(script, store)
            shutil.rmtree(store)
    _finish_and_check(script, store)


def _finish_and_check(script: str, store) -> None:
    """A run to completion: every series exactly once, nothing left in staging."""
    final = subprocess.run([sys.executable, "-c", script], env=os.environ.copy())
    assert final.returncode == 0
    assert len(_check(store)) == SERIES
    assert not list((store / "staging").glob("*.lmdb"))  # every committed series was published
    records = open_store(store).series()
    assert sorted(r.shape[0] for r in records) == sorted(6 + s % 4 for s in range(SERIES))
    assert np.unique([r.digest for r in records]).size == SERIES


def test_sigterm_stops_an_ingest_as_ctrl_c_does(tmp_path):
    """SIGTERM (`kill PID`, a batch system's time limit) mid-ingest: what was committed is published, nothing is
    left in staging, and the command ends in one line with exit 143 (it was killed on the spot before)."""
    src = tmp_path / "src"
    for s in range(SERIES):
        make_series(src, SeriesSpec(n_slices=6 + s % 4, rows=64, cols=64), seed=70 + s, series_number=s + 1)
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "medload.cli", "ingest", str(src), str(store), "--workers", "2",
                             "--shard-bytes", "200000", "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_writing(store, proc, set())
        assert proc.poll() is None, "the ingest finished before it was seen writing"
        os.killpg(proc.pid, signal.SIGTERM)  # the ingester and its decoding processes
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.splitlines() == ["error: terminated"]
    assert not list((store / "staging").iterdir()), "the staging shard is published or removed"
    assert len(_check(store)) < SERIES
    _finish_and_check(textwrap.dedent(f"""
        from medload.ingest import ingest
        ingest({str(src)!r}, {str(store)!r})
    """), store)

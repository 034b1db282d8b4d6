"""The scale section's machinery: its data (reused, refused without disk room), disk-read and CPU-share
accounting, and the targets read from its rows. The section end to end runs in tests/bench/test_bench_run.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import page_cache

from medload.bench.common import OtherLoad, evict_page_cache, load_note, tree_read_bytes
from medload.bench.peers import PeerUnavailable
from medload.bench.scale import ScaleSettings, prepare_scale, sample_bytes
from medload.bench.targets import scale_targets
from medload.config import affinity_cores

TINY = ScaleSettings(series=3, slices=6, size=48, distinct=2, repeats=1, warmup=1, batches=1, batch_size=2)


@pytest.fixture(scope="module")
def prep(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    return prepare_scale(root / "data", TINY, key_file=root / "key", progress=False)


def test_data_hold_every_format_and_are_reused(prep, tmp_path_factory):
    assert len(prep.series) == 3 and {s.depth for s in prep.series} == {6}
    assert len(prep.z0) == TINY.samples and all(0 <= z <= 3 for z in prep.z0)
    assert {"zarr", "hdf5"} <= set(prep.formats)
    assert not (Path(prep.root) / "dicom").exists()  # the DICOM is deleted once ingested
    volume = np.load(prep.series[0].npy)
    import zarr

    assert np.array_equal(zarr.open_array(f"{prep.formats['zarr']}/{prep.series[0].key}.zarr", mode="r")[:], volume)
    store = next(Path(prep.store).glob("shards/*/data.mdb"))
    before = store.stat().st_mtime_ns
    again = prepare_scale(Path(prep.root), TINY, key_file=Path(prep.root).parent / "key", progress=False)
    assert store.stat().st_mtime_ns == before and np.array_equal(again.z0, prep.z0)
    assert 0 < sample_bytes(prep) < 3 * 48 * 48 * 2 + 100  # three compressed slices


def test_no_room_on_disk_is_refused_with_the_sizes(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 10**6))
    with pytest.raises(PeerUnavailable, match=r"need about \d+ GB free .* has 0 GB: free some, or run fewer series"):
        prepare_scale(tmp_path / "data", ScaleSettings(), key_file=tmp_path / "key", progress=False)


def test_disk_reads_of_this_process_are_counted(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    if not page_cache.drop(path):
        pytest.skip(reason="this filesystem keeps file pages in memory (tmpfs?): nothing is read from disk")
    before = tree_read_bytes()
    path.read_bytes()
    assert tree_read_bytes() - before >= 7 << 20
    evict_page_cache([path])
    assert page_cache.resident(path) < 0.05


def test_other_processes_cpu_is_measured_and_ours_is_not():
    """A busy process outside this tree (detached: its parent exits at once) counts; it runs throughout."""
    spin = textwrap.dedent("""
        import os, time
        if os.fork():
            os._exit(0)
        end = time.monotonic() + 4
        while time.monotonic() < end:
            pass
    """)
    subprocess.run([sys.executable, "-c", spin], check=True)
    time.sleep(0.2)
    with OtherLoad() as watch:
        time.sleep(1.5)
    assert watch.share is not None and watch.share >= 0.5 / affinity_cores()
    assert load_note("loading", 0.9).startswith("loading: other processes used 90% of the CPUs")
    assert load_note("loading", 0.1) is None and load_note("loading", None) is None


def _row(name: str, mode: str, workers: int, rate: float, **extra) -> dict:
    return {"contender": name, "mode": mode, "num_workers": workers, "status": "ok", "samples_per_s": rate, **extra}


def test_targets_read_the_rows():
    from medload.bench.scale import _best_peers

    rows = [_row("medload", "cold", 0, 300.0, mb_per_sample=0.6), _row("hdf5_chunked", "cold", 0, 150.0),
            _row("zarr_blosc", "cold", 0, 100.0), _row("medload", "warm", 0, 200.0), _row("npy_memmap", "warm", 0, 250.0),
            {"contender": "nnunet", "mode": "warm", "num_workers": 0, "status": "skipped", "reason": "not installed"}]
    _best_peers(rows)
    assert (rows[0]["best_peer"], rows[0]["x_best_peer"]) == ("hdf5_chunked", 2.0)
    targets = {(t["run"], t["field"]): t for t in scale_targets({"rows": rows, "sample_mb": 0.5})}
    cold = targets[("at scale, page cache cold, 0 workers", "x_best_peer")]
    assert cold["met"] is True and cold["measure"] == "x the fastest peer (hdf5_chunked)"
    warm = targets[("at scale, page cache warm, 0 workers", "x_best_peer")]
    assert warm["value"] == pytest.approx(0.8) and warm["met"] is False
    assert targets[("at scale, page cache warm, 2 workers", "x_best_peer")]["met"] is None  # no such row
    disk = targets[("at scale, page cache cold, 0 workers", "x_compressed")]
    assert disk["value"] == pytest.approx(1.2) and disk["met"] is True and disk["at_most"]

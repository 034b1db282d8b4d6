"""An archive whose headers will not fit in the free memory is said before the header pass, with what to do;
the default worker count is what fits in the memory left, in a real cgroup too."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import medload.ingest.memory_need as memory_need
from medload.cgroup_limits import memory_group, usable_cores
from medload.config import IngestConfig
from medload.ingest.memory_need import BYTES_PER_FILE, WORKER_BYTES, fit_workers, short_of_memory
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

MB = 1 << 20


def test_the_warning_names_the_need_the_free_memory_and_what_to_do():
    assert short_of_memory(1_000_000, available=8 << 30) is None  # 1.6 GB of 8.6 GB free
    text = short_of_memory(12_000_000, available=16 << 30)  # 19.2 GB against 17.2 GB
    assert text is not None and text.startswith("12,000,000 files:")
    assert "19.2 GB" in text and "17.2 GB free" in text and "Ingest the archive in parts" in text
    assert short_of_memory(10_000, available=10_000 * BYTES_PER_FILE) is not None  # more than 80% of it
    assert short_of_memory(1, available=None) is None  # this machine has room for one file's headers


def test_an_ingest_warns_before_reading_headers_and_still_runs(tmp_path, run_ingest, monkeypatch, caplog):
    make_series(tmp_path / "src", SeriesSpec(n_slices=4, rows=16, cols=16), seed=3)
    monkeypatch.setattr(memory_need, "BYTES_PER_FILE", 1 << 50)  # as if each file took a petabyte
    with caplog.at_level(logging.WARNING, logger="medload.ingest.run"):
        report, store = run_ingest(tmp_path / "src")
    warned = [r.getMessage() for r in caplog.records if "files: the ingest process will hold" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("4 files:"), warned
    assert report.count("ingested") == 1 and len(list(store.series())) == 1


def test_the_default_workers_are_as_many_as_fit_and_an_explicit_count_is_kept_with_a_warning(caplog):
    default = IngestConfig(workers=None)
    with caplog.at_level(logging.WARNING, logger="medload.ingest.memory_need"):
        assert fit_workers(default, available=1 << 50) is default  # room for every core's worker: no change
        assert caplog.records == []
        cores = default.worker_count
        small = fit_workers(IngestConfig(workers=None), available=3 * WORKER_BYTES)  # 75% of it: two workers
        assert small.workers == (2 if cores > 2 else None)
        tiny = fit_workers(IngestConfig(workers=None), available=WORKER_BYTES // 2)
        assert tiny.workers == (1 if cores > 1 else None)  # at least one, whatever is free
        explicit = IngestConfig(workers=8)
        assert fit_workers(explicit, available=3 * WORKER_BYTES) is explicit
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("8 workers:") and "use --workers 2 or fewer" in m for m in warned), warned
    if cores > 1:
        assert any(m.startswith("using 1 worker rather than one per usable core") for m in warned), warned


def test_an_ingest_in_a_small_cgroup_takes_the_workers_that_fit_and_finishes(tmp_path):
    """Two workers in a 400 MB cgroup hang in reclaim (measured: docs/benchmarks.md); the default is one."""
    if usable_cores() < 2:
        pytest.skip(reason="one usable core: the default is one worker whatever the memory")
    own = memory_group()
    child = None if own is None else own[0] / f"medload-test-{os.getpid()}"
    try:
        if child is None:
            raise PermissionError("no memory cgroup controller delegated to this process")
        child.mkdir()
        (child / own[1]).write_text(f"{400 * MB}\n")
    except OSError as e:
        pytest.skip(reason=f"needs a memory cgroup this user may create and limit (root, or a delegated v2 group): {e}")
    try:
        for n in range(2):
            make_series(tmp_path / "src" / str(n), SeriesSpec(n_slices=16, rows=256, cols=256), seed=n)
        procs = child / "cgroup.procs"
        try:
            out = subprocess.run([sys.executable, "-m", "medload.cli", "ingest", str(tmp_path / "src"),
                                  str(tmp_path / "store"), "--no-progress"], capture_output=True, text=True,
                                 preexec_fn=lambda: procs.write_text(f"{os.getpid()}\n"), timeout=600)
        except subprocess.SubprocessError as e:  # the move into the group refused (the preexec_fn failed)
            if isinstance(e, subprocess.TimeoutExpired):
                raise
            pytest.skip(reason=f"needs a memory cgroup this user may move a process into: {e}")
    finally:
        child.rmdir()
    assert out.returncode == 0, out.stderr
    assert "using 1 worker rather than one per usable core" in " ".join((out.stdout + out.stderr).split())
    assert len(list(open_store(tmp_path / "store").series())) == 2

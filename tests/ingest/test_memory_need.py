"""An archive whose headers will not fit in the free memory is said before the header pass, with what to do."""

from __future__ import annotations

import logging
from pathlib import Path

import medload.ingest.memory_need as memory_need
from medload.ingest.memory_need import BYTES_PER_FILE, available_memory, short_of_memory
from medload.synthetic import SeriesSpec, make_series


def test_free_memory_is_the_smaller_of_the_system_and_the_cgroup_limit(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal:       32000000 kB\nMemFree:   1000 kB\nMemAvailable:   20000000 kB\n")
    assert available_memory(proc, cgroup) == 20_000_000 * 1024  # no cgroup limit files: the system's figure
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert available_memory(proc, cgroup) == 20_000_000 * 1024
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")  # a Slurm job's or a container's limit, 1 GB of it used
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert available_memory(proc, cgroup) == 7 << 30
    assert available_memory(tmp_path / "nowhere", tmp_path / "nowhere") is None


def test_this_machine_reports_its_free_memory():
    free = available_memory()
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert free is not None and 0 < free <= total


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

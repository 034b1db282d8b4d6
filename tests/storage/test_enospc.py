"""A full disk at every stage of writing, on a real small filesystem (a tmpfs mounted for the test): the
spool of an archive (and of a PACS retrieve), the commit of a series, the publish of a shard, the copy of a
hot shard. Each ends the command with one ``error:`` line (exit 2, no traceback, never SIGBUS), leaves every
committed series intact, and the same command run again once there is space completes without writing
anything twice."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import file_hashes

from medload.config import IngestConfig
from medload.errors import DiskFullError
from medload.ingest.run import ingest
from medload.storage.manifest import Manifest, ShardEntry, read_manifest, write_manifest
from medload.storage.store import open_store
from medload.storage.verify import verify_store
from medload.synthetic import SeriesSpec, make_series

CFG = IngestConfig(workers=1, windows=("lung",))
PAGE = 4096


def medload(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)


def ingest_cli(*args) -> subprocess.CompletedProcess:
    return medload("ingest", *args, "--workers", "1", "--windows", "lung", "--no-progress")


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a failed command printed: exit 2, nothing else on stderr, no traceback."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    return lines[0]


@pytest.fixture
def disk(tmp_path):
    """A real 16 MB filesystem (tmpfs) at tmp_path/disk, unmounted after the test."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(reason=f"cannot mount a small tmpfs filesystem here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    yield path
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=True)  # a process still holds a file there


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: Path, leave: int) -> Path:
    """Allocate a filler file so that ``leave`` bytes (whole pages) stay free on ``disk``; delete it to free them."""
    filler = disk / "filler"
    with open(filler, "ab") as f:
        grow = free_bytes(disk) - leave
        assert grow >= 0, f"{disk} has less than {leave} bytes free"
        os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size + grow)
    assert free_bytes(disk) == leave
    return filler


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Six series (16 slices of 64x64, about 220 KB each in a store with lung planes) and the store they make
    on a disk with room, to compare with."""
    root = tmp_path_factory.mktemp("enospc")
    for i in range(6):
        make_series(root / "src" / f"s{i}", SeriesSpec(n_slices=16, rows=64, cols=64), seed=i, series_number=i + 1)
    ingest(root / "src", root / "reference", config=CFG)
    return root


def assert_intact(store: Path, reference: Path) -> list[str]:
    """The store verifies, and each series it lists reads bit-exact (image and lung plane) as in ``reference``;
    returns their keys."""
    report = verify_store(store)
    assert report.ok, report.damage
    st, ref = open_store(store), open_store(reference)
    keys = [r.key for r in st.series()]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert st.record(key).digest == ref.record(key).digest
        assert np.array_equal(st.read(key), ref.read(key))
        assert np.array_equal(st.read(key, plane="lung"), ref.read(key, plane="lung"))
    return keys


def test_disk_full_while_committing_keeps_what_was_committed_and_a_rerun_completes(disk, sources):
    store = disk / "store"
    filler = fill(disk, 500 << 10)  # room for two series or so of six
    line = error_line(ingest_cli(sources / "src", store))
    assert f"no space left on the disk of {store}" in line and "while writing series" in line
    assert "run the same command again" in line
    stored = assert_intact(store, sources / "reference")
    assert 0 < len(stored) < 6
    assert not list((store / "staging").iterdir())  # the committed series were published, nothing is left over

    proc = medload("-v", "ingest", sources / "src", store, "--workers", "1", "--windows", "lung", "--no-progress")
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "DiskFullError" in proc.stderr  # -v: the traceback too
    assert proc.stderr.splitlines()[-1].startswith("error: no space left")

    filler.unlink()
    proc = ingest_cli(sources / "src", store)
    assert proc.returncode == 0, proc.stderr
    assert f"{6 - len(stored)} ingested, {len(stored)} already present" in proc.stdout
    assert sorted(assert_intact(store, sources / "reference")) == sorted(r.key for r in open_store(sources / "reference").series())


def test_a_full_disk_never_kills_the_writer_with_sigbus(disk, sources):
    """LMDB maps the lock file of a new staging shard: on a disk with no free page, touching it raised SIGBUS."""
    store = disk / "store"
    assert ingest_cli(sources / "src" / "s0", store).returncode == 0
    before = file_hashes(store)
    filler = fill(disk, 0)
    line = error_line(ingest_cli(sources / "src", store))  # exit 2, not -7 (SIGBUS)
    assert "while writing series" in line
    assert file_hashes(store) == before
    filler.unlink()
    assert "5 ingested, 1 already present" in ingest_cli(sources / "src", store).stdout
    assert len(assert_intact(store, sources / "reference")) == 6


def test_disk_full_while_spooling_an_archive_stops_the_run_and_quarantines_nothing(disk, sources, tmp_path):
    store = disk / "store"
    assert ingest_cli(sources / "src" / "s0", store).returncode == 0
    archive = tmp_path / "two.tar.gz"  # members of a compressed tar are spooled to STORE/staging to be read
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("s1", "s2"):
            tar.add(sources / "src" / name, arcname=name)
    before = file_hashes(store)
    filler = fill(disk, 128 << 10)  # the archive holds 1.1 MB of DICOM
    line = error_line(ingest_cli(archive, store))
    assert "while spooling" in line and str(archive) in line
    assert file_hashes(store) == before  # nothing written, no quarantine record saying "no space"
    assert not list((store / "staging").iterdir())  # the spool is gone
    filler.unlink()
    proc = ingest_cli(archive, store)
    assert "series: 2 ingested, 0 already present" in proc.stdout and "files: 0 skipped, 0 rejected" in proc.stdout
    assert len(assert_intact(store, sources / "reference")) == 3
    assert open_store(store).rejects(include_skipped=True) == []


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """A store of 100 one-series shards (a store.json of 15 KB: more than the 8 KB lock file a publish
    removes before writing it) and a folder holding one more series."""
    root = tmp_path_factory.mktemp("many")
    for i in range(101):
        make_series(root / "src" / f"s{i:03d}", SeriesSpec(n_slices=2, rows=8, cols=8), seed=i, series_number=i + 1)
    shutil.move(root / "src" / "s100", root / "new")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, windows=("lung",), shard_bytes=1))
    assert (root / "store" / "store.json").stat().st_size > (8 << 10) + PAGE  # the lock file and a page to spare
    return root


def test_disk_full_while_publishing_keeps_the_shard_for_the_next_run(disk, many_shards):
    """Between "the commit fails" (too little room) and "the run succeeds" (room enough), there is an amount
    of free space with which the commit fits and the publish does not: found by bisection, then checked."""
    store = disk / "store"

    def attempt(leave: int) -> subprocess.CompletedProcess:
        for entry in disk.iterdir():
            (shutil.rmtree if entry.is_dir() else os.unlink)(entry)
        shutil.copytree(many_shards / "store", store)
        fill(disk, leave)
        return ingest_cli(many_shards / "new", store)

    def commit_fails(pages: int) -> bool:
        proc = attempt(pages * PAGE)
        return proc.returncode != 0 and "while publishing" not in proc.stderr

    low, high = 0, 64  # pages: the commit fails with none free and fits in 256 KB
    assert commit_fails(low) and not commit_fails(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if commit_fails(middle) else (low, middle)
    proc = attempt(high * PAGE)  # the least room in which the commit fits
    line = error_line(proc)
    assert "while publishing shard" in line and "run the same command again" in line
    assert (store / "store.json").read_bytes() == (many_shards / "store" / "store.json").read_bytes()
    assert not (store / "store.json.tmp").exists()
    report = verify_store(store)
    assert report.ok and len(report.notes) == 1 and "store.json" in report.notes[0].detail  # the unlisted shard
    assert len(assert_intact(store, many_shards / "store")) == 100

    (disk / "filler").unlink()
    proc = ingest_cli(many_shards / "new", store)  # publishes the shard the last run could not list, writes nothing
    assert proc.returncode == 0 and "0 ingested, 1 already present" in proc.stdout, proc.stdout + proc.stderr
    report = verify_store(store)
    assert report.ok and not report.notes
    keys = [r["key"] for r in json.loads(medload("ls", store, "--json").stdout)]
    assert len(keys) == len(set(keys)) == 101


def test_disk_full_while_copying_a_hot_shard(disk, sources, tmp_path):
    store = tmp_path / "store"  # on a disk with room; the hot directory is on the small one
    ingest(sources / "src", store, config=IngestConfig(workers=1, windows=("lung",), shard_bytes=600 << 10))
    shards = read_manifest(store).shards
    assert len(shards) >= 2
    hot = disk / "hot"
    filler = fill(disk, (shards[0].bytes // PAGE + 2) * PAGE)  # room for the first shard's copy only
    line = error_line(medload("cache", "warm", store, "--hot-dir", hot, "--hot-budget", "1GB"))
    assert f"no space left on the disk of {hot}" in line and "while copying shard" in line
    assert "lower the hot-shard budget" in line
    assert not list(hot.glob("*.partial"))
    status = medload("cache", "status", store, "--hot-dir", hot, "--hot-budget", "1GB")
    assert f"1 of {len(shards)} shard(s) of {store} are hot" in status.stdout
    assert len(assert_intact(store, sources / "reference")) == 6
    filler.unlink()
    proc = medload("cache", "warm", store, "--hot-dir", hot, "--hot-budget", "1GB")
    assert proc.returncode == 0 and f"{len(shards) - 1} copied, 1 already hot" in proc.stdout, proc.stdout + proc.stderr


def test_store_json_is_never_cut_short_by_a_full_disk(disk):
    """A write of the manifest that does not fit fails whole: the old store.json stays, no temporary is left."""
    small = Manifest(codec="raw", windows=(), key_fingerprint="f" * 16, created_by="test")
    write_manifest(disk, small)
    before = (disk / "store.json").read_bytes()
    big = Manifest(codec="raw", windows=(), key_fingerprint="f" * 16, created_by="test",
                   shards=[ShardEntry(name=f"shard-{i:04d}", series=1, bytes=1, digest="0" * 32) for i in range(400)])
    fill(disk, 2 * PAGE)  # the big manifest takes about 50 KB
    with pytest.raises(OSError, match="No space left") as caught:
        write_manifest(disk, big)
    assert caught.value.errno == 28  # ENOSPC
    assert (disk / "store.json").read_bytes() == before and not (disk / "store.json.tmp").exists()


def test_the_python_api_raises_disk_full_error_naming_the_stage(disk, sources):
    fill(disk, 300 << 10)
    with pytest.raises(DiskFullError) as caught:
        ingest(sources / "src", disk / "store", config=CFG)
    assert caught.value.stage == "commit" and caught.value.path == str(disk / "store")


def test_disk_full_while_spooling_from_a_pacs_names_the_spool_and_leaves_no_part_file(disk):
    """Instances retrieved from a PACS are spooled under STORE/staging (DICOMweb and DIMSE alike): a full
    disk there is one DiskFullError at stage ``spool`` naming the spool, and the cut file is removed."""
    from medload.deid import Pseudonymizer
    from medload.pacs.ingest import Spool

    path = disk / "store" / "staging" / "dicomweb"
    with Spool(path, Pseudonymizer(b"k" * 32), batch=50) as spool:
        with pytest.raises(DiskFullError) as caught, spool.file("1.2.826.0.1.3680043.8.498.1") as out:
            out.write(b"\0" * (32 << 20))  # twice the disk
        assert caught.value.stage == "spool" and caught.value.path == str(path)
        assert f"no space left on the disk of {path}" in str(caught.value) and "one batch of about 50" in str(caught.value)
        assert spool.usage() == (0, 0)
        with spool.file("1.2.826.0.1.3680043.8.498.2") as out:  # the space is back: the next instance spools
            out.write(b"DICM")
        assert spool.usage() == (1, 4)


@pytest.mark.dask
def test_disk_full_in_a_dask_task_stops_the_run_as_without_dask(disk, sources):
    """``--scheduler``: a Dask task that meets a full disk while writing its shard stops the run with the
    same one error line as an ingest without Dask (not a "failed" row per series, exit 1), keeps what was
    published, and the same command run again once there is space completes.

    The disk may fill while the next task writes its shard or while this process publishes the previous
    one (renamed into ``shards/``, store.json not yet rewritten): the rerun then lists that shard first,
    saying so, and counts its series as present."""
    store = disk / "store"
    filler = fill(disk, 500 << 10)  # room for two series or so of six
    line = error_line(ingest_cli(sources / "src", store, "--scheduler", "local:1"))
    assert f"no space left on the disk of {store}" in line, line
    assert re.search(r"while (writing series|publishing shard) ", line), line
    stored = assert_intact(store, sources / "reference")
    assert len(stored) < 6
    unlisted = {p.name[: -len(".lmdb")] for p in (store / "shards").glob("*.lmdb")} - {
        s.name for s in read_manifest(store).shards}
    assert len(unlisted) <= 1 and (not unlisted or "publishing shard" in line), (unlisted, line)

    filler.unlink()
    proc = ingest_cli(sources / "src", store, "--scheduler", "local:1")
    # nothing of Dask's own logging without -v; only the line that lists a shard the full disk left unlisted
    logged = " ".join(proc.stderr.split())  # the log handler wraps long lines
    for name in unlisted:
        logged = re.sub(rf"\[[^]]*\] WARNING shard {name} is in shards/ but not in store\.json \([^)]*\); listing it",
                        "", logged)
    assert proc.returncode == 0 and logged.strip() == "", proc.stderr
    present = len(stored) + sum(s.series for s in read_manifest(store).shards if s.name in unlisted)
    assert f"{6 - present} ingested, {present} already present" in proc.stdout, (present, proc.stdout)
    assert sorted(assert_intact(store, sources / "reference")) == sorted(r.key for r in open_store(sources / "reference").series())
    # a task still running when the run stopped may leave task shards behind: the next run removes them
    assert not list((store / "staging").glob("dask-*"))

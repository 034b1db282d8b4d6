"""Ingest on Dask (real LocalClusters): the store equals a one-machine ingest of the same sources, a
worker killed mid-ingest changes nothing, a task run twice is published once, and clusters whose
workers cannot isolate decoding are refused with the fix."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dask
import pytest
from conftest import DATA, PHILIPS, store_dump
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin
from hypothesis import given
from hypothesis import strategies as st

from medload.config import IngestConfig
from medload.errors import ConfigError, StoreError
from medload.ingest.cluster import local_cluster, parse_scheduler
from medload.ingest.dask_engine import cut_batches
from medload.ingest.run import ingest
from medload.storage.records import SeriesRecord
from medload.storage.store import open_store
from medload.storage.task_shard import TaskShardWriter
from medload.storage.verify import verify_store
from medload.storage.writer import StoreWriter
from medload.synthetic import SeriesSpec, make_study

pytestmark = pytest.mark.dask

TESTS = Path(__file__).resolve().parents[1]
MEDLOAD = [sys.executable, "-m", "medload.cli"]
RLE = "1.2.840.10008.1.2.5"


def _specs(n: int, size: int, slices: int) -> list[SeriesSpec]:
    kinds = [dict(), dict(orientation="oblique", signed=True, bits_stored=16, per_slice_intercept=True),
             dict(orientation="oblique", transfer_syntax=RLE)]
    return [SeriesSpec(n_slices=slices, rows=size, cols=size, **kinds[i % 3]) for i in range(n)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    """The Philips sample, the GE series with its DICOM SEG, six synthetic series and two broken files."""
    root = tmp_path_factory.mktemp("dask-sources")
    make_study(root / "synthetic", _specs(6, 64, 20), seed=3)
    (root / "broken").mkdir()
    (root / "broken" / "notes.txt").write_text("not DICOM\n")
    first = sorted((root / "synthetic").iterdir())[0]
    (root / "broken" / "truncated.dcm").write_bytes(first.read_bytes()[:300])
    return [PHILIPS / "dicom", DATA / "ge_ct_3slice_seg" / "ct-3slice", DATA / "ge_ct_3slice_seg" / "liver.dcm",
            root / "synthetic", root / "broken"]


@pytest.fixture(scope="module")
def reference(sources, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("reference") / "store"
    ingest(sources, store, config=IngestConfig(workers=2, windows=("lung",)))
    return store


def _ls(store: Path) -> list[dict]:
    proc = subprocess.run([*MEDLOAD, "ls", str(store), "--json"], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_dask_ingest_stores_what_one_machine_stores(sources, reference, tmp_path):
    store = tmp_path / "store"
    proc = subprocess.run([*MEDLOAD, "ingest", *map(str, sources), str(store), "--scheduler", "local:2", "--windows",
                           "lung", "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ours, theirs = _ls(store), _ls(reference)
    assert len(ours) == 8  # Philips + GE + 6 synthetic
    assert {(r["key"], r["digest"]) for r in ours} == {(r["key"], r["digest"]) for r in theirs}
    # every record, slice, window plane, label, index entry and quarantine record: the same bytes
    assert store_dump(open_store(store)) == store_dump(open_store(reference))
    labelled = [r["key"] for r in ours if open_store(store).labels(r["key"]) is not None]
    assert len(labelled) == 1, "the GE series carries its SEG"
    assert len(open_store(store).manifest.shards) > 1  # written by several tasks
    assert verify_store(store).ok
    assert not list((store / "staging").iterdir()), "the run's staging directory is removed"
    assert "8 ingested, 0 already present" in " ".join(proc.stdout.split())


def test_a_second_dask_ingest_adds_nothing(sources, reference, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(reference, store)
    before = store_dump(open_store(store))
    report = ingest(sources, store, config=IngestConfig(windows=("lung",)), scheduler="local:2")
    assert report.counts["present"] == 8 and report.counts["ingested"] == 0
    assert store_dump(open_store(store)) == before


class _Faults(WorkerPlugin):
    """Install the test decoder that crashes on marked HTJ2K frames in every worker, restarted ones too."""

    def setup(self, worker):
        sys.path.insert(0, str(TESTS))
        from helpers import decoder_faults

        decoder_faults.install()


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(2) as cluster, Client(cluster) as client:
        yield client


def test_a_decoder_crash_in_a_dask_task_is_quarantined(cluster, tmp_path):
    from test_bad_input import _write_faults

    src = tmp_path / "src"
    make_study(src, _specs(2, 32, 6), seed=5)
    bad = _write_faults(src, tmp_path / "scratch")
    segv = next(b for b in bad if "segv" in b.name)
    for b in bad:
        if b is not segv:
            Path(b.name).unlink()
    cluster.register_plugin(_Faults())
    report = ingest([src], tmp_path / "store", config=IngestConfig(decode_timeout=60),
                    scheduler=cluster.scheduler.address)
    assert report.counts["ingested"] == 2
    (record,) = [r for r in report.rejects if r.source == segv.name]
    assert "SIGSEGV" in record.reason and record.sha256 == segv.sha256
    assert verify_store(tmp_path / "store").ok


def test_dask_header_tasks_sniff_the_files_and_archives_are_read_after(cluster, tmp_path):
    """Discovery reads no file on Dask either: the header tasks sniff them; what is quarantined at the
    discover stage and the files counted equal what a sniffing discovery finds, and the series in a zip
    inside the folder are stored."""
    import zipfile

    from medload.ingest.discover import DiscoveryProblem, discover

    src, zipped = tmp_path / "src", tmp_path / "zipped"
    make_study(src / "plain", _specs(1, 32, 6), seed=7)
    make_study(zipped, _specs(1, 32, 5), seed=8)
    with zipfile.ZipFile(src / "export.zip", "w") as archive:
        for path in sorted(zipped.rglob("*.dcm")):
            archive.write(path, path.relative_to(zipped).as_posix())
    (src / "README.txt").write_text("a study export")
    (src / "zeros.dcm").write_bytes(bytes(1024))
    found = list(discover(src, spool_dir=tmp_path / "spool"))
    problems = sorted((p.status, p.reason, p.display) for p in found if isinstance(p, DiscoveryProblem))
    report = ingest([src], tmp_path / "store", scheduler=cluster.scheduler.address)
    assert report.counts["ingested"] == 2
    assert report.files == sum(not isinstance(f, DiscoveryProblem) for f in found) == 11
    assert sorted((r.status, r.reason, r.source) for r in report.rejects if r.stage == "discover") == problems
    assert len(problems) == 2


def _count_decoder_forks() -> None:
    """On a worker: count the decoding processes its tasks fork (shard_tasks.isolated_pool)."""
    from medload.ingest import shard_tasks

    forked = shard_tasks.isolated_pool

    def counted(setup):
        shard_tasks._test_forks += 1
        return forked(setup)

    shard_tasks._test_forks, shard_tasks._test_forked = 0, forked
    shard_tasks.isolated_pool = counted


def _forks_and_kept() -> tuple[int, bool, bool]:
    """On a worker: the decoders forked since _count_decoder_forks (which it undoes), whether it still keeps
    one, and whether keeping is on."""
    from medload.ingest import shard_tasks

    shard_tasks.isolated_pool = shard_tasks._test_forked
    kept = shard_tasks._kept
    return shard_tasks._test_forks, kept is not None and kept.pool is not None, kept is not None and kept.on


def test_single_threaded_workers_keep_one_decoder_for_the_run_and_release_it(cluster, tmp_path):
    """Each single-threaded worker forks one decoding process for all the header and series tasks it runs
    (not one per task), and closes it when the run ends: a cluster may serve other work."""
    src = tmp_path / "src"
    make_study(src, _specs(6, 32, 6), seed=8)
    cluster.run(_count_decoder_forks)
    try:
        report = ingest([src], tmp_path / "store", scheduler=cluster.scheduler.address)
    finally:
        after = cluster.run(_forks_and_kept)
    assert report.counts["ingested"] == 6
    assert len(open_store(tmp_path / "store").manifest.shards) > 2  # several series tasks (and 8 header tasks)
    assert all(forks <= 1 for forks, _, _ in after.values()) and sum(f for f, _, _ in after.values()) >= 1
    assert all(not held and not on for _, held, on in after.values())  # released at the end of the run
    assert verify_store(tmp_path / "store").ok


def test_killing_a_dask_worker_mid_ingest_loses_and_duplicates_nothing(cluster, tmp_path):
    src = tmp_path / "src"
    make_study(src, _specs(16, 192, 48), seed=11)
    reference = tmp_path / "reference"
    ingest([src], reference, config=IngestConfig(workers=2))
    store = tmp_path / "store"
    pids = cluster.run(os.getpid)
    outcome: dict = {}

    def run():
        try:
            outcome["report"] = ingest([src], store, scheduler=cluster.scheduler.address)
        except BaseException as exc:  # noqa: BLE001 -- re-raised by the test below
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and thread.is_alive() and time.monotonic() < deadline:
        started = list((store / "staging").glob("dask-*/*.lmdb")) if (store / "staging").exists() else []
        busy = [w for w, keys in cluster.processing().items() if any("medload-series" in str(k) for k in keys)]
        if started and busy:
            killed = busy[0]
            os.kill(pids[killed], signal.SIGKILL)
        time.sleep(0.01)
    thread.join(120)
    assert killed is not None, "the ingest finished before a series task was seen running"
    assert "error" not in outcome, outcome.get("error")
    report = outcome["report"]
    assert report.counts["ingested"] == 16 and report.counts["failed"] == 0
    cluster.wait_for_workers(2, timeout=30)
    assert pids[killed] not in cluster.run(os.getpid).values(), "the nanny started a new worker"
    keys = [r["key"] for r in _ls(store)]
    assert len(keys) == len(set(keys)) == 16
    assert store_dump(open_store(store)) == store_dump(open_store(reference))
    assert verify_store(store).ok


def test_a_task_that_ran_twice_is_published_once(tmp_path):
    """Dask may run a task twice and both attempts may finish: the second shard holds series the store has
    by then, so adopting it is refused and it stays out of the manifest."""
    store = tmp_path / "store"
    record = SeriesRecord(key="ab" * 16, shape=(1, 2, 2), dtype="int16", spacing=(1.0, 1.0, 1.0),
                          affine=tuple(tuple(float(i == j) for j in range(4)) for i in range(4)), modality="CT",
                          digest="0" * 32, orientation=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0), positions=((0.0, 0.0, 0.0),),
                          patient="p", study="s", series="1.2.3", source_fingerprint="f", sources=("h",))
    attempts = []
    for n in range(2):
        shard = TaskShardWriter(tmp_path / "staging" / f"000000-{n}.lmdb", ())
        txn = shard.begin_series(bytes.fromhex(record.key), 1 << 16)
        txn.put_slice(0, b"value")
        txn.commit(record, {"modality": "CT"})
        assert shard.close()
        attempts.append(shard.path)
    with StoreWriter(store, codec="raw", windows=(), key_fingerprint="test") as writer:
        assert set(writer.adopt(attempts[0])) == {bytes.fromhex(record.key)}
        with pytest.raises(StoreError, match="already in"):
            writer.adopt(attempts[1])
    assert len(open_store(store).manifest.shards) == 1 and attempts[1].is_dir()
    assert [r.key for r in open_store(store).series()] == [record.key]


@pytest.fixture(scope="module")
def big_sources(tmp_path_factory) -> Path:
    """Sixteen series of 48 slices of 192x192: some seconds of Dask tasks, so a signal lands mid-run."""
    src = tmp_path_factory.mktemp("big") / "src"
    make_study(src, _specs(16, 192, 48), seed=11)
    return src


@pytest.mark.parametrize(("signum", "line", "code"), [(signal.SIGINT, "error: interrupted", 130),
                                                      (signal.SIGTERM, "error: terminated", 143)])
def test_a_signal_stops_a_dask_ingest_with_one_line_and_a_clean_store(big_sources, tmp_path, signum, line, code):
    """Ctrl-C (or SIGTERM to the process group, as `kill -TERM -PGID` or a batch system sends it) while tasks
    write their shards: the workers neither print tracebacks nor get restarted, the run's staging directory
    is removed, and the store verifies clean."""
    store = tmp_path / "store"
    proc = subprocess.Popen([*MEDLOAD, "ingest", str(big_sources), str(store), "--scheduler", "local:2",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        while proc.poll() is None and not list(store.glob("staging/dask-*/*.lmdb")):  # a task is writing
            time.sleep(0.01)
        assert proc.poll() is None, "the ingest finished before a series task was seen writing"
        os.killpg(proc.pid, signum)  # what the terminal does on Ctrl-C: every process of the ingest
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert [text for text in err.splitlines() if text.strip()] == [line], err  # click closes a ^C echo: a blank line
    assert not list((store / "staging").iterdir()), "the run's staging directory is removed"
    assert verify_store(store).ok


def test_workers_that_cannot_isolate_decoding_are_refused(tmp_path):
    with dask.config.set({"distributed.worker.daemon": True}):
        daemonic = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=None)
    try:
        with pytest.raises(ConfigError, match="DASK_DISTRIBUTED__WORKER__DAEMON=False"):
            ingest([PHILIPS / "dicom"], tmp_path / "store", scheduler=daemonic.scheduler_address)
    finally:
        daemonic.close()
    assert not (tmp_path / "store" / "store.json").exists()


@pytest.mark.parametrize(("text", "parsed"), [("local", ("local", None)), ("local:3", ("local", 3)),
                                          ("tcp://10.0.0.5:8786", ("address", "tcp://10.0.0.5:8786")),
                                          ("tls://head:8786", ("address", "tls://head:8786")),
                                          ("slurm", ("slurm", None)), ("slurm:8", ("slurm", 8))])
def test_scheduler_forms(text, parsed):
    assert parse_scheduler(text) == parsed


@pytest.mark.parametrize("text", ["local:0", "local:x", "yarn", "http://head:8786", "slurm:-1"])
def test_bad_scheduler_is_an_error_listing_the_forms(text):
    with pytest.raises(ConfigError, match="local:N"):
        parse_scheduler(text)


def test_the_slurm_job_lets_workers_start_decoding_processes():
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is an optional extra (medload[slurm])")
    from medload.ingest.cluster import slurm_cluster

    with dask.config.set({"jobqueue.slurm.cores": 4, "jobqueue.slurm.memory": "16GB"}):
        cluster = slurm_cluster()
        try:
            script = cluster.job_script()
        finally:
            cluster.close()
    assert "export DASK_DISTRIBUTED__WORKER__DAEMON=False" in script
    assert "distributed.cli.dask_worker" in script or "dask worker" in script or "dask-worker" in script


@given(st.lists(st.integers(1, 10**6), max_size=60), st.integers(1, 64), st.integers(1, 10**7))
def test_batches_cover_every_series_once_in_order_within_bounds(sizes, parts, limit):
    runs = cut_batches(sizes, parts, limit)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    target = max(1, min(limit, -(-sum(sizes) // parts)))
    for r in runs:
        assert len(r) == 1 or sum(sizes[i] for i in r) <= target
    if sizes and limit >= -(-sum(sizes) // parts) and max(sizes) <= target // 2:
        assert len(runs) <= 2 * parts + 1

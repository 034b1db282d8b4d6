"""Supervised decoding processes (medload.ingest.isolation): a task's input that crashes, exhausts or
hangs its worker comes back as ``Lost`` naming that input; the pool replaces the worker and runs on.
Then the same through ``ingest``: an input that crashes the header pass or the decoder is quarantined
and everything else is stored, with 1 worker as with 2."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time
from pathlib import Path

import pytest

import medload.ingest.pixels as pixels
import medload.ingest.worker as worker
from medload.config import IngestConfig, load_config
from medload.errors import ConfigError, MedloadError
from medload.ingest.isolation import IsolatedPool, Lost, mark
from medload.synthetic import SeriesSpec, make_series

CAP = 400 * 10**6


# ---- tasks, run in forked workers (module-level, so they pickle by name) --------------------------
def _nothing(*args) -> None:
    return None


def _die_at_start(*args) -> None:
    os._exit(7)


def _items(items: list[str]) -> list[str]:
    """Walk ``items``, marking each; some of them misbehave."""
    out = []
    for i, item in enumerate(items):
        mark(i)
        if item == "segv":
            ctypes.string_at(0)
        elif item == "abort":
            os.abort()
        elif item == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif item == "exit":
            os._exit(3)
        elif item == "hang":
            time.sleep(3600)
        elif item == "big":
            try:
                bytearray(CAP)
            except MemoryError:
                item = "MemoryError"
        elif item == "raise":
            raise ValueError("a bug in a task")
        elif item == "limit":
            item = str(resource.getrlimit(resource.RLIMIT_DATA)[0])
        out.append(item)
    return out


def test_faults_come_back_as_lost_inputs_and_the_pool_goes_on():
    started = time.monotonic()
    with IsolatedPool(2, _nothing, (), memory=CAP, timeout=5.0) as pool:  # only "hang" should meet it, even under load
        batches = [["a", "b"], ["c", "segv", "d"], ["e"], ["f", "hang"], ["kill"], ["g", "exit"], ["abort", "h"],
                   ["big", "i"], ["limit"], ["j"] * 3]
        results = [pool.wait(job) for job in [pool.submit(_items, b) for b in batches]]
    assert results[0] == ["a", "b"] and results[2] == ["e"] and results[9] == ["j"] * 3
    assert results[1] == Lost(1, "decoder process killed by signal 11 (SIGSEGV)")
    assert results[3] == Lost(1, "took longer than 5 s (--decode-timeout)")
    assert results[4].index == 0 and results[4].reason.startswith("decoder process killed by signal 9 (SIGKILL")
    assert results[5] == Lost(1, "decoder process exited with status 3")
    assert results[6] == Lost(0, "decoder process killed by signal 6 (SIGABRT)")
    assert results[7] == ["MemoryError", "i"]  # the cap stops the allocation, the worker lives on
    assert CAP <= int(results[8][0]) != resource.RLIM_INFINITY  # the cap (more if the worker inherited much)
    assert time.monotonic() - started < 600  # the hung task was stopped, not waited out (it sleeps an hour)


def test_tasks_queued_behind_a_crash_run_on_a_new_worker():
    with IsolatedPool(1, _nothing, ()) as pool:
        jobs = [pool.submit(_items, b) for b in (["segv"], ["a"], ["b", "c"])]
        assert [pool.wait(j) for j in jobs] == [Lost(0, "decoder process killed by signal 11 (SIGSEGV)"), ["a"],
                                                ["b", "c"]]


def _noted_result(arg: tuple[str, int]) -> bytes:
    """A 48 KB result, after noting in ``path`` that task ``n`` ran to its end."""
    path, n = arg
    with open(path, "a") as f:
        f.write(f"{n}\n")
    return bytes(48 << 10)


def test_a_worker_works_through_its_queue_while_nobody_takes_its_results(tmp_path: Path):
    """A writer committing a series takes no results for a while: a worker holding ``queued`` tasks runs them
    all meanwhile -- its results pipe holds theirs (two 48 KB results overfill a default 64 KB pipe)."""
    done = tmp_path / "done"
    with IsolatedPool(1, _nothing, ()) as pool:
        pool.queued = 6
        jobs = [pool.submit(_noted_result, (str(done), n)) for n in range(6)]
        deadline = time.monotonic() + 120  # generous: only a blocked worker fails it
        while not (done.exists() and len(done.read_text().split()) == 6) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.read_text().split() == [str(n) for n in range(6)]  # every task ran, none result taken yet
        assert [len(pool.wait(j)) for j in jobs] == [48 << 10] * 6


def test_a_task_that_raises_is_a_bug_not_a_bad_input():
    with IsolatedPool(1, _nothing, ()) as pool, pytest.raises(RuntimeError, match="a bug in a task"):
        pool.wait(pool.submit(_items, ["raise"]))


def test_workers_that_die_before_any_input_stop_the_run():
    with pytest.raises(MedloadError, match="before their first input"), IsolatedPool(1, _die_at_start, ()) as pool:
        pool.wait(pool.submit(_items, ["a"]))


def test_settings_come_from_toml_and_are_checked(tmp_path: Path):
    path = tmp_path / "medload.toml"
    path.write_text('[ingest]\nworker_memory = "1GB"\ndecode_timeout = 30\nplausibility = "flag"\n')
    cfg = load_config(path).ingest
    assert (cfg.worker_memory, cfg.decode_timeout, cfg.plausibility) == (10**9, 30.0, "flag")
    with pytest.raises(ConfigError, match="plausibility"):
        IngestConfig(plausibility="maybe")
    with pytest.raises(ConfigError, match=">= 0"):
        IngestConfig(decode_timeout=-1)


# ---- through ingest --------------------------------------------------------------------------------
@pytest.fixture
def two_series(tmp_path: Path):
    src = tmp_path / "src"
    gens = [make_series(src / f"s{i}", SeriesSpec(n_slices=6, rows=16, cols=16), seed=80 + i, series_number=i + 1)
            for i in range(2)]
    return src, gens


@pytest.mark.parametrize("workers", [1, 2])
def test_a_header_pass_crash_quarantines_only_its_file(two_series, run_ingest, monkeypatch, workers):
    src, gens = two_series
    culprit = gens[0].paths[2]
    real = worker.read_headers

    def crashing(ref, *args):
        if ref.path == str(culprit):
            ctypes.string_at(0)
        return real(ref, *args)

    monkeypatch.setattr(worker, "read_headers", crashing)  # forked workers inherit the patch
    report, store = run_ingest(src, workers=workers)
    files = [r for r in report.quarantined("rejected") if r.series is None]
    assert [(r.source, r.stage, r.reason) for r in files] == [
        (str(culprit), "header", "decoder process killed by signal 11 (SIGSEGV)")]
    assert files[0].sha256
    # the file's series lacks a slice (a gap: rejected); every other file of its batch was read again
    assert report.count("ingested") == 1 and report.count("rejected") == 1
    assert store.series()[0].shape[0] == 6


@pytest.mark.parametrize("workers", [1, 2])
def test_a_decoder_crash_rejects_only_its_series(two_series, run_ingest, monkeypatch, workers):
    src, gens = two_series
    culprit = gens[1].paths[4]
    real = pixels.decode_plane

    def crashing(file, h, *args):
        if h.ref.path == str(culprit):
            ctypes.string_at(0)
        return real(file, h, *args)

    monkeypatch.setattr(worker, "decode_plane", crashing)
    report, store = run_ingest(src, workers=workers)
    rejected = report.quarantined("rejected")
    assert [(r.source, r.stage, r.reason) for r in rejected] == [
        (str(culprit), "decode", "decoder process killed by signal 11 (SIGSEGV)")]
    assert report.count("ingested") == 1 and len(store.series()) == 1


@pytest.mark.parametrize(("files", "batches"), [(40, 2), (1000, 17), (5000, 40)])
def test_header_batches_are_eight_a_worker_of_32_to_128_files(tmp_path, monkeypatch, files, batches):
    """Few large batches cost the ingest process less (a message each way and a poll per batch), many small
    ones even out the workers' ends: at least 8 a worker, 32 to 128 files each; every file is read once."""
    from medload.deid import Pseudonymizer
    from medload.ingest.discover import SourceRef
    from medload.ingest.report import IngestReport
    from medload.ingest.stages import header_pass

    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not DICOM" * 20)
    refs = [SourceRef(str(junk), None, 180) for _ in range(files)]
    sizes: list[int] = []
    with IsolatedPool(2, worker.init_worker, (Pseudonymizer(b"k" * 32), IngestConfig())) as pool:
        submit = pool.submit
        monkeypatch.setattr(pool, "submit", lambda fn, batch: sizes.append(len(batch)) or submit(fn, batch))
        report = IngestReport(store="")
        assert header_pass(pool, refs, report, False, []) == []
    assert len(sizes) == batches and sum(sizes) == files and max(sizes) <= 128
    assert len(report.rejects) == files  # each file read, and refused, once

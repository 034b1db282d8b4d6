"""Ingest on a Dask cluster: the header pass and decoding run as tasks, this process publishes.

1. Header pass: the discovered inputs are cut into batches (about four per worker thread, at most
   2048 files each); a task reads its batch's headers (:func:`~medload.ingest.stages.header_pass`) in a
   supervised decoding process -- a single-threaded worker keeps one for all its tasks of the run
   (:func:`~medload.ingest.shard_tasks.keep_across_tasks`) -- and returns planes, label objects and
   quarantine records.
2. This process groups series and plans their geometry, exactly as an ingest without Dask does.
3. The planned series are written by tasks into shards of their own under ``staging/dask-<run>/``, as
   :mod:`medload.ingest.shard_tasks` describes (about four batches per worker thread).
4. As each task finishes, this process -- the store's one writer -- publishes its shard
   (:meth:`~medload.storage.writer.StoreWriter.adopt`: a rename into ``shards/`` and an atomic rewrite
   of ``store.json``). Dask runs a task *at least* once (a task whose worker died is run again; an
   attempt may leave a half-written shard behind): only the finished shard of the one result a batch's
   future delivers is published, the run's directory is removed at the end, and ``adopt`` refuses a
   shard holding a series the store already has. A batch whose task fails outright is reported
   ``failed`` (exit 1) and nothing of it is stored; running the ingest again retries it. A task that
   meets a full disk stops the run with its DiskFullError, as an ingest without Dask does.
5. Labels are written by this process once their series are published, in a transaction of their
   own (as for a series stored before the run).

Slice bytes, records and digests equal those of an ingest without Dask; only the grouping of series
into shards differs. See ``docs/dask.md`` for running it on a cluster or on Slurm.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path
from typing import Any

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import MedloadError
from medload.ingest.cluster import check_workers_see, connect
from medload.ingest.discover import SourceRef
from medload.ingest.headers import SliceHeader
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput
from medload.ingest.report import IngestReport
from medload.ingest.shard_tasks import (
    BatchResult,
    cut_batches,
    keep_across_tasks,
    release_kept,
    task_pool,
    write_in_tasks,
)
from medload.ingest.stages import SeriesPlan, header_pass
from medload.progress import progress_bar
from medload.storage.records import RejectRecord
from medload.storage.writer import StoreWriter

__all__ = ["DaskEngine", "cut_batches"]

log = logging.getLogger(__name__)

_TASKS_PER_THREAD = 4
_HEADER_TASK_FILES = 2048


# ---- tasks (run on the workers) -------------------------------------------------------------------
def _header_task(refs: list[SourceRef], setup: tuple[Pseudonymizer, IngestConfig]) -> tuple[
        list[SliceHeader], list[LabelInput], list[RejectRecord], list[tuple[SourceRef, str]], int, int]:
    """The header pass over ``refs``, discovered unread (it sniffs them): the headers, labels, quarantine
    records and archives found, and how many files and bytes those not DICOM take off the report's count."""
    report = IngestReport(store="")
    labels: list[LabelInput] = []
    archives: list[tuple[SourceRef, str]] = []
    with task_pool(setup) as (pool, _):
        headers = header_pass(pool, refs, report, False, labels, archives)
    return headers, labels, report.rejects, archives, report.files, report.bytes


class _DaskRunner:
    """Series tasks on the Dask client (see :class:`~medload.ingest.shard_tasks.TaskRunner`)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def submit(self, key: str, fn: Callable[..., BatchResult], *args: object) -> Any:
        return self.client.submit(fn, *args, pure=False, key=key)

    def completed(self, futures: list[Any]) -> Iterable[Any]:
        return _as_completed(futures)

    def result(self, future: Any) -> BatchResult:
        try:
            return future.result()
        finally:
            future.release()

    def cancel(self, futures: list[Any]) -> None:
        self.client.cancel(futures)


# ---- the coordinator ------------------------------------------------------------------------------
class DaskEngine:
    """The header pass and the writing of series as tasks on the Dask cluster ``scheduler``
    (see :mod:`medload.ingest.cluster`), for :func:`medload.ingest.ingest`."""

    def __init__(self, scheduler: str, cfg: IngestConfig, pseudo: Pseudonymizer, store: Path) -> None:
        self.cfg = cfg
        self._run_dir: Path | None = None  # staging/dask-<run>, once write() made it
        self._connection = connect(scheduler, cfg.worker_count)
        self.client = self._connection.__enter__()
        try:
            workers = self.client.scheduler_info()["workers"].values()
            self.threads = sum(w["nthreads"] for w in workers)
            # a worker running one task at a time keeps its decoding process and ring from task to task
            # (released at the end of the run); one with several threads forks one per task
            self._kept = all(w["nthreads"] == 1 for w in workers)
            if self._kept:
                self.client.run(keep_across_tasks)
            self._setup = self.client.scatter((pseudo, cfg), broadcast=True)
            self._run = secrets.token_hex(4)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> DaskEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (and a cluster started for the run, stopping its workers), then remove the run's
        directory: a task still running when the ingest stopped (Ctrl-C) writes there until its worker stops."""
        try:
            if getattr(self, "_kept", False):
                with suppress(Exception):  # a worker lost or a cluster gone: its processes went with it
                    self.client.run(release_kept)
            self._connection.__exit__(None, None, None)
        finally:
            if self._run_dir is not None:
                shutil.rmtree(self._run_dir, ignore_errors=True)

    def headers(self, refs: list[SourceRef], report: IngestReport, progress: bool, label_inputs: list[LabelInput],
                archives: list[tuple[SourceRef, str]] | None = None) -> list[SliceHeader]:
        """As :meth:`LocalEngine.headers <medload.ingest.local_engine.LocalEngine.headers>`: ``archives``
        given, ``refs`` were discovered unread and the tasks sniff them."""
        if not refs:
            return []
        check_workers_see(self.client, refs[0].path, "the source")
        batches = cut_batches([1] * len(refs), _TASKS_PER_THREAD * self.threads, _HEADER_TASK_FILES)
        futures = {self.client.submit(_header_task, refs[b.start : b.stop], self._setup, pure=False,
                                      key=f"medload-headers-{self._run}-{i}"): i for i, b in enumerate(batches)}
        results: dict[int, tuple] = {}
        with progress_bar("reading headers (Dask)", len(refs), enabled=progress) as advance:
            for future in _as_completed(list(futures)):
                i = futures[future]
                try:
                    results[i] = future.result()
                except Exception as exc:  # noqa: BLE001 -- the task failed on the cluster, not an input
                    b = batches[i]
                    raise MedloadError(f"the Dask task reading the headers of {refs[b.start].display} and "
                                       f"{len(b) - 1} more files failed ({type(exc).__name__}: {exc}); nothing "
                                       "was written: run the ingest again") from None
                advance(len(batches[i]))
                future.release()
        headers: list[SliceHeader] = []
        for i in range(len(batches)):
            found, labels, rejects, archived, files, size = results[i]
            headers += found
            label_inputs += labels
            report.rejects += rejects
            report.files += files
            report.bytes += size
            if archives is not None:
                archives += archived
        return headers

    def write(self, plans: list[SeriesPlan], writer: StoreWriter, report: IngestReport, progress: bool,
              labels: LabelAssigner | None) -> None:
        staging = writer.root / "staging"
        for old in staging.glob("dask-*"):  # left by a run that died; we hold the writer lock
            shutil.rmtree(old, ignore_errors=True)
        if not plans:
            return
        run_dir = self._run_dir = staging / f"dask-{self._run}"
        run_dir.mkdir(mode=0o700)
        check_workers_see(self.client, str(run_dir), "the store's staging directory")
        write_in_tasks(_DaskRunner(self.client), plans, writer, report, parts=_TASKS_PER_THREAD * self.threads,
                       prefix=f"{run_dir}/", setup=self._setup, progress=progress, labels=labels, name=self._run)


def _as_completed(futures):
    from distributed import as_completed  # an optional extra: imported where used

    return as_completed(futures)

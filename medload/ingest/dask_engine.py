"""Ingest on a Dask cluster: the header pass and decoding run as tasks, this process publishes.

1. Header pass: the discovered inputs are cut into batches (about four per worker thread, at most
   2048 files each); a task reads its batch's headers in a decoding process of its own
   (:func:`~medload.ingest.stages.header_pass`) and returns planes, label objects and quarantine records.
2. This process groups series and plans their geometry, exactly as an ingest without Dask does.
3. The planned series are cut into batches of consecutive series (about four per worker thread, at
   most ``shard_bytes`` of pixels each, never less than one series): one task per batch decodes its
   series in a decoding process of its own and writes them, each in one transaction, into a staging
   shard of its own under ``staging/dask-<run>/`` (:class:`~medload.storage.task_shard.TaskShardWriter`).
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import DiskFullError, MedloadError
from medload.ingest.cluster import check_workers_see, connect
from medload.ingest.discover import SourceRef
from medload.ingest.headers import SliceHeader
from medload.ingest.isolation import IsolatedPool
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.stages import SeriesPlan, decode_and_write, header_pass
from medload.ingest.worker import init_worker
from medload.progress import progress_bar
from medload.storage.records import RejectRecord
from medload.storage.task_shard import TaskShardWriter
from medload.storage.writer import StoreWriter

__all__ = ["DaskEngine", "cut_batches"]

log = logging.getLogger(__name__)

_TASKS_PER_THREAD = 4
_HEADER_TASK_FILES = 2048


def cut_batches(sizes: Sequence[int], parts: int, limit: int) -> list[range]:
    """Consecutive runs of items covering ``sizes`` in order, aiming at ``parts`` runs of equal total
    size: each run holds one item, or items adding up to at most ``min(limit, ceil(total / parts))``."""
    target = max(1, min(limit, -(-sum(sizes) // max(1, parts))))
    runs, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > target:
            runs.append(range(start, i))
            start, held = i, 0
        held += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


# ---- tasks (run on the workers) -------------------------------------------------------------------
def _pool(setup: tuple[Pseudonymizer, IngestConfig]) -> IsolatedPool:
    pseudo, cfg = setup
    return IsolatedPool(1, init_worker, (pseudo, cfg), memory=cfg.worker_memory, timeout=cfg.decode_timeout)


def _header_task(refs: list[SourceRef], setup: tuple[Pseudonymizer, IngestConfig]
                 ) -> tuple[list[SliceHeader], list[LabelInput], list[RejectRecord]]:
    report = IngestReport(store="")
    labels: list[LabelInput] = []
    with _pool(setup) as pool:
        headers = header_pass(pool, refs, report, False, labels)
    return headers, labels, report.rejects


@dataclass
class _BatchResult:
    """What a series task did: the path of its finished shard (None if it committed nothing) and its report."""

    shard: str | None
    series: list[SeriesOutcome] = field(default_factory=list)
    rejects: list[RejectRecord] = field(default_factory=list)
    slices: int = 0


def _series_task(plans: list[SeriesPlan], shard_prefix: str, setup: tuple[Pseudonymizer, IngestConfig]) -> _BatchResult:
    cfg = setup[1]
    report = IngestReport(store="")
    path = Path(f"{shard_prefix}-{secrets.token_hex(4)}.lmdb")  # each attempt its own shard
    with _pool(setup) as pool:  # started before the shard's environment is opened (py-lmdb's fork rule)
        writer = TaskShardWriter(path, cfg.windows)
        try:
            decode_and_write(pool, writer, plans, cfg, report, False, None)
        finally:
            held = writer.close()
    return _BatchResult(str(path) if held else None, report.series, report.rejects, report.slices_written)


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
            self.threads = sum(w["nthreads"] for w in self.client.scheduler_info()["workers"].values())
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
            self._connection.__exit__(None, None, None)
        finally:
            if self._run_dir is not None:
                shutil.rmtree(self._run_dir, ignore_errors=True)

    def headers(self, refs: list[SourceRef], report: IngestReport, progress: bool,
                label_inputs: list[LabelInput]) -> list[SliceHeader]:
        if not refs:
            return []
        check_workers_see(self.client, refs[0].path, "the source")
        batches = cut_batches([1] * len(refs), _TASKS_PER_THREAD * self.threads, _HEADER_TASK_FILES)
        futures = {self.client.submit(_header_task, refs[b.start : b.stop], self._setup, pure=False,
                                      key=f"medload-headers-{self._run}-{i}"): i for i, b in enumerate(batches)}
        results: dict[int, tuple] = {}
        with progress_bar("reading headers (Dask)", len(refs), enabled=progress) as advance:
            for future in _as_completed(futures):
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
            found, labels, rejects = results[i]
            headers += found
            label_inputs += labels
            report.rejects += rejects
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
        results: dict[int, _BatchResult] = {}
        futures: dict = {}
        try:
            check_workers_see(self.client, str(run_dir), "the store's staging directory")
            batches = cut_batches([_pixel_bytes(p) for p in plans], _TASKS_PER_THREAD * self.threads,
                                  self.cfg.shard_bytes)
            futures = {self.client.submit(_series_task, [plans[j] for j in b], str(run_dir / f"{i:06d}"),
                                          self._setup, pure=False, key=f"medload-series-{self._run}-{i}"): i
                       for i, b in enumerate(batches)}
            total = sum(len(p.geom.slots) for p in plans)
            with progress_bar("decoding and writing slices (Dask)", total, enabled=progress) as advance:
                for future in _as_completed(futures):
                    i = futures[future]
                    batch = [plans[j] for j in batches[i]]
                    try:
                        result = future.result()
                    except DiskFullError:  # stops the run, as without Dask: what was published stays
                        raise
                    except Exception as exc:  # noqa: BLE001 -- the task failed on the cluster, not an input
                        result = _failed(batch, exc)
                    future.release()
                    if result.shard is not None:
                        stored = writer.adopt(Path(result.shard))
                        if labels is not None:
                            labels.stored.update(stored)
                    results[i] = result
                    advance(sum(len(p.geom.slots) for p in batch))
        finally:
            self.client.cancel(list(futures))
            for i in sorted(results):  # outcomes in plan order, as without Dask
                report.series += results[i].series
                report.rejects += results[i].rejects
                report.slices_written += results[i].slices


def _as_completed(futures):
    from distributed import as_completed

    return as_completed(list(futures))


def _pixel_bytes(plan: SeriesPlan) -> int:
    h = plan.cand.first
    return len(plan.geom.slots) * h.rows * h.cols * 2


def _failed(batch: list[SeriesPlan], exc: BaseException) -> _BatchResult:
    reason = (f"its Dask task failed ({type(exc).__name__}: {exc}); nothing of it was stored: run the ingest "
              "again to retry it")
    log.error("a Dask task writing %d series failed: %s", len(batch), exc)
    outcomes = [SeriesOutcome(p.cand.key.hex(), "failed", p.cand.first.modality, len(p.cand.headers),
                              (len(p.geom.slots), p.cand.first.rows, p.cand.first.cols), reason) for p in batch]
    return _BatchResult(None, outcomes)

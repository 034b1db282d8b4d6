"""Series written by tasks into shards of their own, published by the store's one writer.

Both engines that write in parallel -- this machine's task processes (:mod:`medload.ingest.local_engine`)
and a Dask cluster (:mod:`medload.ingest.dask_engine`) -- cut the planned series into batches of
consecutive series (:func:`cut_batches`: a few per worker, at most ``shard_bytes`` of pixels each, never
less than one series). One task per batch decodes its series in a supervised decoding process (its own,
or one its process keeps from task to task: :func:`keep_across_tasks`) and writes them, each in one
transaction, into a staging shard of its own (:class:`~medload.storage.task_shard.TaskShardWriter`): no
single process carries every slice's bytes.
As each task finishes, the caller -- the store's one writer -- publishes its shard
(:meth:`~medload.storage.writer.StoreWriter.adopt`, which refuses a shard holding a series the store
already has, so a task that ran twice is published once). A batch whose task fails outright is reported
``failed`` and nothing of it is stored; running the ingest again retries it. A task that meets a full disk
stops the run with its :class:`~medload.errors.DiskFullError`.

Slice bytes, records and digests equal those of one writer; only the grouping of series into shards differs.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any, Protocol

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import DiskFullError
from medload.ingest.isolation import IsolatedPool
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.ring import RingSupply
from medload.ingest.stages import SeriesPlan, decode_and_write
from medload.ingest.worker import init_worker
from medload.progress import progress_bar
from medload.storage.codec import get_codec
from medload.storage.records import RejectRecord
from medload.storage.task_shard import TaskShardWriter, shard_digest
from medload.storage.writer import StoreWriter

__all__ = ["BatchResult", "TaskRunner", "cut_batches", "isolated_pool", "keep_across_tasks", "release_kept",
           "series_task", "task_pool", "write_in_tasks"]

log = logging.getLogger(__name__)


def cut_batches(sizes: Sequence[int], parts: int, limit: int, floor: int = 0) -> list[range]:
    """Consecutive runs of items covering ``sizes`` in order, aiming at ``parts`` runs of equal total
    size: each run holds one item, or items adding up to at most ``min(limit, max(floor, ceil(total /
    parts)))`` (``floor``: no run cut smaller than that, so a small ingest is not spread over many shards)."""
    target = max(1, min(limit, max(floor, -(-sum(sizes) // max(1, parts)))))
    runs, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > target:
            runs.append(range(start, i))
            start, held = i, 0
        held += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def isolated_pool(setup: tuple[Pseudonymizer, IngestConfig]) -> IsolatedPool:
    """A task's one supervised decoding process (started before the task opens its shard: py-lmdb's fork rule)."""
    pseudo, cfg = setup
    return IsolatedPool(1, init_worker, (pseudo, cfg), memory=cfg.worker_memory, timeout=cfg.decode_timeout)


@dataclass
class BatchResult:
    """What a series task did: the path of its finished shard (None if it committed nothing), the xxh3-128
    of its ``data.mdb`` (:func:`~medload.storage.task_shard.shard_digest`) and its report."""

    shard: str | None
    digest: str | None = None
    series: list[SeriesOutcome] = field(default_factory=list)
    rejects: list[RejectRecord] = field(default_factory=list)
    slices: int = 0


class _Kept:
    """A process's decoding process and ring, kept from one task to the next while ``on`` (see
    :func:`keep_across_tasks`): for tasks of another setup (another ingest) a new decoder is forked, and
    after a task that did not finish both are dropped (its decoder may still hold chunks of it). ``busy``:
    a task is using them (a release then waits for its end); changed under ``lock``, as a Dask worker
    releases them from another thread than its tasks'."""

    def __init__(self) -> None:
        self.on, self.busy = True, False
        self.lock = threading.Lock()
        self.pool: IsolatedPool | None = None
        self.setup_id: tuple[str, IngestConfig] | None = None
        self.rings = RingSupply(keep=True)

    def pool_for(self, setup: tuple[Pseudonymizer, IngestConfig]) -> IsolatedPool:
        ident = (setup[0].fingerprint, setup[1])  # the key its decoder pseudonymises with, and the settings
        if self.pool is not None and self.setup_id != ident:
            self.drop()
        if self.pool is None:
            self.pool, self.setup_id = isolated_pool(setup), ident
        return self.pool

    def drop(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.rings.close()


_kept: _Kept | None = None


def keep_across_tasks() -> None:
    """Make this process keep its decoding process and its ring from one task (:func:`series_task`, a
    header task on Dask) to the next, until :func:`release_kept` or its exit. For a process that runs one
    task at a time: this machine's task processes, a single-threaded Dask worker. Forking a decoder and
    creating, zeroing and faulting in a ring of about 100 MB for every task cost more CPU than many a
    task's writing (docs/benchmarks.md)."""
    global _kept
    if _kept is None:
        _kept = _Kept()
        Finalize(None, _kept.drop, exitpriority=10)
    _kept.on = True


def release_kept() -> None:
    """Close this process's kept decoding process and ring, and keep none from here on (a Dask worker at
    the end of an ingest: a cluster may serve other work); a task using them (of another ingest sharing
    the cluster) finishes first, and they are closed at its end."""
    if _kept is not None:
        with _kept.lock:
            _kept.on = False
            if not _kept.busy:
                _kept.drop()


@contextmanager
def task_pool(setup: tuple[Pseudonymizer, IngestConfig]) -> Iterator[tuple[IsolatedPool, RingSupply | None]]:
    """The decoding process of one task, with the ring supply its writing uses: this process's kept ones
    (:func:`keep_across_tasks`), or a process of the task's own (and a ring per call), closed after it. The
    codec is imported first, so that a decoder forked here inherits it (a Dask worker keeps it)."""
    get_codec(setup[1].codec).load()
    kept = _kept
    if kept is not None:
        with kept.lock:
            if kept.on:
                kept.busy = True
            else:
                kept = None
    if kept is None:
        with isolated_pool(setup) as pool:
            yield pool, None
        return
    finished = False
    try:
        yield kept.pool_for(setup), kept.rings
        finished = True
    finally:
        with kept.lock:
            kept.busy = False
            if not (finished and kept.on):
                kept.drop()


def series_task(plans: list[SeriesPlan], shard_prefix: str, setup: tuple[Pseudonymizer, IngestConfig]) -> BatchResult:
    """Decode and write ``plans`` into a new shard ``<shard_prefix>-<random>.lmdb`` (each attempt its own)."""
    cfg = setup[1]
    report = IngestReport(store="")
    path = Path(f"{shard_prefix}-{secrets.token_hex(4)}.lmdb")
    with task_pool(setup) as (pool, rings):  # forked before the shard is opened (py-lmdb's rule)
        writer = TaskShardWriter(path, cfg.windows)
        try:
            decode_and_write(pool, writer, plans, cfg, report, False, None, rings)
        finally:
            held = writer.close()
    return BatchResult(str(path) if held else None, shard_digest(path) if held else None, report.series, report.rejects,
                       report.slices_written)


class TaskRunner(Protocol):
    """Where series tasks run: a Dask client, or this machine's task processes."""

    def submit(self, key: str, fn: Callable[..., BatchResult], *args: object) -> Any: ...

    def completed(self, futures: list[Any]) -> Iterable[Any]: ...

    def result(self, future: Any) -> BatchResult: ...

    def cancel(self, futures: list[Any]) -> None: ...


def write_in_tasks(runner: TaskRunner, plans: list[SeriesPlan], writer: StoreWriter, report: IngestReport, *,
                   parts: int, prefix: str, setup: object, progress: bool, labels: LabelAssigner | None,
                   name: str = "", floor: int = 0) -> None:
    """Write ``plans`` in about ``parts`` tasks of ``runner`` (shards named ``<prefix><batch>-...``; none
    cut below ``floor`` bytes of pixels, :func:`cut_batches`) and publish each finished shard; outcomes go to
    ``report`` in plan order."""
    batches = cut_batches([_pixel_bytes(p) for p in plans], parts, writer.shard_bytes, floor)
    futures = {runner.submit(f"medload-series-{name}-{i}", series_task, [plans[j] for j in b], f"{prefix}{i:06d}",
                             setup): i for i, b in enumerate(batches)}
    results: dict[int, BatchResult] = {}
    try:
        total = sum(len(p.geom.slots) for p in plans)
        with progress_bar("decoding and writing slices", total, enabled=progress) as advance:
            for future in runner.completed(list(futures)):
                i = futures[future]
                batch = [plans[j] for j in batches[i]]
                try:
                    result = runner.result(future)
                except DiskFullError as exc:  # stops the run, naming the store: what was published stays
                    raise DiskFullError(str(exc), exc.stage, str(writer.root)) from None
                except Exception as exc:  # noqa: BLE001 -- the task failed, not an input
                    result = _failed(batch, exc)
                if result.shard is not None:
                    stored = writer.adopt(Path(result.shard), result.digest)
                    if labels is not None:
                        labels.stored.update(stored)
                results[i] = result
                advance(sum(len(p.geom.slots) for p in batch))
    finally:
        runner.cancel(list(futures))
        for i in sorted(results):  # outcomes in plan order, whatever order the tasks finished in
            report.series += results[i].series
            report.rejects += results[i].rejects
            report.slices_written += results[i].slices


def _pixel_bytes(plan: SeriesPlan) -> int:
    h = plan.cand.first
    return len(plan.geom.slots) * h.rows * h.cols * 2


def _failed(batch: list[SeriesPlan], exc: BaseException) -> BatchResult:
    reason = (f"its task failed ({type(exc).__name__}: {exc}); nothing of it was stored: run the ingest "
              "again to retry it")
    log.error("a task writing %d series failed: %s", len(batch), exc)
    outcomes = [SeriesOutcome(p.cand.key.hex(), "failed", p.cand.first.modality, len(p.cand.headers),
                              (len(p.geom.slots), p.cand.first.rows, p.cand.first.cols), reason) for p in batch]
    return BatchResult(None, None, outcomes)

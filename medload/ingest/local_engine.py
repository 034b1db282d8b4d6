"""Ingest on this machine's cores: the header pass in supervised processes, series written by task processes.

The header pass runs in an :class:`~medload.ingest.isolation.IsolatedPool` of ``workers`` processes.
The planned series are then written as :mod:`medload.ingest.shard_tasks` describes, by ``workers`` task
processes, each with one supervised decoding process of its own: a decoder
decodes, converts to HU, windows, compresses, checksums and digests; its task process puts the values
into a shard of its own. This process only plans, and publishes each finished shard (a rename and a
rewrite of ``store.json``), so no single process carries every slice's bytes and the throughput grows
with the cores (docs/benchmarks.md).

Task shards live in ``staging/task-<run>-...lmdb``, where the store's writer looks for what an
interrupted ingest left (:meth:`~medload.storage.writer.StoreWriter` publishes the series committed in
them when it opens): after a kill -9 the next run publishes what was committed and writes the rest. When
a run stops on an error or a signal, its task processes are stopped and the series they committed are
published before it ends, as with one writer.

With one worker, or ``--force`` (a few series to replace), this process writes through the store's writer, which
records the replacement (:mod:`medload.storage.live`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

import lmdb

from medload.config import IngestConfig, format_size
from medload.deid import Pseudonymizer
from medload.errors import DiskFullError, StoreError, WorkerDiedError
from medload.ingest.discover import SourceRef
from medload.ingest.headers import SliceHeader
from medload.ingest.isolation import IsolatedPool, death_reason, die_with_parent
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput
from medload.ingest.memory_need import WORKER_BYTES
from medload.ingest.report import IngestReport
from medload.ingest.ring import remove_dead_rings, short_of_shared_memory
from medload.ingest.shard_tasks import BatchResult, keep_across_tasks, write_in_tasks
from medload.ingest.stages import SeriesPlan, decode_and_write, header_pass
from medload.ingest.worker import init_worker
from medload.storage.codec import get_codec
from medload.storage.space import disk_full_is_error
from medload.storage.task_shard import committed_series
from medload.storage.writer import StoreWriter

__all__ = ["LocalEngine"]

log = logging.getLogger(__name__)

_TASKS_PER_WORKER = 2  # batches per task process: enough to even out series of different sizes
# no task cut below this many bytes of pixels: a small ingest stays one shard (or a few) instead of one per
# series, and each task's start, shard and fsync are paid for by enough slices (64 of 512 x 512 int16); above
# it, tasks are a share of the ingest (2 per worker): the 2,048 slices of 512 x 512 of the scaling benchmark
# are 4 tasks of 512 slices at 2 workers
_MIN_TASK_BYTES = 32 << 20


def _task_process_start() -> None:
    """A task process dies with the ingest process (kill -9 too: none writes on into staging/ unsupervised)
    and keeps its decoding process and ring from one task to the next."""
    die_with_parent()
    keep_across_tasks()


class _ProcessRunner:
    """Series tasks in ``workers`` processes of this machine (see :class:`~medload.ingest.shard_tasks.TaskRunner`)."""

    def __init__(self, workers: int) -> None:
        self.executor = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=_task_process_start)
        self.executor.submit(os.getpid)  # forks every worker now (with "fork", all at the first task), not waited for
        self._broken: str | None = None  # why the pool broke, once a task process died

    def submit(self, key: str, fn: Callable[..., BatchResult], *args: object) -> Future[BatchResult]:
        return self.executor.submit(fn, *args)

    def completed(self, futures: list[Future[BatchResult]]) -> Iterable[Future[BatchResult]]:
        return as_completed(futures)

    def result(self, future: Future[BatchResult]) -> BatchResult:
        try:
            return future.result()
        except BrokenProcessPool as exc:  # a task process died, and every task running or queued with it
            raise WorkerDiedError(self._why_broken()) from exc

    def _why_broken(self) -> str:
        """What killed the pool: the exit of a task process other than those it then terminated itself."""
        if self._broken is None:
            # the pool's manager thread reaps every process before it ends: reading an exit code while it does
            # could lose the race for the process's status (no public way to either before Python 3.14)
            manager = getattr(self.executor, "_executor_manager_thread", None)  # typeshed has the type wrong
            if manager is not None:
                manager.join(timeout=60)
            self._broken = self._death(p.exitcode for p in list((self.executor._processes or {}).values()))
        return self._broken

    @staticmethod
    def _death(exitcodes: Iterable[int | None]) -> str:
        ended = list(exitcodes)
        causes = sorted({c for c in ended if c is not None and c != -signal.SIGTERM})
        died = death_reason(causes[0], "a task process") if causes else "a task process ended"
        return (f"{died}, and the tasks running or queued beside it failed with it. If memory ran out (each worker "
                f"holds about {format_size(WORKER_BYTES)}, and this pool had {len(ended)}), run again with fewer --workers")

    def cancel(self, futures: list[Future[BatchResult]]) -> None:
        """Nothing: :meth:`close` ends what still runs. Cancelling a queued task here raced with the pool's
        own handling of a task process that died (Python 3.11 then failed to set the cancelled task's error,
        its manager thread died, and the interpreter hung at exit on the pool's queue: CPython gh-107219)."""

    def close(self, stopping: bool) -> None:
        """Wait for the running tasks; ``stopping`` (a signal, an error): end them at once instead, and remove
        the shared-memory rings the killed processes kept (up to about 100 MB each)."""
        if stopping:
            for process in list(self.executor._processes.values()):  # no public way before Python 3.14
                process.kill()
        self.executor.shutdown(wait=True, cancel_futures=True)
        if stopping:
            remove_dead_rings()


class LocalEngine:
    """The header pass and the writing of series on this machine, for :func:`medload.ingest.ingest`."""

    def __init__(self, cfg: IngestConfig, pseudo: Pseudonymizer, *, in_process: bool = False) -> None:
        self.cfg, self.pseudo = cfg, pseudo
        # every process is forked here, before the store is opened (py-lmdb's rule for fork), after the codec's
        # import: each task process and decoding process inherits it instead of importing it (blosc2, 86 ms of
        # CPU per process: 5.5 s at 64 workers, against 86 ms once here)
        get_codec(cfg.codec).load()
        self.runner = None if in_process else _ProcessRunner(cfg.worker_count)
        if (short := short_of_shared_memory(1 if in_process else cfg.worker_count)) is not None:
            log.warning("%s", short)
        self.pool = IsolatedPool(cfg.worker_count, init_worker, (pseudo, cfg), memory=cfg.worker_memory,
                                 timeout=cfg.decode_timeout)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.pool.close()
        finally:
            if self.runner is not None:
                self.runner.close(stopping=exc[0] is not None)

    def headers(self, refs: list[SourceRef], report: IngestReport, progress: bool,
                label_inputs: list[LabelInput], archives: list[tuple[SourceRef, str]] | None = None) -> list[SliceHeader]:
        return header_pass(self.pool, refs, report, progress, label_inputs, archives)

    def write(self, plans: list[SeriesPlan], writer: StoreWriter, report: IngestReport, progress: bool,
              labels: LabelAssigner | None) -> None:
        if self.runner is None:
            decode_and_write(self.pool, writer, plans, self.cfg, report, progress, labels)
            return
        if not plans:
            return
        self.pool.close()  # its processes are idle from here on
        run, runner = secrets.token_hex(4), self.runner
        self.runner = None
        stopping = True
        try:
            write_in_tasks(runner, plans, writer, report, parts=_TASKS_PER_WORKER * self.cfg.worker_count,
                           prefix=str(writer.root / "staging" / f"task-{run}-"), setup=(self.pseudo, self.cfg),
                           progress=progress, labels=labels, name=run, floor=_MIN_TASK_BYTES)
            stopping = False
        finally:
            runner.close(stopping)
            left = _publish_left(writer, run, labels)
        report.published_after_all({k.hex() for k in left}, "its task failed after committing it: published from "
                                    "the task's shard")


def _publish_left(writer: StoreWriter, run: str, labels: LabelAssigner | None) -> set[bytes]:
    """Publish the series that stopped tasks of run ``run`` committed; remove their empty shards. The keys of
    the series published."""
    published: set[bytes] = set()
    for path in sorted((writer.root / "staging").glob(f"task-{run}-*.lmdb")):
        try:
            with disk_full_is_error(writer.root, "publish", f"publishing {path.name}"):
                if committed_series(path):
                    stored = writer.adopt(path)
                    published.update(stored)
                    if labels is not None:
                        labels.stored.update(stored)
                else:
                    shutil.rmtree(path, ignore_errors=True)
        except (DiskFullError, StoreError, OSError, lmdb.Error) as exc:  # the next ingest into the store publishes it
            log.warning("%s is left in staging for the next ingest to publish: %s", path.name, exc)
    return published

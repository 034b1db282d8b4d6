"""Where an ingest on Dask runs: a ``--scheduler`` value becomes a ``distributed.Client``.

- ``local`` / ``local:N``: a LocalCluster of N single-threaded worker processes on this machine
  (default: ``--workers``, else one per core), closed when the ingest ends.
- ``tcp://HOST:PORT`` / ``tls://HOST:PORT``: a running scheduler (``dask scheduler``, ``dask worker``).
- ``slurm`` / ``slurm:JOBS``: dask-jobqueue's ``SLURMCluster`` with JOBS jobs (default 1), each job's
  cores, memory, queue, account and walltime taken from the ``jobqueue.slurm`` section of the Dask
  configuration (``~/.config/dask/jobqueue.yaml``), as dask-jobqueue documents.

Two rules hold for every cluster, and are checked before any task is sent:

1. Workers must not be *daemonic* processes: each task reads its inputs in a decoding process of its
   own (:mod:`medload.ingest.isolation`), and Python refuses children to daemonic processes. Clusters
   medload starts are configured so; workers started by hand need ``DASK_DISTRIBUTED__WORKER__DAEMON=False``
   in their environment (or ``distributed.worker.daemon: false`` in their Dask configuration).
2. Sources and the store must be at the same paths on every worker (a shared file system): tasks
   read the sources and write their shards under the store's ``staging/`` directory.

The pseudonymisation key travels to the workers with the tasks (they compute the pseudonyms): use a
``tls://`` scheduler when workers are on other machines.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Literal, cast

from medload.errors import ConfigError
from medload.extras import require_all

if TYPE_CHECKING:
    from distributed import Client, LocalCluster  # an optional extra: imported where used

__all__ = ["connect", "parse_scheduler", "local_cluster", "slurm_cluster", "check_workers_see"]

log = logging.getLogger(__name__)

_NOT_DAEMON = {"distributed.worker.daemon": False}
_FORMS = "use local, local:N, tcp://HOST:PORT, tls://HOST:PORT, slurm or slurm:JOBS"


def parse_scheduler(text: str) -> tuple[Literal["local", "slurm"], int | None] | tuple[Literal["address"], str]:
    """``("local", N | None)``, ``("address", "tcp://...")`` or ``("slurm", JOBS | None)`` from a
    ``--scheduler`` value; anything else is a ConfigError that lists the forms."""
    text = text.strip()
    if "://" in text:
        if not text.startswith(("tcp://", "tls://")):
            raise ConfigError(f"scheduler {text!r}: a running Dask scheduler is a tcp:// or tls:// address; {_FORMS}")
        return "address", text
    name, _, count = text.partition(":")
    if name in ("local", "slurm"):
        kind = cast(Literal["local", "slurm"], name)  # just checked
        if not count:
            return kind, None
        if count.isdigit() and int(count) > 0:
            return kind, int(count)
    raise ConfigError(f"scheduler {text!r}: {_FORMS}")


@contextmanager
def connect(scheduler: str, default_workers: int) -> Iterator[Client]:
    """A ``distributed.Client`` for ``scheduler`` whose workers may start decoding processes; a cluster
    started here is closed on exit."""
    require_all("dask", "--scheduler (ingest on a Dask cluster)")
    from distributed import Client

    parsed = parse_scheduler(scheduler)
    with ExitStack() as stack:
        try:
            if parsed[0] == "local":
                client = Client(stack.enter_context(local_cluster(parsed[1] or default_workers)))
            elif parsed[0] == "slurm":
                cluster = slurm_cluster()
                stack.callback(cluster.close)
                cluster.scale(jobs=parsed[1] or 1)
                client = Client(cluster)
                log.info("waiting for a Slurm job's Dask worker to start")
                client.wait_for_workers(1)
            else:
                client = Client(parsed[1], timeout="30s")
        except OSError as exc:
            raise ConfigError(f"cannot reach the Dask scheduler {scheduler}: {exc} (is it running? is the address "
                              "right?)") from None
        stack.callback(client.close)
        _check_not_daemonic(client, scheduler)
        if client.scheduler is None:  # a Client started above is connected; a closed one has none
            raise ConfigError(f"the Dask client of {scheduler} has no scheduler connection: start the ingest again")
        log.info("ingest on Dask at %s: %d workers", client.scheduler.address, len(client.scheduler_info()["workers"]))
        yield client


@contextmanager
def local_cluster(workers: int) -> Iterator[LocalCluster]:
    """A LocalCluster of ``workers`` single-threaded, non-daemonic worker processes, closed on exit (what
    ``local:N`` starts; start one yourself to share it between ingests, and pass its ``scheduler_address``).

    Its nannies read ``distributed.worker.daemon`` each time they (re)start a worker, so this process's
    Dask configuration says False until the cluster is closed.

    Examples:
        >>> with local_cluster(2) as cluster:                                    # doctest: +SKIP
        ...     ingest("dicom/", "stores/ct", scheduler=cluster.scheduler_address)
    """
    require_all("dask", "A local Dask cluster")
    import dask
    from distributed import LocalCluster

    # each worker process runs dask_setup below as it starts
    preload = [*dask.config.get("distributed.worker.preload", default=[]), __name__]
    with dask.config.set({**_NOT_DAEMON, "distributed.worker.preload": preload}):
        # ":0": the dashboard on a free port (its default, 8787, warns when another cluster holds it).
        # A failed task comes back to the ingest, which reports it (a failed row, or the error that stops
        # the run): the workers' own tracebacks of it show only with -v
        quiet = logging.WARNING if log.isEnabledFor(logging.INFO) else logging.CRITICAL
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                               silence_logs=quiet)
        try:
            yield cluster
        finally:
            cluster.close()


def dask_setup(worker: object) -> None:  # a distributed.Worker, unused
    """Preload of the worker processes of a LocalCluster medload starts: they ignore Ctrl-C and SIGTERM. The
    terminal (or ``kill`` of the process group) sends them to every process of the ingest, and a worker stopped
    mid-task prints its tracebacks, or is restarted by its nanny, with warnings; the ingest stops on either
    signal and closes the cluster, whose nannies stop their workers (SIGKILL when they do not stop in time)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def slurm_cluster():
    """dask-jobqueue's SLURMCluster, set up from the ``jobqueue.slurm`` Dask configuration, whose job script
    starts workers that may start decoding processes (no jobs submitted yet: ``scale(jobs=N)`` does)."""
    require_all("slurm", "--scheduler slurm")
    from dask_jobqueue import SLURMCluster
    try:
        return SLURMCluster(job_script_prologue=["export DASK_DISTRIBUTED__WORKER__DAEMON=False"])
    except ValueError as exc:
        raise ConfigError(f"Slurm cluster settings: {exc} (set cores, memory and queue under jobqueue.slurm in "
                          "~/.config/dask/jobqueue.yaml; see docs/dask.md)") from None


def _daemonic() -> bool:
    return bool(multiprocessing.current_process().daemon)


def _check_not_daemonic(client: Client, scheduler: str) -> None:
    flagged = sorted(addr for addr, daemonic in client.run(_daemonic).items() if daemonic)
    if flagged:
        raise ConfigError(
            f"the Dask workers {', '.join(flagged)} of {scheduler} are daemonic processes, which may not start the "
            "decoding processes medload reads each input in: start them with DASK_DISTRIBUTED__WORKER__DAEMON=False "
            "(or distributed.worker.daemon: false in their Dask configuration)")


def check_workers_see(client: Client, path: str, what: str) -> None:
    """ConfigError unless every worker sees ``path`` (sources and the store must be on a shared file system)."""
    blind = sorted(addr for addr, seen in client.run(os.path.exists, path).items() if not seen)
    if blind:
        raise ConfigError(f"the Dask workers {', '.join(blind)} do not see {what} {path}: sources and the store must "
                          "be at the same paths on every worker (a shared file system)")

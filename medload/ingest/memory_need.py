"""What an ingest will hold -- the ingest process per file, each worker -- against the memory left to it.

The ingest process keeps every plane's header from the header pass until its series is planned: 1.51 GB
per million files, measured by ``benchmarks/ingest_rss.py --files 1000000`` (docs/benchmarks.md, issue 32),
and the task processes hold their own batches' share of it on top. An archive too large for the free
memory is said before the header pass starts -- not after an hour of reading, by the kernel's OOM killer
-- with what to do: ingest it in parts, each run adding to the store what it lacks.

Each worker holds about :data:`WORKER_BYTES` while it writes: its shared-memory ring (``RING_BYTES``,
tmpfs pages the kernel cannot reclaim without swap) and its task and decoding processes (about 55 MB
resident together, measured at 1-8 workers on 2,048 files of 512 x 512: docs/benchmarks.md). An ingest
whose workers want more than the memory left hangs in reclaim or is killed by the OOM killer (seen here:
2 workers in a 400 MB cgroup ran 2 minutes without finishing, 1 worker finished in 7.5 s), so the default
worker count -- one per usable core -- is lowered to what fits, and an explicit ``--workers`` that does
not fit is warned about before anything starts.

Free memory is Linux's ``MemAvailable`` or what this process's cgroups leave it, whichever is less
(:func:`medload.cgroup_limits.available_memory`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from medload.cgroup_limits import available_memory
from medload.config import IngestConfig, format_size
from medload.ingest.ring import RING_BYTES

__all__ = ["BYTES_PER_FILE", "WORKER_BYTES", "fit_workers", "short_of_memory"]

log = logging.getLogger(__name__)

#: what the ingest process holds per file until the series are planned (1,573 MB at a million files), rounded up
BYTES_PER_FILE = 1600
#: the share of the free memory the ingest process may take: the rest is for its workers and their tasks
_SHARE = 0.8
#: what one worker holds while it writes: its ring and its two processes' resident memory (module docstring)
WORKER_BYTES = RING_BYTES + (64 << 20)
#: the share of the free memory the workers may take: the rest for the ingest process and the page cache
_WORKER_SHARE = 0.75


def short_of_memory(files: int, available: int | None = None) -> str | None:
    """A warning for an ingest of ``files`` files whose headers will not fit in the free memory (``available``
    bytes; None: :func:`available_memory`), or None."""
    free = available_memory() if available is None else available
    need = files * BYTES_PER_FILE
    if free is None or need <= _SHARE * free:
        return None
    return (f"{files:,} files: the ingest process will hold about {format_size(need)} of headers until their series "
            f"are planned (about {BYTES_PER_FILE:,} bytes a file), and this machine has {format_size(free)} free: "
            f"it may run out of memory. Ingest the archive in parts (a few folders per run: each run adds what "
            f"the store lacks), or on a machine with more memory")


def fit_workers(cfg: IngestConfig, available: int | None = None) -> IngestConfig:
    """``cfg`` with as many workers as fit in the free memory (``available`` bytes; None:
    :func:`~medload.cgroup_limits.available_memory`) where it asks for the default (one per usable core) and
    that many do not fit; an explicit worker count is kept, with a warning where it does not fit."""
    free = available_memory() if available is None else available
    wanted = cfg.worker_count
    if free is None or wanted * WORKER_BYTES <= _WORKER_SHARE * free:
        return cfg
    fits = max(1, int(_WORKER_SHARE * free) // WORKER_BYTES)
    if fits >= wanted:
        return cfg  # one worker, the fewest there are (the headers' own need is short_of_memory's)
    why = (f"each ingest worker holds about {format_size(WORKER_BYTES)} (its shared-memory ring and two processes) "
           f"and {format_size(free)} of memory is free to this process (the machine's, or its container's or "
           f"job's cgroup limit less what it holds)")
    if cfg.workers is not None:
        log.warning("%d workers: %s; they may run out of memory, which stalls the ingest or gets it killed: "
                    "use --workers %d or fewer, or give it more memory", wanted, why, fits)
        return cfg
    log.warning("using %d worker%s rather than one per usable core (%d): %s; --workers chooses", fits,
                "" if fits == 1 else "s", wanted, why)
    return replace(cfg, workers=fits)

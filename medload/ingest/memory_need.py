"""What the ingest process will hold for an ingest of N files, against the memory this machine has free.

The ingest process keeps every plane's header from the header pass until its series is planned: 1.51 GB
per million files, measured by ``benchmarks/ingest_rss.py --files 1000000`` (docs/benchmarks.md, issue 32),
and the task processes hold their own batches' share of it on top. An archive too large for the free
memory is said before the header pass starts -- not after an hour of reading, by the kernel's OOM killer
-- with what to do: ingest it in parts, each run adding to the store what it lacks.

Free memory is Linux's ``MemAvailable`` (/proc/meminfo), or what is left under the cgroup's limit (a
container's, a Slurm job's: ``memory.max`` less ``memory.current``, cgroup v2) where that is less.
"""

from __future__ import annotations

from pathlib import Path

from medload.config import format_size

__all__ = ["BYTES_PER_FILE", "available_memory", "short_of_memory"]

#: what the ingest process holds per file until the series are planned (1,573 MB at a million files), rounded up
BYTES_PER_FILE = 1600
#: the share of the free memory the ingest process may take: the rest is for its workers and their tasks
_SHARE = 0.8


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still allocate, as far as the system says (None where it does not say)."""
    free = None
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((cgroup / "memory.current").read_text().strip())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return None if free is None else max(0, free)


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

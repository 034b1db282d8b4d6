"""What every benchmark section shares: peak memory of a process tree, medians, the machine, file sizes.

Peak memory is the proportional set size (PSS, from ``/proc/<pid>/smaps_rollup``) of a process and all
its descendants, sampled by a thread: pages shared between the processes of a run (DataLoader workers
forked from the trainer, a memory-mapped file read by all of them) are counted once in the sum.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from medload.config import affinity_cores

__all__ = ["peak_pss", "tree_pss_mb", "spread", "loader_row", "machine", "tree_bytes", "tree_read_bytes", "data_files",
           "evict_page_cache", "read_files", "OtherLoad", "BUSY_SHARE", "load_note", "error_text"]


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a non-empty sequence."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def error_text(exc: BaseException) -> str:
    """A failed contender's error, as its row shows it: ``Type: message``; where torch could not allocate
    shared memory (in a DataLoader worker, whose error torch re-raises as "Caught X in DataLoader worker
    process N" and the worker's traceback), that last line alone, with the size of ``/dev/shm`` and the fix:
    a container's is 64 MiB unless it is given more, and every peer with workers fails there."""
    text = f"{type(exc).__name__}: {exc}".strip()
    last = text.splitlines()[-1]
    if "unable to allocate shared memory" not in last:
        return text
    try:
        st = os.statvfs("/dev/shm")
        size = f"{st.f_blocks * st.f_frsize >> 20} MiB"
    except OSError:
        size = "too small"
    return f"{last}; /dev/shm is {size}: give a container more (docker run --shm-size=2g)"


def loader_row(name: str, workers: int, mode: str, res: dict, count: str, mb_per: str, **extra: object) -> dict:
    """One loading contender's row from its child's result ``res``: status (``skipped`` with its reason,
    ``failed`` with its error), peak PSS and set-up time, and when it ran, the median and range over the
    repeats of ``res[count]`` per second (``<count>_per_s``...) and the MB read from disk per item
    (key ``mb_per``); ``extra`` fields come after the contender, workers and mode."""
    row = {"contender": name, "num_workers": workers, "mode": mode, **extra, "status": "ok", "error": None,
           "peak_pss_mb": res.get("peak_pss_mb"), "setup_s": res.get("setup_s")}
    if "skipped" in res:
        row.update(status="skipped", reason=res["skipped"], peak_pss_mb=None)
    elif "error" in res:
        row.update(status="failed", error=res["error"])
    else:
        s = spread([n / t for n, t in zip(res[count], res["seconds"])])
        row.update({f"{count}_per_s": s["median"], f"{count}_per_s_min": s["min"], f"{count}_per_s_max": s["max"],
                    mb_per: sum(res["disk_bytes"]) / 1e6 / sum(res[count])})
    return row


def tree_bytes(path: str | os.PathLike) -> int:
    """Sum of the sizes of the regular files under ``path`` (a file: its size; missing: 0)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---- memory: PSS of a process tree, sampled by a thread ------------------------------------------
def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # the process (or thread) ended meanwhile
    return pids


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_pss_mb(pid: int) -> float:
    """PSS of ``pid`` and its descendants now (MB)."""
    return sum(_pss_kib(p) for p in _tree(pid)) * 1024 / 1e6


class peak_pss:  # noqa: N801 - used like a function
    """``with peak_pss(pid) as peak:`` samples the PSS of ``pid`` and its descendants every ``interval``
    seconds in a thread; ``peak.mb`` is the largest sum seen (MB)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval, self.kib = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.kib = max(self.kib, sum(_pss_kib(p) for p in _tree(self.pid)))
            self._stop.wait(self.interval)

    @property
    def mb(self) -> float:
        return self.kib * 1024 / 1e6

    def __enter__(self) -> peak_pss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---- disk reads and the page cache ---------------------------------------------------------------
def _read_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_read_bytes() -> int:
    """Bytes this process and its descendants have had read from storage (``read_bytes`` of
    ``/proc/<pid>/io``: reads the page cache could not serve, readahead included). Children that have
    ended are in it: the kernel adds a reaped child's counts to its parent's."""
    return sum(_read_bytes(p) for p in _tree(os.getpid()))


def data_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The files under ``paths`` (files or folders; links to files included)."""
    out: list[Path] = []
    for top in map(Path, paths):
        out.extend(sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top] if top.is_file() else [])
    return out


def evict_page_cache(files: Sequence[Path]) -> None:
    """Drop these files' pages from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), as if the
    machine had not read them since boot. Pages some process has mapped stay (the kernel cannot drop a
    mapped page), and so do dirty ones: call ``os.sync()`` once after writing the files."""
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(files: Sequence[Path]) -> None:
    """Read these files once, so that they are in the page cache."""
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass


def _busy_ticks() -> int:
    """CPU time the whole machine has spent busy since boot, in clock ticks (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return sum(fields[:8]) - idle


def _tree_ticks() -> int:
    """CPU time of this process's tree, ended children included (utime, stime, cutime, cstime)."""
    total = 0
    for pid in _tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])
        except (OSError, ValueError, IndexError):
            continue
    return total


class OtherLoad:
    """``with OtherLoad() as watch:`` measures the share of the machine's CPU time that processes *other*
    than this one and its descendants used meanwhile (``watch.share``, 0..1): a benchmark's own work
    never counts against it, as it would in the load average."""

    def __init__(self) -> None:
        self.share: float | None = None

    def __enter__(self) -> OtherLoad:
        self._start: tuple[float, int, int] | None
        try:
            self._start = (time.monotonic(), _busy_ticks(), _tree_ticks())
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        t0, busy0, ours0 = self._start
        elapsed = time.monotonic() - t0
        others = (_busy_ticks() - busy0) - (_tree_ticks() - ours0)
        capacity = elapsed * affinity_cores() * os.sysconf("SC_CLK_TCK")
        self.share = max(0.0, others / capacity) if capacity > 0 else None


BUSY_SHARE = 0.25
"""Other processes using more than this share of the CPUs during a section make its figures suspect."""


def load_note(section: str, share: float | None) -> str | None:
    """A warning when other processes used more than :data:`BUSY_SHARE` of the CPUs during ``section``:
    its figures are then low, and a target may fail for that reason alone; None on a quiet machine."""
    if share is None or share <= BUSY_SHARE:
        return None
    return (f"{section}: other processes used {100 * share:.0f}% of the CPUs meanwhile; its figures are low and a "
            "target may fail for that reason alone: run the benchmark again on a quiet machine")


# ---- the machine ---------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError):
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def dcm2niix_version() -> str | None:
    """dcm2niix's version string, or None when it is not on PATH."""
    exe = shutil.which("dcm2niix")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.strip().splitlines() or ["unknown"])[-1].strip()


def machine() -> dict:
    """The machine and the versions that shape the figures."""
    info = {"cpu": _cpu_model(), "cores": affinity_cores(), "memory_gb": _memory_gb(), "os": platform.platform(),
            "arch": platform.machine(), "python": platform.python_version(), "dcm2niix": dcm2niix_version()}
    for dist in ("medload", "torch", "monai", "numpy", "pydicom", "SimpleITK", "lmdb", "blosc2"):
        info[dist.lower()] = _version(dist)
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["cuda"] = None
    return info
